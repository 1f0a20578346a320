"""Chapter 05's reference solutions: the 1F1B schedule as data, and an executor
that runs a schedule over ``isend``/``irecv`` (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2.1).
``dtlab.exercises.solution(name)`` shows each; :mod:`.ch05_pipeline` checks a
learner's against them."""

from __future__ import annotations

__all__ = ["one_f_one_b_order", "run_stage"]


def one_f_one_b_order(stage, p, m):
    """Stage ``stage``'s compute order under 1F1B for ``p`` stages and ``m``
    microbatches, as ``("F", i)`` / ``("B", i)`` tuples: a warm-up of
    ``p − stage − 1`` forwards (enough to keep the stages behind busy), a steady
    state of one forward and one backward, then the cool-down's backwards. At most
    ``p − stage`` microbatches are ever in flight on the stage."""
    warmup = min(p - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: F of a new one, B of the oldest
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]  # cool-down
    return order


def run_stage(actions, io):
    """Run this stage's ``actions`` (``dtlab.pipeline.Action``: ``op`` F, B,
    send_act, recv_act, send_grad, recv_grad; ``microbatch``; ``peer``) in order.

    ``io.forward(i, x)`` runs the stage on microbatch i (``x``: the activation
    received, ``None`` on the first stage) and returns its output (the loss on the
    last stage); ``io.backward(i, out, grad)`` back-propagates ``grad`` (``None`` on
    the last stage) through that output and returns the input's gradient (``None``
    on the first stage). ``io.irecv(peer)`` returns ``(handle, buffer)``,
    ``io.isend(tensor, peer)`` a handle. Receives are waited before the compute
    that needs them; sends are posted and waited only at the end, so no stage ever
    blocks on a peer that is itself waiting to send."""
    received, outputs, input_grads, sends = {}, {}, {}, []
    for a in actions:
        i = a.microbatch
        if a.op in ("recv_act", "recv_grad"):
            handle, received[a.op, i] = io.irecv(a.peer)
            handle.wait()  # the next compute needs it
        elif a.op == "F":
            outputs[i] = io.forward(i, received.pop(("recv_act", i), None))
        elif a.op == "send_act":
            sends.append(io.isend(outputs[i], a.peer))  # posted, not waited
        elif a.op == "B":
            grad = received.pop(("recv_grad", i), None)
            input_grads[i] = io.backward(i, outputs.pop(i), grad)
        elif a.op == "send_grad":
            sends.append(io.isend(input_grads.pop(i), a.peer))
    for handle in sends:  # every send completes before the step ends
        handle.wait()

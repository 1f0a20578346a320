"""The mistakes learners make in chapter 05's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it)."""

from __future__ import annotations

from dtlab.exercises import ch05_pipeline  # noqa: F401 - declares the exercises
from dtlab.exercises.ch05_mistakes import receives_every_gradient_first  # noqa: F401
from dtlab.exercises.ch05_solutions import run_stage
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- one_f_one_b ---------------------------------------------------------------------
def _order(stage, p, m, warmup):
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


@mistake("one_f_one_b", expect="GPipe's order")
def all_forwards_then_all_backwards(stage, p, m):
    """GPipe: the same bubble, but every microbatch's activations held at once."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


@mistake("one_f_one_b", expect="warm up with p − stage − 1")
def one_warm_up_forward_too_many(stage, p, m):
    """A warm-up of p − stage forwards: one microbatch more than needed in flight."""
    return _order(stage, p, m, min(p - stage, m))


@mistake("one_f_one_b", expect="the simulated bubble is")
def too_few_warm_up_forwards(stage, p, m):
    """A warm-up of p − stage − 2: the stage asks for a gradient too early and
    idles until it comes back, a bigger bubble."""
    return _order(stage, p, m, max(0, min(p - stage - 2, m)))


@mistake("one_f_one_b", expect="before its F")
def backward_before_its_forward(stage, p, m):
    """The steady state in the wrong order: B of microbatch i before F of i."""
    order = []
    for i in range(m):
        order += [("B", i), ("F", i)]
    return order


@mistake("one_f_one_b", expect="never runs")
def drops_the_last_microbatch(stage, p, m):
    """``range(m - 1)`` somewhere: the last microbatch is never run."""
    return _order(stage, p, m - 1, min(p - stage - 1, m - 1))


# ---- pipeline_executor ---------------------------------------------------------------
@mistake("pipeline_executor", expect="Deadlock: stage")
def waits_every_send_at_once(actions, io):
    """Waits each send as soon as it is posted: stage s blocks in its send to s+1
    while s+1 blocks in its send to s, neither receiving."""
    received, outputs, input_grads = {}, {}, {}
    for a in actions:
        i = a.microbatch
        if a.op in ("recv_act", "recv_grad"):
            handle, received[a.op, i] = io.irecv(a.peer)
            handle.wait()
        elif a.op == "F":
            outputs[i] = io.forward(i, received.pop(("recv_act", i), None))
        elif a.op == "send_act":
            io.isend(outputs[i], a.peer).wait()
        elif a.op == "B":
            grad = received.pop(("recv_grad", i), None)
            input_grads[i] = io.backward(i, outputs.pop(i), grad)
        elif a.op == "send_grad":
            io.isend(input_grads.pop(i), a.peer).wait()


@mistake("pipeline_executor", expect="6 microbatches in flight")
def runs_every_forward_first(actions, io):
    """Runs all the forward-side actions, then all the backward-side ones: GPipe's
    order, valid, with every microbatch's activations held."""
    forward = [a for a in actions if a.op in ("recv_act", "F", "send_act")]
    run_stage(forward + [a for a in actions if a not in forward], io)


@mistake("pipeline_executor", expect="Deadlock: stage")
def never_waits_the_sends(actions, io):
    """Posts the sends and drops their handles: on gloo a dropped send is never
    delivered, and the stages downstream wait for it forever."""
    received, outputs, input_grads = {}, {}, {}
    for a in actions:
        i = a.microbatch
        if a.op in ("recv_act", "recv_grad"):
            handle, received[a.op, i] = io.irecv(a.peer)
            handle.wait()
        elif a.op == "F":
            outputs[i] = io.forward(i, received.pop(("recv_act", i), None))
        elif a.op == "send_act":
            io.isend(outputs[i], a.peer)
        elif a.op == "B":
            grad = received.pop(("recv_grad", i), None)
            input_grads[i] = io.backward(i, outputs.pop(i), grad)
        elif a.op == "send_grad":
            io.isend(input_grads.pop(i), a.peer)


@mistake("pipeline_executor", expect="differs from one process's")
def sends_the_activation_back(actions, io):
    """send_grad sends the stage's *input* (the received activation) instead of
    the gradient of it: the stages before learn from garbage."""
    received, outputs, inputs, sends = {}, {}, {}, []
    for a in actions:
        i = a.microbatch
        if a.op in ("recv_act", "recv_grad"):
            handle, received[a.op, i] = io.irecv(a.peer)
            handle.wait()
        elif a.op == "F":
            inputs[i] = received.pop(("recv_act", i), None)
            outputs[i] = io.forward(i, inputs[i])
        elif a.op == "send_act":
            sends.append(io.isend(outputs[i], a.peer))
        elif a.op == "B":
            io.backward(i, outputs.pop(i), received.pop(("recv_grad", i), None))
        elif a.op == "send_grad":
            sends.append(io.isend(inputs.pop(i), a.peer))
    for handle in sends:
        handle.wait()


def _keeping(actions, io, *, outputs=False, received=False, grads=False):
    """The schedule run in order, its sends waited at the end; what is named is
    read where it is used and never removed from its dict."""
    got, outs, input_grads, sends = {}, {}, {}, []

    def use(table, key, keep):
        return table.get(key) if keep else table.pop(key, None)

    for a in actions:
        i = a.microbatch
        if a.op in ("recv_act", "recv_grad"):
            handle, got[a.op, i] = io.irecv(a.peer)
            handle.wait()
        elif a.op == "F":
            outs[i] = io.forward(i, use(got, ("recv_act", i), received))
        elif a.op == "send_act":
            sends.append(io.isend(outs[i], a.peer))
        elif a.op == "B":
            grad = use(got, ("recv_grad", i), received)
            input_grads[i] = io.backward(i, use(outs, i, outputs), grad)
        elif a.op == "send_grad":
            sends.append(io.isend(use(input_grads, i, grads), a.peer))
    for handle in sends:
        handle.wait()


@mistake("pipeline_executor", expect="kept after their backward")
def keeps_every_microbatchs_tensors(actions, io):
    """Reads each dict entry where it is used and never removes it: the outputs,
    the buffers received and the input gradients of every microbatch stay
    allocated to the end of the step. The order is 1F1B's, so counting the
    forwards and backwards sees nothing; their storages show it."""
    _keeping(actions, io, outputs=True, received=True, grads=True)


@mistake("pipeline_executor", expect="outputs of")
def keeps_every_output(actions, io):
    """``outputs[i]`` instead of ``outputs.pop(i)`` at the backward: every
    microbatch's output (the activation sent on) stays allocated after its
    backward."""
    _keeping(actions, io, outputs=True)


@mistake("pipeline_executor", expect="received buffers of")
def keeps_every_received_buffer(actions, io):
    """The buffers received are read with ``get`` and never dropped: every
    activation and gradient received stays allocated to the end of the step."""
    _keeping(actions, io, received=True)


@mistake("pipeline_executor", expect="kept after their backward")
def keeps_a_view_of_every_output(actions, io):
    """Logs the first value of each output for later (``out.detach().view(-1)[:1]``):
    a view of one value, but it keeps the whole output's storage allocated."""
    rows = []

    class Logging:
        def __getattr__(self, name):
            return getattr(io, name)

        def forward(self, i, x):
            out = io.forward(i, x)
            rows.append(out.detach().view(-1)[:1])
            return out

    run_stage(actions, Logging())

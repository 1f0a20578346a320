"""Memory is judged by the storages that really stay allocated, not by tensor
objects, ``.grad`` fields or schedule counts (issue 25): a slice or view of a
larger buffer keeps the whole buffer, a dict never cleared keeps every
microbatch's tensors, and a checker sees both.

The pure part (no engines): :class:`dtlab.exercises.storages.Storages` follows
storages through views, detached copies and autograd; ZeRO-1's state is counted by
storage; chapter 05's budget is 1F1B's arithmetic. The live part, on the
notebooks' 4 CPU ranks: right answers written differently from the references
(freeing eagerly or keeping one slot, cloning a slice or chunking, in place or
not, one buffer reused) stay ACCEPTED; the wrong ones are in the catalogues
(``tests/mistakes/ch03.py``, ``ch05.py``), proven rejected by
``tests/test_exercises.py``.
"""

import pytest
import torch
from torch import nn

from dtlab.exercises import (
    check_fsdp_unit,
    check_pipeline_executor,
    check_zero1_step,
    check_zero2_hooks,
)
from dtlab.exercises.ch03_memory import state_storages
from dtlab.exercises.ch05_pipeline import RECEIVED, StageIO, stage_budget
from dtlab.exercises.storages import Storages, storage_elements
from dtlab.lab.kernel.shipping import ship_by_value


# ---- the measure -----------------------------------------------------------------
def test_a_view_keeps_its_whole_buffer_and_is_counted_once():
    held = Storages()
    full = torch.zeros(100)
    held.track(full, "gradient", 0)
    piece = full.detach()[10:12]  # a detached view: the tensor object may die
    held.track(piece, "slice", 0)  # the same storage: counted once
    del full
    assert held.bytes() == 400 and held.alive()[0].kinds == ["gradient", "slice"]
    del piece
    assert held.bytes() == 0


def test_excluded_storages_and_empty_ones_are_not_followed():
    weight = nn.Parameter(torch.ones(8))
    held = Storages(exclude=[weight])
    assert held.track(weight.t(), "saved") is None  # a view of the weight
    assert held.track(torch.empty(0), "empty") is None
    assert held.track(None, "nothing") is None and held.bytes() == 0


def test_autograd_keeps_what_it_saved_until_backward():
    held = Storages()
    lin = nn.Linear(6, 6)
    x = torch.randn(2, 6, requires_grad=True)

    def pack(t):
        held.track(t, "saved")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = torch.tanh(lin(x))
    assert held.bytes() == 2 * 2 * 6 * 4 + 6 * 6 * 4  # x, tanh's output, the weight
    out.sum().backward()
    del out
    assert held.bytes() == 2 * 6 * 4 + 6 * 6 * 4  # x (alive here) and the weight


def test_zero1_state_is_counted_by_storage():
    s = 250
    views = {
        "exp_avg": torch.zeros(4 * s)[:s],
        "exp_avg_sq": torch.zeros(4 * s)[s : 2 * s],
    }
    assert state_storages(views) == {"values": 8 * s, "shown": 2 * s}
    one = torch.zeros(2 * s)  # both moments in one buffer of 2S: counted once
    assert state_storages({"m": one[:s], "v": one[s:], "step": 3})["values"] == 2 * s
    flat = torch.zeros(4 * s)
    step = torch.tensor(3.0)  # torch AdamW's step counter: no per-element state
    kept = {"param": flat[:s], "step": step, "w": nn.Parameter(torch.zeros(s))}
    assert state_storages(kept, weights=(flat,))["values"] == 0
    assert storage_elements(flat[5:7]) == 4 * s


def test_the_pipeline_budget_is_1f1b_arithmetic():
    # a middle stage of Linear(6,6)+tanh on microbatches of 2: the input received
    # (48 B, saved by the Linear) and tanh's output (48 B, saved and sent) live
    # from forward to backward; the gradient received and the input's gradient
    # (48 B each) are the messages
    b = stage_budget(1, 4)
    assert (b["flight"], b["all"], b["k"]) == (96, 192, 3)
    assert b["bytes"] == 3 * 96 + 192
    first, last = stage_budget(0, 4), stage_budget(3, 4)
    assert (first["flight"], first["all"], first["k"]) == (96, 144, 4)  # no grad out
    # the last: input, the Linear's output and the target (saved by the loss), the
    # loss (4 B); its input's gradient sent back
    assert (last["flight"], last["all"], last["k"]) == (148, 196, 1)


def test_a_stage_names_what_it_keeps_after_backward():
    io = StageIO(1, 4, wait_s=0.0)  # compute only: no message is sent here
    kept = []
    for i in range(3):
        x = torch.randn(2, 6)
        io.held.track(x, RECEIVED)  # as io.irecv does
        out = io.forward(i, x)
        g = torch.ones(2, 6)
        io.held.track(g, RECEIVED)
        kept.append((x, out, g, io.backward(i, out, g)))  # nothing let go
    io.sample("the end")
    assert io.peak["at"] == "the end" and io.peak["in_flight"] == 0
    assert io.peak["kinds"] == {
        "kept: received buffers": (3 * 2 * 48, [0, 1, 2]),  # inputs and gradients
        "kept: outputs": (3 * 48, [0, 1, 2]),
        "kept: input gradients": (3 * 48, [0, 1, 2]),
    }


def test_a_backward_through_another_microbatchs_output_is_named():
    io = StageIO(0, 2, wait_s=0.0)
    first, second = io.forward(0, None), io.forward(1, None)
    with pytest.raises(ValueError, match="is the output of microbatch 1, not the"):
        io.backward(0, second, torch.ones(2, 6))
    assert io.backward(0, first, torch.ones(2, 6)) is None  # the first stage's


# ---- chapter 05: executors that keep different things, within 1F1B's budget --------
def frees_as_soon_as_used(actions, io):
    """Every tensor dropped the moment its last use is done (``del``, ``pop``); the
    input gradients in the same table as what was received."""
    table, outputs, sends = {}, {}, []
    for a in actions:
        i = a.microbatch
        if a.op.startswith("recv"):
            handle, buf = io.irecv(a.peer)
            handle.wait()
            table[a.op, i] = buf
            del handle, buf
        elif a.op == "F":
            outputs[i] = io.forward(i, table.pop(("recv_act", i), None))
        elif a.op == "send_act":
            sends.append(io.isend(outputs[i], a.peer))
        elif a.op == "B":
            g = io.backward(i, outputs.pop(i), table.pop(("recv_grad", i), None))
            table["input_grad", i] = g
            del g
        elif a.op == "send_grad":
            sends.append(io.isend(table.pop(("input_grad", i)), a.peer))
    while sends:
        sends.pop(0).wait()


def one_slot_per_kind(actions, io):
    """What 1F1B's actions receive is used by the very next compute: one slot for
    the input received, one for the gradient, one for the input gradient; only
    the outputs in flight queue up (first in, first out)."""
    from collections import deque

    x = grad = input_grad = None
    flight, sends = deque(), []
    for a in actions:
        if a.op == "recv_act":
            handle, x = io.irecv(a.peer)
            handle.wait()
        elif a.op == "recv_grad":
            handle, grad = io.irecv(a.peer)
            handle.wait()
        elif a.op == "F":
            flight.append(io.forward(a.microbatch, x))
            x = None
        elif a.op == "send_act":
            sends.append(io.isend(flight[-1], a.peer))
        elif a.op == "B":
            input_grad = io.backward(a.microbatch, flight.popleft(), grad)
            grad = None
        elif a.op == "send_grad":
            sends.append(io.isend(input_grad, a.peer))
            input_grad = None
    for handle in sends:
        handle.wait()


# ---- chapter 03: ZeRO-2 hooks that keep a slice (cloned), chunk, reuse a buffer -----
def clones_the_slice_it_keeps(model, grad_shards):
    """Out of place: the padded gradient built with torch.cat, reduce-scattered
    into a fresh tensor, the average copied in; this rank's slice of its local
    gradient kept for a norm later, as a clone (its own small storage)."""
    import torch

    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    local = {}
    for i, (p, shard) in enumerate(zip(model.parameters(), grad_shards)):

        def hook(param, i=i, shard=shard):
            g = param.grad.reshape(-1)
            flat = torch.cat([g, g.new_zeros(shard.numel() * n - g.numel())])
            out = torch.empty_like(shard)
            comm.reduce_scatter(out, flat)
            shard.copy_(out / n)
            local[i] = flat[r * shard.numel() : (r + 1) * shard.numel()].clone()
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


def chunks_and_clones(model, grad_shards):
    """torch.chunk of the padded gradient: its own chunk kept as a clone; the
    reduce-scatter lands in the slice itself, divided in place."""
    import torch

    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    kept = []
    for p, shard in zip(model.parameters(), grad_shards):

        def hook(param, shard=shard):
            flat = param.grad.new_zeros(shard.numel() * n)
            flat[: param.numel()].copy_(param.grad.view(-1))
            kept.append(torch.chunk(flat, n)[r].clone())
            comm.reduce_scatter(shard, flat)
            shard.div_(n)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


def reuses_one_padded_buffer(model, grad_shards):
    """One buffer, the largest padded gradient, allocated once and reused by every
    hook through a view: one gradient's memory, for the whole backward."""
    import torch

    from dtlab import comm

    n = comm.group_size()
    buf = torch.zeros(max(s.numel() for s in grad_shards) * n)
    for p, shard in zip(model.parameters(), grad_shards):

        def hook(param, shard=shard):
            flat = buf[: shard.numel() * n]
            flat.zero_()
            flat[: param.numel()] = param.grad.reshape(-1)
            comm.reduce_scatter(shard, flat)
            shard.mul_(1.0 / n)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


# ---- chapter 03: ZeRO-1's state in one buffer, or torch's own AdamW ---------------
def moments_in_one_buffer(flat_param, flat_grad, state, lr, betas, eps, weight_decay):
    """Both moments as two views of one buffer of 2·S: counted once, 2·S values."""
    import torch

    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    g = torch.empty(S)
    comm.reduce_scatter(g, flat_grad.clone())
    g = g / n
    if not state:
        both = torch.zeros(2 * S)
        state.update(t=0, m=both[:S], v=both[S:])
    state["t"] += 1
    b1, b2 = betas
    p = flat_param[r * S : (r + 1) * S].clone() * (1 - lr * weight_decay)
    state["m"].lerp_(g, 1 - b1)
    state["v"].mul_(b2).add_((1 - b2) * g * g)
    m_hat = state["m"] / (1 - b1 ** state["t"])
    v_hat = state["v"] / (1 - b2 ** state["t"])
    comm.all_gather(flat_param, p - lr * m_hat / (v_hat.sqrt() + eps))


def torch_adamw_on_the_slice(
    flat_param, flat_grad, state, lr, betas, eps, weight_decay
):
    """torch.optim.AdamW over the slice as an nn.Parameter (its step counter a 0-dim
    tensor), kept in ``state`` between steps."""
    import torch

    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    if not state:
        mine = torch.nn.Parameter(flat_param[r * S : (r + 1) * S].clone())
        state["param"] = mine
        state["opt"] = torch.optim.AdamW(
            [mine], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
    mine = state["param"]
    g = torch.empty(S)
    comm.reduce_scatter(g, flat_grad.clone())
    mine.grad = g.div_(n)
    state["opt"].step()
    comm.all_gather(flat_param, mine.detach())


# ---- chapter 03: an FSDP unit through torch.func, or with explicit frees ---------
def unit_through_vjp(x, shard, compute):
    """Backward by torch.func.vjp over the re-gathered parameters; nothing but the
    input saved."""
    import torch

    from dtlab import comm

    n = comm.group_size()

    def gather():
        full = shard.new_empty(shard.numel() * n)
        comm.all_gather(full, shard.detach())
        return full

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            ctx.save_for_backward(x)
            return compute(gather(), x)

        @staticmethod
        def backward(ctx, grad_y):
            (x,) = ctx.saved_tensors
            _, pull = torch.func.vjp(compute, gather(), x)
            grad_full, grad_x = pull(grad_y)
            out = torch.empty_like(shard)
            comm.reduce_scatter(out, grad_full.contiguous())
            return grad_x, out / n

    return Unit.apply(x, shard)


def unit_that_deletes_what_it_gathered(x, shard, compute):
    """The gathered parameters deleted by name after each use, the input saved as
    a clone, the gradients read from ``.grad`` after a backward of its own."""
    import torch

    from dtlab import comm

    n = comm.group_size()

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            full = torch.empty(shard.numel() * n)
            comm.all_gather(full, shard.detach())
            y = compute(full, x)
            del full
            ctx.save_for_backward(x.detach().clone())
            return y

        @staticmethod
        def backward(ctx, grad_y):
            x = ctx.saved_tensors[0].requires_grad_()
            full = torch.empty(shard.numel() * n)
            comm.all_gather(full, shard.detach())
            full.requires_grad_()
            with torch.enable_grad():
                compute(full, x).backward(grad_y)
            grad_shard = torch.empty_like(shard)
            comm.reduce_scatter(grad_shard, full.grad)
            del full
            return x.grad, grad_shard.div_(n)

    return Unit.apply(x, shard)


RIGHT = {
    check_pipeline_executor: [frees_as_soon_as_used, one_slot_per_kind],
    check_zero2_hooks: [
        clones_the_slice_it_keeps,
        chunks_and_clones,
        reuses_one_padded_buffer,
    ],
    check_zero1_step: [moments_in_one_buffer, torch_adamw_on_the_slice],
    check_fsdp_unit: [unit_through_vjp, unit_that_deletes_what_it_gathered],
}
for _answers in RIGHT.values():
    for _answer in _answers:
        ship_by_value(_answer)  # the engines cannot import this test file


@pytest.mark.cluster
@pytest.mark.parametrize(
    "checker,answer",
    [
        pytest.param(c, a, id=f"{c.__name__.removeprefix('check_')}-{a.__name__}")
        for c, answers in RIGHT.items()
        for a in answers
    ],
)
def test_right_answers_written_differently_are_accepted(checker, answer, lab_cluster):
    report = checker(answer, lab_cluster(4))
    assert report.passed, report

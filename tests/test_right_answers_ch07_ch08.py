"""Right answers written differently from the reference are accepted, chapters 07
and 08: the layout defended in numbers, Megatron's rank order, and gradient
accumulation over unequal microbatches. Each answer was written from what the
learner sees (the stub cell, the exercise's markdown, the checker's
``measures=``) before the reference or the checker's body was read; the wrong
answers are slips a learner makes that the catalogues did not hold, each proven
rejected with a message that names its cause. Answers that run on the engines
travel by value and import what they use."""

import pytest
import torch

from dtlab.exercises import (
    ExerciseFailed,
    check_accumulation,
    check_layout_defence,
    check_rank_order,
)
from dtlab.lab.kernel.shipping import ship_by_value


# ---- ch07 layout_defence: a plan and its numbers ------------------------------------
def the_planners_best_priced_by_the_library():
    """The planner's fastest layout, each number read from dtlab.estimate."""
    from dtlab import estimate as est

    model = est.MODELS["70B"]
    row = est.plan(model, gpu="H100-80GB", n_gpus=64, global_batch=256, max_tp=8).best
    knobs = dict(
        zero_stage=row.zero_stage,
        precision="bf16",
        micro_batch_size=row.micro_batch_size,
        microbatches=row.microbatches,
        sequence_parallel=row.sequence_parallel,
    )
    memory = est.layout_memory(
        model, row.layout, checkpointing=row.checkpointing, states="paper", **knobs
    )
    wire = est.layout_traffic(model, row.layout, **knobs)
    return {
        "layout": row.layout,
        "zero_stage": row.zero_stage,
        "checkpointing": row.checkpointing,
        "sequence_parallel": row.sequence_parallel,
        "micro_batch_size": row.micro_batch_size,
        "memory_GB": {k: memory[k] / 1e9 for k in ("params", "grads", "optimizer")}
        | {"activations": memory["activations"] / 1e9},
        "wire_GB": {axis: wire[axis] / 1e9 for axis in ("dp", "tp", "pp")},
        "bubble": est.pipeline_bubble_fraction(row.layout.pp, row.microbatches),
        "dominant": max(("dp", "tp", "pp"), key=wire.get),
    }


def by_hand_on_eight_way_tp():
    """dp2·tp8·pp4, ZeRO-1, selective recomputation: the numbers from the
    chapters' formulas (ψ the stage's slice, 2 + 2 + 12/d bytes a parameter,
    sbh·34/tp bytes a layer kept without the attention scores, p microbatches in
    flight on stage 0, ring traffic)."""
    h, kv, ff, s, vocab = 8192, 1024, 28672, 4096, 32000
    dp, tp, pp, b = 2, 8, 4, 1
    m = 256 // (dp * b)  # microbatches per replica
    layers = 80 // pp
    layer = 2 * h * h + 2 * h * kv + 3 * h * ff  # attention (GQA) and gated MLP
    psi = (layers * layer + vocab * h) / tp  # stage 0: its blocks and 1/tp of embed
    sbh = s * b * h
    ring = (tp - 1) / tp
    wire = {
        "dp": 2 * psi * 2 * (dp - 1) / dp,  # 2ψ bf16 values, ring over d
        "tp": 4 * 2 * ring * 2 * sbh * layers * m,  # 4 all-reduces a layer
        "pp": 2 * 2 * sbh / tp * m,  # act + grad, each rank its 1/tp (SP)
    }
    return {
        "layout": {"dp": dp, "tp": tp, "pp": pp},
        "zero_stage": 1,
        "checkpointing": "selective",
        "sequence_parallel": True,
        "micro_batch_size": b,
        "memory_GB": {
            "params": 2 * psi / 1e9,
            "grads": 2 * psi / 1e9,
            "optimizer": 12 * psi / dp / 1e9,
            "activations": 34 * sbh / tp * layers * pp / 1e9,
        },
        "wire_GB": {k: v / 1e9 for k, v in wire.items()},
        "bubble": (pp - 1) / (m + pp - 1),
        "dominant": "tp",
    }


def _by_hand_but(**changes):
    def answer():
        return by_hand_on_eight_way_tp() | changes

    return answer


@pytest.mark.parametrize(
    "answer",
    [
        the_planners_best_priced_by_the_library,
        by_hand_on_eight_way_tp,
        # the layout and the axis as a learner may write them
        _by_hand_but(layout="dp2·tp8·pp4", dominant="TP"),
        _by_hand_but(layout=(2, 8, 4)),
    ],
)
def test_layout_defence_accepts_other_right_answers(answer):
    assert check_layout_defence(answer).passed


def _pp_sends_the_whole_activation():
    """Wrong: every tp rank sends the full b·s·h activation across the stage
    boundary, though under sequence parallelism each holds 1/tp of it."""
    plan = by_hand_on_eight_way_tp()
    plan["wire_GB"]["pp"] *= 8
    return plan


def _m_without_dp():
    """Wrong: m = 256 microbatches (the global batch), not 256 / dp per replica."""
    return by_hand_on_eight_way_tp() | {"bubble": 3 / (256 + 3)}


@pytest.mark.parametrize(
    "answer, cause",
    [
        (_pp_sends_the_whole_activation, "on pp: .*÷ tp under SP"),
        (_m_without_dp, "m = 128 microbatches"),
        (_by_hand_but(layout="two by eight by four"), "not one I can read"),
    ],
)
def test_layout_defence_names_the_cause(answer, cause):
    with pytest.raises(ExerciseFailed, match=cause):
        check_layout_defence(answer)


# ---- ch07 rank_order: Megatron's numbering ------------------------------------------
def coords_from_a_grid(rank, dp, tp, pp):
    """The ranks laid out as a (pp, dp, tp) grid; the rank's position in it."""
    import torch

    grid = torch.arange(pp * dp * tp).reshape(pp, dp, tp)
    p, d, t = (int(i) for i in (grid == rank).nonzero()[0])
    return {"pp": p, "dp": d, "tp": t}


def coords_by_enumeration(rank, dp, tp, pp):
    """Every coordinate in Megatron's order (itertools.product: the last varies
    fastest), indexed by the rank."""
    import itertools

    order = itertools.product(range(pp), range(dp), range(tp))
    p, d, t = list(order)[rank]
    return dict(tp=t, dp=d, pp=p)


def coords_by_numpy(rank, dp, tp, pp):
    """numpy.unravel_index over the (pp, dp, tp) shape: numpy integers."""
    import numpy as np

    p, d, t = np.unravel_index(rank, (pp, dp, tp))
    return {"tp": t, "dp": d, "pp": p}


def coords_without_the_modulo(rank, dp, tp, pp):
    """Wrong: dp = rank // tp, right only while pp is 1."""
    return {"tp": rank % tp, "dp": rank // tp, "pp": rank // (tp * dp)}


_RIGHT_ORDERS = [
    coords_from_a_grid,
    coords_by_enumeration,
    coords_by_numpy,
]
for _answer in _RIGHT_ORDERS + [coords_without_the_modulo]:
    ship_by_value(_answer)


@pytest.mark.cluster
@pytest.mark.parametrize("answer", _RIGHT_ORDERS)
def test_rank_order_accepts_other_right_answers(answer, lab_cluster):
    assert check_rank_order(answer, lab_cluster(4)).passed


@pytest.mark.cluster
def test_rank_order_names_the_rank_and_the_order(lab_cluster):
    with pytest.raises(ExerciseFailed, match="rank 16: you say .*'dp': 2"):
        check_rank_order(coords_without_the_modulo, lab_cluster(4))


# ---- ch08 accumulation: the mean over every sample -----------------------------------
def autograd_grad_added_by_hand(model, micro_batches, loss_fn):
    """torch.autograd.grad per microbatch, summed into .grad by hand (set first)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    total = sum(x.shape[0] for x, _ in micro_batches)
    for x, y in micro_batches:
        loss = loss_fn(model(x), y)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                p.grad.add_(g, alpha=x.shape[0] / total)


def summed_losses_divided_at_the_end(model, micro_batches, loss_fn):
    """Each microbatch's summed loss (mean × its size) back-propagated, the
    accumulated .grad divided by the sample count once at the end."""
    model.zero_grad(set_to_none=True)
    total = 0
    for x, y in micro_batches:
        loss_fn(model(x), y).backward(torch.tensor(float(len(x))))
        total += len(x)
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= total


@pytest.mark.parametrize(
    "answer",
    [
        autograd_grad_added_by_hand,
        summed_losses_divided_at_the_end,
    ],
)
def test_accumulation_accepts_other_right_answers(answer):
    assert check_accumulation(answer).passed


def sums_over_the_samples(model, micro_batches, loss_fn):
    """Wrong: each mean × its size (the sum over the samples), never divided by
    the total."""
    for x, y in micro_batches:
        (loss_fn(model(x), y) * len(x)).backward()


def test_accumulation_names_a_sum_never_divided():
    with pytest.raises(ExerciseFailed, match="12× too large"):
        check_accumulation(sums_over_the_samples)

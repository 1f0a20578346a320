"""Chapter 04's exercises: the column-parallel linear with f, the row-parallel
linear with g, and the sequence-parallel conversion of an MLP.

Each runs on every rank at every tensor-parallel degree the world allows (tp = 2
and tp = 4 on four ranks; a tp=2 layout runs two tp groups side by side), against a
plain ``nn.Linear`` (or a plain MLP) in one process: the output and every gradient,
shard by shard. The forward and the backward are watched apart, so the checkers
know which collectives ran where: the column-parallel layer never communicates
forward and all-reduces dL/dX once backward; the row-parallel layer all-reduces
once forward and never backward; the sequence-parallel MLP all-gathers and
reduce-scatters the sequence once each way, the bytes of the two all-reduces it
replaces, and never gathers a weight.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import estimate, tensor_parallel
from dtlab.exercises.ch04_solutions import (
    column_parallel_linear,
    row_parallel_linear,
    sequence_parallel_mlp,
)
from dtlab.exercises.grading import ExerciseFailed, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, topology, world_size_of
from dtlab.exercises.watch import Watch
from dtlab.model import param_generator
from dtlab.topology import Layout

__all__ = ["check_column_parallel", "check_row_parallel", "check_sequence_parallel"]

# sizes chosen so that no activation has a weight's size: a gathered weight shows
ROW = dict(batch=(2, 3), d_in=12, d_out=10)
COLUMN = dict(batch=(2, 3), d_in=12, d_out=8)  # d_out, split by tp, divides by 4
MLP = dict(batch=4, seq=8, d_model=12, d_hidden=24)

LIBRARY = {
    fn: f"dtlab.tensor_parallel.{fn.__name__}"
    for fn in (
        tensor_parallel.ReduceFromTP,
        tensor_parallel.CopyToTP,
        tensor_parallel.GatherFromSP,
        tensor_parallel.ReduceScatterToSP,
        tensor_parallel.reduce_from_tp,
        tensor_parallel.copy_to_tp,
        tensor_parallel.gather_from_sp,
        tensor_parallel.reduce_scatter_to_sp,
        tensor_parallel.all_gather_along,
        tensor_parallel.reduce_scatter_along,
        tensor_parallel.RowParallelLinear,
        tensor_parallel.ParallelMLP,
    )
}


def _degrees(n: int) -> list[int]:
    """The tp degrees to try on n ranks: 2 and n (just n below 4)."""
    return sorted({d for d in (2, n) if d > 1 and n % d == 0})


def _randn(*shape, seed: str) -> torch.Tensor:
    return torch.randn(*shape, generator=param_generator(0, seed))


def _linear(d_in: int, d_out: int, name: str) -> nn.Linear:
    lin = nn.Linear(d_in, d_out)
    with torch.no_grad():
        lin.weight.copy_(_randn(d_out, d_in, seed=f"{name}/w") / d_in**0.5)
        lin.bias.copy_(_randn(d_out, seed=f"{name}/b"))
    return lin


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _ops(seen) -> list[tuple[str, int]]:
    return [(e["op"], e["bytes"]) for e in seen.launches]


def _bias_excess(y, want, bias) -> float:
    """How many biases too many ``y`` carries (t − 1 when each rank added one)."""
    if y.shape != want.shape:
        return float("nan")
    return ((y - want).detach() / bias.detach()).mean().item()


def _rows_elsewhere(got, mine, full) -> bool:
    """Whether ``got`` is not this rank's tokens ``mine`` but every one of its rows
    (a token's C values) is a row of the ``full`` output: the right values put in
    the wrong place (the MLP works token by token, so a gather or a scatter along
    the wrong dimension moves tokens without changing them)."""
    if got.shape != mine.shape or _diff(got, mine) <= 1e-5:
        return False
    rows, every = (a.detach().flatten(0, -2) for a in (got, full))
    near = torch.cdist(rows, every, compute_mode="donot_use_mm_for_euclid_dist")
    return bool((near.min(1).values <= 1e-4).all())


def _factor(a, b) -> float:
    """c where ``a`` is c times ``b`` throughout (a gradient t times too large or
    too small, or zero), else nan."""
    if a is None or a.shape != b.shape:
        return float("nan")
    a, b = a.detach(), b.detach()
    c = ((a * b).sum() / (b * b).sum().clamp_min(1e-30)).item()
    close = (a - c * b).abs().max().item() <= 1e-4 * b.abs().max().item() + 1e-6
    return c if close else float("nan")


def _factor_said(c: float, t: int) -> str:
    """What a gradient ``c`` times the right one means, in words."""
    if c != c or abs(c - 1) < 1e-3:
        return ""
    if abs(c) < 1e-3:
        return " It is zero: no gradient reached it on this rank."
    if abs(c * t - 1) < 1e-3:
        return (
            f" It is 1/{t} of the right one: a tensor-parallel all-reduce sums "
            "each rank's partial term, and nothing is divided by t (unlike data "
            "parallelism's average); a bias split t ways gets 1/t of its gradient."
        )
    why = ": the same term was counted t times" if abs(c - t) < 1e-3 else ""
    return f" It is {c:.3g} times the right one{why}."


def _vs(name: str, got, want) -> dict:
    """``got`` against ``want``: how far off, and by what factor if it is one."""
    return {name: _diff(got, want), f"{name} factor": _factor(got, want)}


def _diff(a, b) -> float:
    if a is None:
        return float("inf")
    if a.shape != b.shape:
        return float("nan")
    return (a - b).abs().max().item()


# ---- 0. the column-parallel linear ---------------------------------------------------
def probe_column(solution, degrees) -> list[dict]:
    r, n = rank_and_size()
    found = []
    for t in degrees:
        axis = topology(Layout(dp=n // t, tp=t)).axis("tp")
        i = axis.index
        lin = _linear(COLUMN["d_in"], COLUMN["d_out"], "column")
        x = _randn(
            *COLUMN["batch"], COLUMN["d_in"], seed=f"col/x/{r // t}"
        ).requires_grad_()
        gy = _randn(*COLUMN["batch"], COLUMN["d_out"], seed=f"col/gy/{r // t}")
        lin(x).backward(gy)  # the reference: the whole layer, in this process
        x_mine = _leaf(x)
        w_i = _leaf(lin.weight.chunk(t, 0)[i])
        b_i = _leaf(lin.bias.chunk(t, 0)[i])
        with Watch(LIBRARY) as fwd:
            y = solution(x_mine, w_i, b_i, axis)
        with Watch(LIBRARY) as bwd:
            if y.shape == gy.chunk(t, -1)[i].shape:
                y.backward(gy.chunk(t, -1)[i])
        found.append(
            {
                "t": t,
                "forward": _ops(fwd),
                "backward": _ops(bwd),
                "forbidden": fwd.forbidden + bwd.forbidden,
                "output Y_i": _diff(y, lin(x).detach().chunk(t, -1)[i]),
                **_vs("dL/dX", x_mine.grad, x.grad),
                **_vs("dL/dweight shard", w_i.grad, lin.weight.grad.chunk(t, 0)[i]),
                **_vs("dL/dbias shard", b_i.grad, lin.bias.grad.chunk(t, 0)[i]),
            }
        )
    return found


@exercise(
    "column_parallel",
    chapter=4,
    reference=column_parallel_linear,
    measures=(
        "output Y_i and the gradients of X, the weight shard and the bias shard == "
        "nn.Linear at tp=2 and tp=4; forward no communication, backward exactly "
        "one all_reduce of dL/dX, no weight gathered"
    ),
)
def check_column_parallel(solution, cluster=None):
    n = world_size_of(cluster)
    degrees = _degrees(n)
    reports = on_every_rank(cluster, probe_column, solution, degrees)
    b, s = COLUMN["batch"]
    x_bytes = b * s * COLUMN["d_in"] * 4
    for r, cases in enumerate(reports):
        for case in cases:
            _refuse_library(r, case)
            where = f"tp={case['t']}, rank {r}"
            ops = case["forward"] + case["backward"]
            gathered = [x for op, x in ops if op == "all_gather"]
            if gathered:
                raise ExerciseFailed(
                    f"{where}: you all-gathered {gathered} bytes. A column-parallel "
                    "layer never gathers its weight: each rank multiplies the whole "
                    "input by its own rows and keeps its slice of the output."
                )
            if case["forward"]:
                raise ExerciseFailed(
                    f"{where}: the forward communicated ({case['forward']}). f is "
                    "the identity forward: each rank's Y_i = X·A_iᵀ needs nothing "
                    "from the others (the all-reduce forward is g's, behind the "
                    "row-parallel layer)."
                )
            if case["backward"] != [("all_reduce", x_bytes)]:
                raise ExerciseFailed(
                    f"{where}: the backward ran {case['backward']}; f all-reduces "
                    f"dL/dX once ({x_bytes} bytes): each rank's dL/dY_i·A_i is only "
                    "its term of the sum over the column slices."
                )
            _judge_values(
                r,
                case,
                ("output Y_i", "dL/dX", "dL/dweight shard", "dL/dbias shard"),
                {"output Y_i": "Y_i = f(X)·A_iᵀ + b_i, A_i = the weight shard."},
            )
    return [
        f"output and every gradient equal nn.Linear's at tp={degrees} on all {n} ranks",
        f"forward: nothing; backward: one all-reduce of dL/dX ({x_bytes} B); no "
        "weight gathered",
    ]


# ---- 1. the row-parallel linear ------------------------------------------------------
def probe_row(solution, degrees) -> list[dict]:
    r, n = rank_and_size()
    found = []
    for t in degrees:
        axis = topology(Layout(dp=n // t, tp=t)).axis("tp")
        i = axis.index
        lin = _linear(ROW["d_in"], ROW["d_out"], "row")
        x = _randn(*ROW["batch"], ROW["d_in"], seed=f"row/x/{r // t}")  # per tp group
        gy = _randn(*ROW["batch"], ROW["d_out"], seed=f"row/gy/{r // t}")
        x = x.requires_grad_()
        lin(x).backward(gy)  # the reference: the whole layer, in this process
        x_i = _leaf(x.chunk(t, -1)[i])
        w_i = _leaf(lin.weight.chunk(t, 1)[i])
        b = _leaf(lin.bias)
        with Watch(LIBRARY) as fwd:
            y = solution(x_i, w_i, b, axis)
        with Watch(LIBRARY) as bwd:
            y.backward(gy)
        found.append(
            {
                "t": t,
                "forward": _ops(fwd),
                "backward": _ops(bwd),
                "forbidden": fwd.forbidden + bwd.forbidden,
                "output Y": _diff(y, lin(x).detach()),
                "bias excess": _bias_excess(y, lin(x), lin.bias),
                **_vs("dL/dX_i", x_i.grad, x.grad.chunk(t, -1)[i]),
                **_vs("dL/dweight shard", w_i.grad, lin.weight.grad.chunk(t, 1)[i]),
                **_vs("dL/dbias", b.grad, lin.bias.grad),
            }
        )
    return found


def _refuse_library(r: int, case: dict) -> None:
    if case["forbidden"]:
        raise ExerciseFailed(
            f"tp={case['t']}, rank {r}: you called "
            f"{', '.join(sorted(set(case['forbidden'])))}. Write the autograd "
            "function yourself, with dtlab.comm's collectives."
        )


def _judge_values(r: int, case: dict, names, hints: dict) -> None:
    for what in names:
        d = case[what]
        if not d <= 1e-5:  # inf: no gradient; nan: the wrong shape
            problem = (
                "is missing (None)"
                if d == float("inf")
                else "has the wrong shape"
                if d != d
                else f"is off by {d:.3g}"
            )
            said = _factor_said(case.get(f"{what} factor", float("nan")), case["t"])
            raise ExerciseFailed(
                f"tp={case['t']}, rank {r}: {what} {problem}.{said} "
                f"{hints.get(what, '')}".rstrip()
            )


@exercise(
    "row_parallel",
    chapter=4,
    reference=row_parallel_linear,
    measures=(
        "output and the gradients of X_i, the weight shard and the bias == "
        "nn.Linear, at tp=2 and tp=4; forward exactly one all_reduce of Y on the tp "
        "axis, backward no communication, no weight gathered"
    ),
)
def check_row_parallel(solution, cluster=None):
    n = world_size_of(cluster)
    degrees = _degrees(n)
    reports = on_every_rank(cluster, probe_row, solution, degrees)
    b, s = ROW["batch"]
    y_bytes = b * s * ROW["d_out"] * 4
    for r, cases in enumerate(reports):
        for case in cases:
            _refuse_library(r, case)
            t, where = case["t"], f"tp={case['t']}, rank {r}"
            ops = case["forward"] + case["backward"]
            if any(op == "all_gather" for op, _ in ops):
                gathered = [x for op, x in ops if op == "all_gather"]
                raise ExerciseFailed(
                    f"{where}: you all-gathered {gathered} bytes. The row-parallel "
                    "layer never gathers a weight or the "
                    "input: each rank multiplies its own slices, and g sums the "
                    "partial outputs."
                )
            if case["forward"] != [("all_reduce", y_bytes)]:
                raise ExerciseFailed(
                    f"{where}: the forward ran {case['forward']}; g all-reduces the "
                    f"partial outputs once, {y_bytes} bytes of Y: each rank's "
                    "X_i·A_iᵀ is only its share of the sum."
                )
            if case["backward"]:
                raise ExerciseFailed(
                    f"{where}: the backward communicated ({case['backward']}). g's "
                    "backward is the identity: after the forward's all-reduce every "
                    "rank holds the whole dL/dY (the all-reduce of dL/dX is f's, in "
                    "front of the column-parallel layer)."
                )
            if abs(case["bias excess"] - (t - 1)) < 1e-3 and case["output Y"] > 1e-5:
                raise ExerciseFailed(
                    f"{where}: the output carries the bias {t} times: it was added to "
                    "every rank's partial output before the sum. Add it once, after g."
                )
            _judge_values(
                r,
                case,
                ("output Y", "dL/dX_i", "dL/dweight shard", "dL/dbias"),
                {
                    "output Y": "Y = g(X_i·A_iᵀ) + b, A_i = the weight shard.",
                    "dL/dbias": "b is whole on every rank: add it once, after g, on "
                    "every rank, so that each rank's dL/db is the sum of dL/dY.",
                },
            )
    return [
        f"output and every gradient equal nn.Linear's at tp={degrees} on all {n} ranks",
        f"forward: one all-reduce of Y ({y_bytes} B) on the tp axis; backward: "
        "nothing; no weight gathered",
    ]


# ---- 2. the sequence-parallel MLP ----------------------------------------------------
def probe_sequence_parallel(solution, degrees) -> list[dict]:
    r, n = rank_and_size()
    B, T, C, H = MLP["batch"], MLP["seq"], MLP["d_model"], MLP["d_hidden"]
    found = []
    for t in degrees:
        axis = topology(Layout(dp=n // t, tp=t)).axis("tp")
        i = axis.index
        fc, proj = _linear(C, H, "sp/fc"), _linear(H, C, "sp/proj")
        x = _randn(B, T, C, seed=f"sp/x/{r // t}").requires_grad_()
        gy = _randn(B, T, C, seed=f"sp/gy/{r // t}")
        y = proj(nn.functional.gelu(fc(x)))
        y.backward(gy)  # the reference: the whole MLP, in this process
        args = [
            _leaf(x.chunk(t, 1)[i]),
            _leaf(fc.weight.chunk(t, 0)[i]),
            _leaf(fc.bias.chunk(t, 0)[i]),
            _leaf(proj.weight.chunk(t, 1)[i]),
            _leaf(proj.bias),
        ]
        with Watch(LIBRARY) as fwd:
            y_i = solution(*args, axis)
        with Watch(LIBRARY) as bwd:
            if y_i.shape == (B, T // t, C):  # else the checker says so; no backward
                y_i.backward(gy.chunk(t, 1)[i])
        grads = [a.grad for a in args]
        found.append(
            {
                "t": t,
                "forward": _ops(fwd),
                "backward": _ops(bwd),
                "wire": [sum(e["wire_bytes"] for e in w.events) for w in (fwd, bwd)],
                "forbidden": fwd.forbidden + bwd.forbidden,
                "shape": tuple(y_i.shape),
                "output": _diff(y_i, y.detach().chunk(t, 1)[i]),
                "tokens elsewhere": _rows_elsewhere(y_i, y.chunk(t, 1)[i], y),
                "bias excess": _bias_excess(y_i, y.chunk(t, 1)[i], proj.bias),
                **_vs("dL/dx shard", grads[0], x.grad.chunk(t, 1)[i]),
                **_vs("dL/dw_fc", grads[1], fc.weight.grad.chunk(t, 0)[i]),
                **_vs("dL/db_fc", grads[2], fc.bias.grad.chunk(t, 0)[i]),
                **_vs("dL/dw_proj", grads[3], proj.weight.grad.chunk(t, 1)[i]),
                # under SP each rank's bias gradient sums its own tokens only
                "dL/db_proj (my tokens)": _diff(
                    grads[4], gy.chunk(t, 1)[i].sum((0, 1))
                ),
            }
        )
    return found


@exercise(
    "sequence_parallel",
    chapter=4,
    reference=sequence_parallel_mlp,
    measures=(
        "each rank's tokens of the output and every gradient shard == the plain "
        "MLP, at tp=2 and tp=4; forward one all_gather + one reduce_scatter of the "
        "(B, T, C) activation, backward the same, no all_reduce, the wire bytes of "
        "two all-reduces, no weight gathered"
    ),
)
def check_sequence_parallel(solution, cluster=None):
    n = world_size_of(cluster)
    degrees = _degrees(n)
    reports = on_every_rank(cluster, probe_sequence_parallel, solution, degrees)
    B, T, C = MLP["batch"], MLP["seq"], MLP["d_model"]
    act = B * T * C * 4  # the whole activation: what g gathers and ḡ scatters
    for r, cases in enumerate(reports):
        for case in cases:
            _refuse_library(r, case)
            t, where = case["t"], f"tp={case['t']}, rank {r}"
            ops = case["forward"] + case["backward"]
            moved = sorted({b for op, b in ops if op == "all_gather" and b != act})
            if moved:
                raise ExerciseFailed(
                    f"{where}: you all-gathered {moved} bytes, not the activation's "
                    f"{act}: a weight was gathered. Sequence parallelism moves only "
                    "activations; the weights stay sharded as in plain TP."
                )
            if any(op == "all_reduce" for op, _ in ops):
                raise ExerciseFailed(
                    f"{where}: an all-reduce ran ({ops}). Sequence parallelism "
                    "replaces each all-reduce by its halves: an all-gather of the "
                    "sequence in front of the column-parallel layer and a "
                    "reduce-scatter behind the row-parallel one."
                )
            if case["shape"] != (B, T // t, C):
                raise ExerciseFailed(
                    f"{where}: the output has shape {case['shape']}, expected "
                    f"{(B, T // t, C)}: this rank's tokens. Split and gather along "
                    "the sequence dimension (dim 1), never the batch."
                )
            want = sorted([("all_gather", act), ("reduce_scatter", act)])
            for phase, hint in (
                ("forward", "g all-gathers, ḡ reduce-scatters"),
                ("backward", "g's backward reduce-scatters, ḡ's all-gathers"),
            ):
                if sorted(case[phase]) != want:
                    raise ExerciseFailed(
                        f"{where}: the {phase} ran {case[phase]}; it must run one "
                        f"all-gather and one reduce-scatter of the (B, T, C) "
                        f"activation, {act} bytes each ({hint})."
                    )
            ring = estimate.wire_bytes("all_reduce", act, t)
            if any(abs(w - ring) > 1e-6 for w in case["wire"]):
                raise ExerciseFailed(
                    f"{where}: sent {case['wire']} bytes forward/backward, expected "
                    f"{ring:g} each way: the volume of the all-reduce it replaces."
                )
            if abs(case["bias excess"] - (t - 1)) < 1e-3 and case["output"] > 1e-5:
                raise ExerciseFailed(
                    f"{where}: the output carries proj's bias {t} times: add it after "
                    "the reduce-scatter, once."
                )
            if case["tokens elsewhere"]:
                raise ExerciseFailed(
                    f"{where}: every token of your output is a right output, but of "
                    f"other tokens than this rank's: rank i returns tokens "
                    f"i·T/t … (i+1)·T/t − 1 of every sequence (dim 1). dtlab's "
                    "collectives stack and split along dim 0, so move the sequence "
                    "dimension to the front before each one and back after."
                )
            _judge_values(
                r,
                case,
                (
                    "output",
                    "dL/dx shard",
                    "dL/dw_fc",
                    "dL/db_fc",
                    "dL/dw_proj",
                    "dL/db_proj (my tokens)",
                ),
                {
                    "dL/dx shard": "g's backward must reduce-scatter the input's "
                    "gradient: each rank's is a partial sum over its H/t columns."
                },
            )
    return [
        f"outputs and every gradient shard equal the plain MLP at tp={degrees}",
        f"each way one all-gather and one reduce-scatter of {act} B: the wire bytes "
        "of one all-reduce, no all-reduce, no weight moved",
    ]

"""Chapter 02's framework exercise, ``torch_ddp``: the training loop of
:mod:`.ch02_data_parallel`'s exercises on PyTorch's own
``torch.nn.parallel.DistributedDataParallel``, each rank on its slice of the batch.

The checker runs the learner's loop on every rank with a model it hands over and
judges what happened there, not only the numbers that came out:

- the model handed over was wrapped by torch's DDP (its ``__init__`` seen by
  :class:`~dtlab.exercises.watch.Watch`; dtlab's own DDP refused);
- the model was fed this rank's contiguous slice of each global batch, never the
  whole batch (a forward pre-hook keeps the rows);
- torch's reducer all-reduced the gradients' bytes in every step (its collectives,
  counted by :class:`dtlab.frameworks.traffic.CollectiveCounter`);
- the weights are identical on every rank and, with the losses, equal dtlab's DDP
  trained on the same slices: bit for bit on 2 ranks, within the float32 bound of
  :func:`rounding_bounds` on more (measured on 4 ranks: 3e-8 apart, 1 ulp of a
  gradient per step, the bound 6.6e-7).
"""

from __future__ import annotations

import copy
import numbers

import torch
from torch import nn

from dtlab.ddp import DistributedDataParallel
from dtlab.exercises.ch02_data_parallel import (
    GLOBAL_BATCH,
    LR,
    STEPS,
    WIDTHS,
    exercise_model,
)
from dtlab.exercises.ch02_solutions import train_with_torch_ddp
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.watch import Watch
from dtlab.model import regression_batch

__all__ = ["check_torch_ddp", "rounding_bounds", "UNIT_ROUNDOFF"]

TORCH_DDP = torch.nn.parallel.DistributedDataParallel


def _batch(step: int, rank: int, n: int):
    """Rank ``rank``'s contiguous slice of step ``step``'s global batch."""
    x, y = regression_batch(step, GLOBAL_BATCH, WIDTHS[0], WIDTHS[-1])
    per = GLOBAL_BATCH // n
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _never_zeroed() -> dict:
    """One process on the whole batch whose gradients are never zeroed: what a
    loop that forgets ``zero_grad`` trains to (every rank agrees, all wrong)."""
    model = exercise_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step, 0, 1)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _train_with_dtlab_ddp(r: int, n: int) -> dict:
    """What the learner's loop must reproduce: dtlab's DDP, the same model, slices
    and SGD; this rank's losses, the weights, and per step the sizes the rounding
    bound needs: the loss, this rank's own gradient (max and sum of its magnitudes,
    from a copy of the model) and the largest weight after the step."""
    model = DistributedDataParallel(exercise_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, sizes = [], []
    for step in range(STEPS):
        x, y = _batch(step, r, n)
        alone = copy.deepcopy(model.module)  # this rank's gradient, not averaged
        nn.functional.mse_loss(alone(x), y).backward()
        grads = [p.grad.abs() for p in alone.parameters()]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        sizes.append(
            {
                "loss": losses[-1],
                "grad_max": max(g.max().item() for g in grads),
                "grad_l1": sum(g.sum().item() for g in grads),
                "weight_max": max(p.abs().max().item() for p in model.parameters()),
            }
        )
    weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {"losses": losses, "weights": weights, "sizes": sizes}


UNIT_ROUNDOFF = 2.0**-24  # float32


def rounding_bounds(n: int, sizes: list[list[dict]]) -> tuple[float, list[float]]:
    """How far torch's DDP and dtlab's may drift apart on ``n`` ranks, weights and
    each step's loss, from the ``sizes`` every rank recorded.

    Both divide each rank's gradient by N and sum the N shares with one gloo
    all-reduce of a flat bucket; the ring adds an element's shares in an order set
    by where the element lies in the bucket, and the two libraries lay the
    parameters out differently. Two orders of adding N floats differ by at most
    ``2(N−1)·u·Σ|share|`` ≤ ``2(N−1)·u·max|g|`` (u the unit roundoff; N = 2 adds
    two numbers, one order: no difference). An SGD step moves that by ``lr``, and
    rounding the new weight may add an ulp, ``2u·max|w|``; the next steps'
    gradients move with the weights, allowed for by a factor 2. A loss moves by
    at most ``Σ|∂L/∂w|·Δw`` plus a few ulp of its own. Returns the weight bound
    after the last step and the loss bound of each step."""
    if n <= 2:
        return 0.0, [0.0] * STEPS
    u, drift, losses = UNIT_ROUNDOFF, 0.0, []
    for step in range(STEPS):
        grad_max = max(rank[step]["grad_max"] for rank in sizes)
        grad_l1 = max(rank[step]["grad_l1"] for rank in sizes)
        loss = max(rank[step]["loss"] for rank in sizes)
        losses.append(grad_l1 * drift + 8 * u * loss)  # from this step's weights
        weight_max = max(rank[step]["weight_max"] for rank in sizes)
        drift += 2 * (LR * 2 * (n - 1) * u * grad_max + 2 * u * weight_max)
    return drift, losses


def probe_torch_ddp(solution) -> dict:
    """Run the learner's loop on this rank: a fresh model, the global batches and
    the learning rate; what torch's collectives carried (per step, the step being
    the number of forwards so far), the rows the model was fed, whether torch's DDP
    wrapped the model handed over; then dtlab's DDP on the same job."""
    from dtlab.frameworks.traffic import CollectiveCounter

    r, n = rank_and_size()
    model = exercise_model()
    counter = CollectiveCounter()
    counter.step = -1  # before the first forward: the wrap's broadcast
    fed = []

    def feeding(module, args):
        fed.append(args[0].detach().clone())
        counter.step = len(fed) - 1

    model.register_forward_pre_hook(feeding)
    wraps = []

    def wrapping(frame):  # torch DDP's __init__ starts: what does it wrap?
        wraps.append(frame.f_locals.get("module") is model)

    batches = [_batch(step, 0, 1) for step in range(STEPS)]  # the global batches
    dtlab_ddp = {DistributedDataParallel: "dtlab.ddp.DistributedDataParallel"}
    with Watch(dtlab_ddp, on_call={TORCH_DDP: wrapping}) as seen, counter:
        losses = attempt(solution, model, batches, LR)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "losses": losses,
        "weights": weights,
        "fed": fed,
        "wraps": wraps,
        "forbidden": [f for f in seen.forbidden if f.startswith("dtlab.")],
        "dtlab_comm": [e["op"] for e in seen.launches],
        "traffic": counter.records,
        "dtlab": _train_with_dtlab_ddp(r, n),
        "param_bytes": sum(p.numel() * 4 for p in exercise_model().parameters()),
    }


def _judge_wrapped(r: int, rep: dict) -> None:
    if rep["forbidden"]:
        raise ExerciseFailed(
            f"rank {r}: you used {', '.join(rep['forbidden'])}. This exercise is "
            "PyTorch's own: wrap the model in torch.nn.parallel."
            "DistributedDataParallel."
        )
    if True not in rep["wraps"]:
        by_hand = (
            f" You averaged with dtlab.comm yourself ({len(rep['dtlab_comm'])} "
            "calls): torch's DDP does that for you."
            if rep["dtlab_comm"]
            else ""
        )
        other = " (you wrapped another module)" if rep["wraps"] else ""
        raise ExerciseFailed(
            f"rank {r} never wrapped the model it was given in torch.nn.parallel."
            f"DistributedDataParallel{other}.{by_hand} Wrap it, and train through "
            "the wrapper."
        )


def _judge_fed(r: int, n: int, rep: dict) -> None:
    """One forward per step, of this rank's contiguous slice and nothing else."""
    if len(rep["fed"]) != STEPS:
        raise ExerciseFailed(
            f"rank {r}'s model ran {len(rep['fed'])} forward passes for {STEPS} "
            "batches: one forward, one backward and one optimizer step per batch."
        )
    per = GLOBAL_BATCH // n
    for step, rows in enumerate(rep["fed"]):
        x, _ = _batch(step, 0, 1)  # (B, d_in)
        if rows.shape[0] == GLOBAL_BATCH:
            raise ExerciseFailed(
                f"rank {r}'s model was fed all {GLOBAL_BATCH} rows of the global "
                f"batch in step {step}: every rank trained on the whole batch, N "
                "times the compute for the same gradient. Give rank r its slice, "
                f"rows r·B/N to (r+1)·B/N ({per} rows here)."
            )
        if not torch.equal(rows, x[r * per : (r + 1) * per]):
            raise ExerciseFailed(
                f"rank {r}'s model was fed {rows.shape[0]} rows in step {step}, not "
                f"rows {r * per} to {(r + 1) * per - 1} of the global batch: take "
                "the contiguous slice x[r·B/N : (r+1)·B/N] (dtlab's DDP trains on "
                "it, so the two can be compared)."
            )


def _judge_reduced(r: int, rep: dict) -> int:
    """Every step all-reduced the gradients' bytes, through torch's collectives.
    Returns the all-reduce calls per step."""
    calls = []
    for step in range(STEPS):
        reduced = [
            t
            for t in rep["traffic"]
            if t["step"] == step and t["op"] == "all_reduce" and t["dtype"] != "float64"
        ]
        got = sum(t["payload_bytes"] for t in reduced)
        if got == 0:
            raise ExerciseFailed(
                f"rank {r}: no gradient was all-reduced in step {step}, so each rank "
                "stepped with its own gradient. Run the forward through the DDP "
                "wrapper (ddp(x), not ddp.module(x)) and the backward outside "
                "no_sync(): that is when torch's reducer averages."
            )
        if got < rep["param_bytes"]:
            raise ExerciseFailed(
                f"rank {r} all-reduced {got} bytes in step {step}, fewer than the "
                f"{rep['param_bytes']} bytes of gradients: every parameter's "
                "gradient must be averaged."
            )
        calls.append(len(reduced))
    return max(calls)


def _judge_against_dtlab(reports: list[dict]) -> tuple[bool, float, float]:
    """Identical weights on every rank; weights and losses dtlab's DDP's, bit for
    bit or within :func:`rounding_bounds`. Returns (bit for bit?, the weights'
    largest gap, its bound)."""
    first = reports[0]["weights"]
    for r, rep in enumerate(reports[1:], start=1):
        for name, w in rep["weights"].items():
            if not torch.equal(w, first[name]):
                raise ExerciseFailed(
                    f"after {STEPS} steps rank {r} and rank 0 hold different weights "
                    f"({name}): the ranks did not step with one averaged gradient."
                )
    n = len(reports)
    bound, loss_bounds = rounding_bounds(n, [rep["dtlab"]["sizes"] for rep in reports])
    want = reports[0]["dtlab"]["weights"]
    gap = max((first[k] - want[k]).abs().max().item() for k in want)
    if gap > bound:
        kept = _never_zeroed()
        if all(torch.allclose(first[k], kept[k], atol=1e-5) for k in want):
            raise ExerciseFailed(
                "the gradients of earlier steps were added to each step's: call "
                "optimizer.zero_grad() before every backward."
            )
        worst = max(want, key=lambda k: (first[k] - want[k]).abs().max())
        raise ExerciseFailed(
            f"after {STEPS} steps {worst} differs from dtlab's DDP on the same "
            f"batches by {gap:.2e} (rounding allows {bound:.1e}): one SGD step (the "
            "lr given) per batch, the mean squared error, gradients zeroed every "
            "step."
        )
    exact = gap == 0
    for r, rep in enumerate(reports):
        mine, theirs = rep["losses"], rep["dtlab"]["losses"]
        if not isinstance(mine, list | tuple) or len(mine) != STEPS:
            raise ExerciseFailed(
                f"rank {r} returned {mine!r}: return this rank's losses, one float "
                f"per batch ({STEPS} here)."
            )
        for step, (a, b) in enumerate(zip(mine, theirs)):
            if not isinstance(a, numbers.Real) or abs(a - b) > loss_bounds[step]:
                raise ExerciseFailed(
                    f"rank {r}'s losses {[_short(v) for v in mine]} are not dtlab's "
                    f"DDP's on the same slices {[_short(v) for v in theirs]}: return "
                    "loss.item() of this rank's slice, each step."
                )
            exact = exact and a == b
    return exact, gap, bound


def _short(value):
    return round(value, 7) if isinstance(value, numbers.Real) else value


@exercise(
    "torch_ddp",
    chapter=2,
    reference=train_with_torch_ddp,
    measures=(
        "the model handed over wrapped in torch.nn.parallel.DistributedDataParallel; "
        "each rank's model fed its own contiguous slice, never the whole batch; the "
        "gradient bytes all-reduced every step through torch's collectives; weights "
        "identical on every rank; losses and weights equal dtlab's DDP's, bit for bit "
        "on 2 ranks, within the derived float32 bound on 4 (other bucket layouts)"
    ),
)
def check_torch_ddp(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_torch_ddp, solution)
    calls = 0
    for r, rep in enumerate(reports):
        _judge_wrapped(r, rep)
        _judge_fed(r, n, rep)
        calls = max(calls, _judge_reduced(r, rep))
    exact, gap, bound = _judge_against_dtlab(reports)
    per = GLOBAL_BATCH // n
    size = reports[0]["param_bytes"]
    same = (
        "bit for bit"
        if exact
        else f"within float32 rounding (weights {gap:.1e} apart, bound {bound:.1e})"
    )
    return [
        f"the model was wrapped in torch's DistributedDataParallel on all {n} ranks",
        f"each rank's model was fed its own {per} of the {GLOBAL_BATCH} rows",
        f"torch's reducer all-reduced the {size:,} gradient bytes every step "
        f"({calls} call{'s' if calls > 1 else ''})",
        f"weights identical on every rank; losses and weights after {STEPS} SGD "
        f"steps equal dtlab's DDP's {same}",
    ]

"""Chapter 10's exercises: the number every DDP answer needs, and a graded drill.

1. ``ddp_wire_bytes``: the learner's formula for the bytes one rank sends in a DDP
   step, against what every rank of the live cluster recorded while training a
   real :class:`dtlab.ddp.DistributedDataParallel` step, and offline against
   :func:`dtlab.estimate.ddp_bytes_per_step` for models and worlds far larger.
2. ``drill``: interview cards, each with a rubric of the facts and numbers a strong
   answer contains (:class:`~.ch10_cards.Point`) and the misconceptions it must not
   contain; an answer is scored and the missing points are named. Each card has
   follow-ups ("the network is now 4× slower: what changes?") graded the same way.

The cards, their rubrics, :func:`~dtlab.exercises.ch10_cards.grade` and the timed
:class:`~dtlab.exercises.ch10_cards.MockRound` live in :mod:`.ch10_cards`.
"""

from __future__ import annotations

from torch import nn

from dtlab import estimate as est
from dtlab.ddp import DistributedDataParallel
from dtlab.exercises.ch10_cards import all_cards, grade
from dtlab.exercises.ch10_solutions import ddp_wire_bytes, drill_answers
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.watch import Watch
from dtlab.model import TinyMLP, regression_batch

__all__ = ["check_ddp_wire_bytes", "check_drill"]


# ---- 1. the DDP number -------------------------------------------------------------
def probe_ddp_bytes(solution) -> dict:
    r, n = rank_and_size()
    model = DistributedDataParallel(TinyMLP())  # its start-up broadcast: not watched
    x, y = regression_batch(0, 4 * n)
    with Watch() as seen:
        nn.functional.mse_loss(
            model(x[r * 4 : (r + 1) * 4]), y[r * 4 : (r + 1) * 4]
        ).backward()
    psi = sum(p.numel() for p in model.parameters())
    return {
        "recorded": sum(
            e["wire_bytes"] for e in seen.events if e["op"] == "all_reduce"
        ),
        "yours": float(solution(psi, n, 4)),
        "psi": psi,
    }


@exercise(
    "ddp_wire_bytes",
    chapter=10,
    reference=ddp_wire_bytes,
    measures=(
        "== the wire bytes every rank recorded in a real DDP step (fp32), and == "
        "dtlab.estimate.ddp_bytes_per_step for 7B-405B on 2-1024 GPUs in 2 and 4 bytes"
    ),
)
def check_ddp_wire_bytes(solution, cluster=None):
    for psi in (7e9, 70e9, 405e9):
        for n in (2, 8, 1024):
            for b in (2, 4):
                got = float(attempt(solution, psi, n, b))
                want = est.ddp_bytes_per_step(psi, n, b)
                if abs(got - want) > 1e-9 * want:
                    how = "many" if got > want else "few"
                    raise ExerciseFailed(
                        f"Ψ = {psi:.3g}, N = {n}, {b} bytes a gradient: you say "
                        f"{got:.4g} bytes, the ring all-reduce sends {want:.4g} per "
                        f"rank ({got / want:.3g}× too {how}): "
                        "a reduce-scatter and an all-gather, each (N−1)/N of the "
                        "gradient bytes, 2(N−1)/N·Ψ·bytes in all."
                    )
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_ddp_bytes, solution)
    for r, rep in enumerate(reports):
        if abs(rep["yours"] - rep["recorded"]) > 1e-6 * rep["recorded"]:
            raise ExerciseFailed(
                f"rank {r} recorded {rep['recorded']:.0f} wire bytes in one DDP step "
                f"of Ψ = {rep['psi']}; your formula says {rep['yours']:.0f}."
            )
    return [
        "agrees with dtlab.estimate for 7B-405B on 2-1024 GPUs",
        f"agrees with the {reports[0]['recorded']:.0f} bytes every one of {n} ranks "
        "recorded in a real DDP step",
    ]


@exercise(
    "drill",
    chapter=10,
    reference=drill_answers,
    local=True,
    measures=(
        "5 cards and 5 follow-ups: each answer scored on its rubric (≥ 75 % of the "
        "points), no known misconception; the missing points named"
    ),
)
def check_drill(solution, cluster=None):
    answers = attempt(solution)
    failed = []
    for key in all_cards():
        if not str(answers.get(key, "")).strip():
            failed.append(f"{key}: no answer (follow-ups are part of the drill)")
            continue
        g = grade(key, answers[key])
        if not g.passed:
            failed.append(str(g))
    if failed:
        raise ExerciseFailed("the drill is not passed yet:\n" + "\n".join(failed))
    return [f"every card and follow-up ({len(all_cards())}) passed its rubric"]

"""Chapter 10's exercises: the number every DDP answer needs, and a graded drill.

1. ``ddp_wire_bytes``: the learner's formula for the bytes one rank sends in a DDP
   step, against what every rank of the live cluster recorded while training a
   real :class:`dtlab.ddp.DistributedDataParallel` step, and offline against
   :func:`dtlab.estimate.ddp_bytes_per_step` for models and worlds far larger.
2. ``drill``: five of the interview drill's cards answered as structured answers
   (``{card: {part: value}}``): numbers with units, checked against
   :mod:`dtlab.estimate`; choice sets checked exactly; a misconception chosen fails
   the card. The cards and their grading live in :mod:`dtlab.drill`.
"""

from __future__ import annotations

from torch import nn

from dtlab import estimate as est
from dtlab.ddp import DistributedDataParallel
from dtlab.drill.cards import CARDS
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


# ---- 2. the drill -----------------------------------------------------------------
DRILL_CARDS = (
    "ddp_traffic",
    "zero_stages",
    "one_f_one_b",
    "amp_loss_scaling",
    "long_context_moe",
)
"""The cards the ``drill`` exercise grades: one per core topic of the course."""


def drill_cards() -> list:
    """The exercise's cards, from the drill itself (:mod:`dtlab.drill`: one Card
    type, its numbers, choices and grading)."""
    by_key = {c.key: c for c in CARDS}
    return [by_key[k] for k in DRILL_CARDS]


@exercise(
    "drill",
    chapter=10,
    reference=drill_answers,
    local=True,
    measures=(
        f"{len(DRILL_CARDS)} cards, every part graded as an interviewer does: each "
        "number against dtlab.estimate with its unit (within its stated tolerance), "
        "each choice set exactly, no misconception chosen"
    ),
)
def check_drill(solution, cluster=None):
    answers = attempt(solution)
    if not isinstance(answers, dict):
        raise ExerciseFailed(
            "drill_answers() returns a dict {card key: {part name: value}}, got "
            f"{type(answers).__name__}"
        )
    cards = drill_cards()
    stray = sorted(set(answers) - set(DRILL_CARDS))
    if stray:
        raise ExerciseFailed(
            f"no card {stray[0]!r} in this exercise: answer {list(DRILL_CARDS)}"
        )
    failed = []
    for card in cards:
        if card.key not in answers:
            parts = [p.name for p in card.parts]
            failed.append(f"{card.key}: no answer (its parts: {', '.join(parts)})")
            continue
        try:
            grade = card.grade(answers[card.key])
        except (TypeError, ValueError) as exc:
            failed.append(f"{card.key}: {exc}")
            continue
        if not grade.passed:
            failed.append(grade.feedback())
    if failed:
        raise ExerciseFailed("the drill is not passed yet:\n" + "\n".join(failed))
    parts = sum(len(c.parts) for c in cards)
    return [
        f"all {parts} parts of {len(cards)} cards right: numbers with their units, "
        "choice sets exact, no misconception"
    ]

"""What the drill's graded parts are written with (chapter 10): the vocabulary of
the choice sets, and the two constructors the cards' tables use.

The tables themselves, one entry per card of ``cards.ini``:
:mod:`~dtlab.drill.parts_strategies` (data parallelism, ZeRO/FSDP, tensor,
pipeline, context and expert parallelism),
:mod:`~dtlab.drill.parts_systems` (systems, precision, memory, planning) and
:mod:`~dtlab.drill.parts_frontier` (chapter 12: FP8, the V schedules, Muon) and
:mod:`~dtlab.drill.parts_resilience` (chapter 13: checkpoint intervals, DiLoCo,
resharding checkpoints). Each number is computed by :mod:`dtlab.estimate` (or, for
chapter 13's intervals, :mod:`dtlab.ft`) for a concrete scenario; each
choice set is a multi-select whose misconceptions cost a point. Options are shown
sorted (the right ones are never first by construction), and a misconception's
correction never names the set's right options (tests/test_drill_grading.py).
"""

from __future__ import annotations

from dtlab import estimate as est
from dtlab.drill.grading import Choices, Number, normal

__all__ = ["C", "N", "states"]

W, G, OPT = "weights", "gradients", "optimizer states"
A, B, L = "activations", "the batch", "layers"
NVLINK = "within a node, over NVLink"
EVERY_STEP, EVERY_MB = "once per step", "every microbatch"
EVERY_LAYER, START = "every layer of every microbatch", "once, at start-up"
WHITEBOARD = "10 %: a whiteboard estimate, rounded"


def N(name, prompt, unit, compute, tolerance=0.05, why=None) -> Number:
    """A number part; ``why`` defaults to the 5 % of careful rounding."""
    if why is None:
        return Number(name, prompt, unit, compute, tolerance)
    return Number(name, prompt, unit, compute, tolerance, why)


def C(name, prompt, right, others=(), wrong=None) -> Choices:
    """A choice part: ``right`` and ``others`` are options, ``wrong`` maps each
    misconception offered to its correction; options are shown sorted."""
    wrong = dict(wrong or {})
    options = tuple(sorted({*right, *others, *wrong}, key=normal))
    prompt = f"{prompt} (choose all that apply)"
    return Choices(name, prompt, options, frozenset(right), wrong)


def states(psi, n, stage):
    """Model-state bytes per GPU under ZeRO ``stage`` (ZeRO §5.1)."""
    return est.zero_memory_per_device(psi, n, stage)["total"]

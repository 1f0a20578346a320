"""Chapter 13's second exercise, ``load_plan``: which saved bytes fill a rank's
flat range of one tensor when the layout changed, the load plan of PyTorch's
distributed checkpoint (its planner reads the overlaps of a rank's chunks with the
saved ones) and of :func:`dtlab.reshard.load`, whose general case, pieces of boxes,
is :func:`dtlab.reshard.overlaps`.

A pure function, checked in this process on 4→2, 2→4, an uneven 3→2, an empty
range, pieces whose file order is not their offset order, an exact match, an
empty saved piece, and two holes that must raise ValueError. The plan is judged by
*running* it: the reads fill a buffer from the saved pieces (full element j holds
the number j), which must equal want's slice of the full tensor with every element
written exactly once and nothing read outside want, so any correct plan passes,
adjacent reads merged or not. The first exercise, ``diloco_sync``, is in
:mod:`.ch13_resilience`.
"""

from __future__ import annotations

import operator

import torch

from dtlab.exercises.ch13_solutions import load_plan
from dtlab.exercises.grading import ExerciseFailed, exercise

__all__ = ["check_load_plan"]


# ---- the cases --------------------------------------------------------------------
TEN = ((0, 3), (3, 6), (6, 9), (9, 10))  # 10 elements saved by 4 ranks (ZeRO's cut)
SEVEN = ((0, 3), (3, 6), (6, 7))  # 7 elements saved by 3 ranks: uneven
PLAN_CASES = (  # (what, want, saved in file order): each element written once
    ("4 ranks saved, rank 0 of 2 loads", (0, 5), TEN),
    ("4 ranks saved, rank 1 of 2 loads", (5, 10), TEN),
    ("2 ranks saved, rank 1 of 4 loads", (3, 6), ((0, 5), (5, 10))),
    ("2 ranks saved, rank 3 of 4 loads", (9, 10), ((0, 5), (5, 10))),
    ("3 ranks saved unevenly, rank 0 of 2 loads", (0, 4), SEVEN),
    ("3 ranks saved unevenly, rank 1 of 2 loads", (4, 7), SEVEN),
    ("an empty want (lo == hi)", (4, 4), SEVEN),
    (
        "saved in file order, not offset order",
        (2, 8),
        ((6, 9), (0, 3), (9, 10), (3, 6)),
    ),
    ("want is exactly one saved piece", (3, 6), TEN[:3]),
    ("an empty saved piece", (5, 9), ((0, 3), (3, 6), (6, 9), (9, 9))),
    ("want inside one saved piece", (12, 20), ((0, 10), (10, 30))),
)
HOLES = (  # the saved pieces do not cover want: ValueError
    ("a hole between the saved pieces", (2, 7), ((0, 3), (5, 10))),
    ("want runs past the last saved element", (6, 12), ((0, 5), (5, 10))),
)
_GENERIC = {  # what to do, by what the run of the plan found
    "twice": "each element was written by exactly one saved piece: read it once",
    "missed": "every element of want lies in one saved piece: read each overlap",
    "outside want": "read only each piece's overlap [max(lo, s_lo), min(hi, s_hi))",
    "outside piece": "offsets count from each range's own start: a − s_lo in the "
    "piece, a − lo in want (a: the overlap's first element)",
    "wrong": "offsets count from each range's own start: a − s_lo in the piece, "
    "a − lo in want (a: the overlap's first element)",
    "form": "",
}


def _elements(k: int) -> str:
    return f"{k} element" + ("" if k == 1 else "s")


def _run_plan(plan, want, saved):
    """Fill want from the saved pieces as the plan says (full element j holds j):
    ``(what went wrong, its kind)``, or ``None`` when every element of want was
    read exactly once from where it was written and nothing else was read."""
    lo, hi = want
    if not isinstance(plan, list | tuple):
        return f"it returned a {type(plan).__name__}: return a list of reads", "form"
    filled, times = torch.full((hi - lo,), -1), torch.zeros(hi - lo, dtype=torch.long)
    starts = []
    for k, read in enumerate(plan):
        try:
            i, at_s, at_w, n = (operator.index(v) for v in read)
        except (TypeError, ValueError):
            return (
                f"read {k} is {read!r}: a read is four integers (index into "
                "saved, offset in that piece, offset in want, length)",
                "form",
            )
        if n == 0:  # reads nothing
            continue
        if n < 0:
            return f"read {k} {tuple(read)} has a negative length", "form"
        if not 0 <= i < len(saved):
            return (
                f"read {k} {tuple(read)} names saved piece {i}; saved has "
                f"{len(saved)}, indexed from 0 in file order",
                "form",
            )
        s_lo, s_hi = saved[i]
        if at_s < 0 or at_s + n > s_hi - s_lo:
            return (
                f"read {k} {tuple(read)} takes [{at_s}, {at_s + n}) of saved piece "
                f"{i}, which holds {_elements(s_hi - s_lo)}",
                "outside piece",
            )
        if at_w < 0 or at_w + n > hi - lo:
            return (
                f"read {k} {tuple(read)} writes [{at_w}, {at_w + n}) of want, which "
                f"holds {_elements(hi - lo)}: it reads outside want",
                "outside want",
            )
        filled[at_w : at_w + n] = torch.arange(s_lo + at_s, s_lo + at_s + n)
        times[at_w : at_w + n] += 1
        starts.append(at_w)
    for j, count in enumerate(times.tolist()):
        if count != 1:
            kind = "twice" if count else "missed"
            return (f"element {lo + j} is read {count} times", kind)
    wrong = (filled != torch.arange(lo, hi)).nonzero()
    if len(wrong):
        j = int(wrong[0])
        return (f"element {lo + j} is filled with element {int(filled[j])}", "wrong")
    if starts != sorted(starts):
        return (
            "the reads are right but not sorted by offset in want (the third "
            "field): sort them, so that a loader fills want front to back",
            "form",
        )
    return None


def _canonical(plan):
    """The plan's reads, sorted, adjacent reads of one piece merged, empty ones
    dropped (None if it is not a list of 4-tuples of integers)."""
    try:
        reads = sorted(
            (r[2], r[0], r[1], r[3])
            for r in (tuple(map(operator.index, x)) for x in plan)
        )
    except (TypeError, ValueError, IndexError):
        return None
    out = []
    for at_w, i, at_s, n in (r for r in reads if r[3]):
        if out:
            w, j, s, m = out[-1]
            if j == i and w + m == at_w and s + m == at_s:  # continues the last read
                out[-1] = (w, i, s, m + n)
                continue
        out.append((at_w, i, at_s, n))
    return out


def _mistaken_plans(want, saved):
    """(plan, hint) of each mistake a learner makes, for this case."""
    lo, hi = want
    order = sorted(range(len(saved)), key=lambda i: saved[i])
    plans = {k: [] for k in ("inclusive", "full", "full both", "whole", "sorted")}
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a <= b:
            plans["inclusive"].append((i, a - s_lo, a - lo, b - a + 1))
        if a < b:
            plans["full"].append((i, a, a - lo, b - a))
            plans["full both"].append((i, a, a, b - a))
            plans["whole"].append((i, 0, s_lo - lo, s_hi - s_lo))
            plans["sorted"].append((order.index(i), a - s_lo, a - lo, b - a))
    full = (
        "the offsets are relative to the full tensor instead of the piece: a read "
        "starts a − s_lo into saved piece i and a − lo into want"
    )
    return [
        (
            plans["inclusive"],
            "the ranges are half-open: [lo, hi) holds hi − lo elements, hi not "
            "among them; an overlap [a, b) has b − a (no + 1)",
        ),
        (plans["full"], full),
        (plans["full both"], full),
        (
            plans["whole"],
            "you read the whole saved piece instead of its overlap with want: "
            "only [max(lo, s_lo), min(hi, s_hi)) belongs to this rank",
        ),
        (
            plans["sorted"],
            "the index of a read is into saved as given, in file order: you "
            "numbered the pieces after sorting them",
        ),
    ]


def _plan_hint(plan, want, saved, kind: str) -> str:
    mine = _canonical(plan)
    for wrong, hint in _mistaken_plans(want, saved):
        if mine is not None and mine == _canonical(wrong):
            return hint
    return _GENERIC[kind]


def _call_plan(solution, what, want, saved):
    """The learner's plan for one case, or the ValueError it raised."""
    given = list(saved)
    try:
        plan = solution(tuple(want), given)
    except (ExerciseFailed, NotImplementedError):
        raise
    except ValueError as exc:
        plan = exc
    except Exception as exc:  # noqa: BLE001 - the learner's error, explained
        raise ExerciseFailed(
            f"{what}: your function raised {type(exc).__name__}: {exc}"
            + (
                "; when the pieces leave a hole, raise ValueError, not "
                f"{type(exc).__name__}"
                if (what, want, saved) in HOLES
                else ""
            )
        ) from exc
    if given != list(saved):
        raise ExerciseFailed(
            f"{what}: your function changed the caller's saved list in place: the "
            "reads index into saved in file order, and the caller still holds it; "
            "sort a copy (sorted(...))"
        )
    return plan


@exercise(
    "load_plan",
    chapter=13,
    reference=load_plan,
    local=True,
    measures=(
        "the plan, run: it fills want from the saved pieces with every element read "
        "exactly once from where it was written and nothing else, reads sorted by "
        "offset in want (merged or not); 11 layouts (4→2, 2→4, uneven 3→2, empty "
        "want, unsorted pieces, exact match, an empty piece); 2 holes raise ValueError"
    ),
)
def check_load_plan(solution, cluster=None):
    for what, want, saved in PLAN_CASES:
        plan = _call_plan(solution, what, want, saved)
        where = f"{what} (want {want}, saved {list(saved)})"
        if isinstance(plan, ValueError):
            hint = (
                "want is empty (lo == hi): there is nothing to read; return []"
                if want[0] == want[1]
                else "the saved pieces come in any order (the old ranks' files as "
                "listed): take each overlap wherever it is"
                if list(saved) != sorted(saved)
                else "the saved pieces cover want"
            )
            raise ExerciseFailed(
                f"{where}: your function raised ValueError ({plan}): {hint}"
            )
        found = _run_plan(plan, want, saved)
        if found is not None:
            problem, kind = found
            hint = _plan_hint(plan, want, saved, kind)
            raise ExerciseFailed(f"{where}: {problem}" + (f"; {hint}" if hint else ""))
    for what, want, saved in HOLES:
        plan = _call_plan(solution, what, want, saved)
        if not isinstance(plan, ValueError):
            raise ExerciseFailed(
                f"{what} (want {want}, saved {list(saved)}): your function returned "
                f"{plan!r}; raise ValueError when the saved pieces do not cover want "
                "(a rank that loads a hole trains on garbage)"
            )
    return [
        f"{len(PLAN_CASES)} layouts (4→2, 2→4, uneven 3→2, an empty want, unsorted "
        "pieces, an exact match, an empty saved piece), the plan run: every element "
        "of want read once, from where it was written, nothing else",
        f"{len(HOLES)} holes (a gap, a want past the end) raise ValueError",
    ]

"""The course's exercises: the learner builds each mechanism, the library checks it.

Every chapter has exercises; each has a checker ``check_<name>(solution,
cluster=None)`` that runs the learner's function on every rank of the live cluster
(or locally, for a pure function), compares the result with a reference, and judges
*how* it was computed from what the ranks really did: the ops, peers and bytes that
:mod:`dtlab.telemetry` recorded, call counts, peak bytes, overlap. A wrong answer
raises :class:`ExerciseFailed` (an ``AssertionError``) whose message names what is
wrong and hints at the fix.

    from dtlab.exercises import check_ring_reduce_scatter, solution
    check_ring_reduce_scatter(my_ring_reduce_scatter, cluster)
    solution("ring_reduce_scatter")        # shows the reference, on request

A stub (a body that only raises ``NotImplementedError``) is reported as *not
attempted yet*, not as a failure; with ``DTLAB_SUBSTITUTE_SOLUTIONS=1`` (the test
command's switch) the reference runs in its place, so every checker runs end to end.
Each exercise also carries a catalogue of wrong solutions, the mistakes learners
really make, each with the message its checker must give. The catalogues are test
data: they live in ``tests/mistakes/`` (one module per chapter, registering into
:data:`REGISTRY` when the tests import them), and ``tests/test_exercises.py`` proves
every one of them rejected (:func:`catalogue` lists them once loaded). The package
keeps only the one a chapter shows the learner (:mod:`.ch05_mistakes`).

Per chapter: ``chNN_solutions`` (the references, what :func:`solution` shows),
``chNN_<topic>`` (the probes that run on the ranks and the checkers that judge
them: :mod:`.ch01_collectives` … :mod:`.ch12_frontier` and chapter 13's
:mod:`.ch13_resilience`, the DiLoCo meeting; the framework exercises in modules of
their own, :mod:`.ch02_torch_ddp` and :mod:`.ch03_fsdp2`, chapter 12's third, the
owners of sharded Muon, in :mod:`.ch12_muon`, and chapter 13's second, the load
plan of a resharded checkpoint, in :mod:`.ch13_saved_pieces`). Shared by all:
:mod:`.grading` (verdicts, stubs, the registry), :mod:`.ranks` (running a probe on
every rank) and :mod:`.watch` (what a rank's code really did).
"""

from __future__ import annotations

import inspect

# the one mistake a chapter shows (chapter 05); the catalogues live in tests/mistakes
from dtlab.exercises import ch05_mistakes  # noqa: F401
from dtlab.exercises.ch00_memory import check_min_gpus, check_zero2_bytes
from dtlab.exercises.ch01_collectives import (
    check_ring_all_reduce,
    check_ring_reduce_scatter,
)
from dtlab.exercises.ch02_data_parallel import (
    check_bucketed_hooks,
    check_grad_hooks,
    check_no_sync_accumulation,
    check_overlapped_hooks,
)
from dtlab.exercises.ch02_torch_ddp import check_torch_ddp
from dtlab.exercises.ch03_fsdp2 import check_fully_shard
from dtlab.exercises.ch03_zero import (
    check_fsdp_unit,
    check_zero1_step,
    check_zero2_hooks,
)
from dtlab.exercises.ch04_tensor_parallel import (
    check_column_parallel,
    check_row_parallel,
    check_sequence_parallel,
)
from dtlab.exercises.ch05_pipeline import (
    check_one_f_one_b,
    check_pipeline_executor,
)
from dtlab.exercises.ch06_mixed_precision import (
    check_autocast_step,
    check_loss_scaler,
    check_underflow,
)
from dtlab.exercises.ch07_layouts import check_layout_defence, check_rank_order
from dtlab.exercises.ch08_memory import check_accumulation, check_checkpointing
from dtlab.exercises.ch09_planning import check_step_time, check_zero_states
from dtlab.exercises.ch10_drill import check_ddp_wire_bytes, check_drill
from dtlab.exercises.ch11_beyond import (
    check_all_to_all_splits,
    check_merge_attention,
    check_moe_dispatch,
)
from dtlab.exercises.ch12_frontier import (
    check_delayed_scaling_update,
    check_split_backward,
)
from dtlab.exercises.ch12_muon import check_assign_owners
from dtlab.exercises.ch13_resilience import check_diloco_sync
from dtlab.exercises.ch13_saved_pieces import check_load_plan
from dtlab.exercises.grading import (
    REGISTRY,
    SUBSTITUTE_ENV,
    Exercise,
    ExerciseFailed,
    Mistake,
    NotAttempted,
    Report,
    is_stub,
    substituting,
)

__all__ = [
    "ExerciseFailed",
    "NotAttempted",
    "Report",
    "Exercise",
    "Mistake",
    "REGISTRY",
    "SUBSTITUTE_ENV",
    "is_stub",
    "substituting",
    "solution",
    "exercise",
    "catalogue",
    "check_zero2_bytes",
    "check_min_gpus",
    "check_ring_reduce_scatter",
    "check_ring_all_reduce",
    "check_grad_hooks",
    "check_overlapped_hooks",
    "check_bucketed_hooks",
    "check_no_sync_accumulation",
    "check_torch_ddp",
    "check_zero1_step",
    "check_zero2_hooks",
    "check_fsdp_unit",
    "check_fully_shard",
    "check_column_parallel",
    "check_row_parallel",
    "check_sequence_parallel",
    "check_one_f_one_b",
    "check_pipeline_executor",
    "check_loss_scaler",
    "check_underflow",
    "check_autocast_step",
    "check_layout_defence",
    "check_rank_order",
    "check_checkpointing",
    "check_accumulation",
    "check_step_time",
    "check_zero_states",
    "check_ddp_wire_bytes",
    "check_drill",
    "check_merge_attention",
    "check_moe_dispatch",
    "check_all_to_all_splits",
    "check_delayed_scaling_update",
    "check_split_backward",
    "check_assign_owners",
    "check_diloco_sync",
    "check_load_plan",
]


def exercise(name: str) -> Exercise:
    """The exercise called ``name`` (its checker, reference and mistakes)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"no exercise {name!r}: choose one of {sorted(REGISTRY)}"
        ) from None


def solution(name: str, *, show: bool = True) -> str:
    """The reference solution of exercise ``name``, as source (printed unless
    ``show=False``): read it after trying, or when stuck."""
    source = inspect.getsource(exercise(name).reference)
    if show:
        print(source)
    return source


def catalogue(chapter: int | None = None) -> list[dict]:
    """One row per exercise: chapter, name, what its checker measures, and the
    wrong solutions it is proven to reject (with the message fragment of each)."""
    return [
        {
            "chapter": ex.chapter,
            "name": ex.name,
            "measures": ex.measures,
            "rejects": [(m.name, m.expect) for m in ex.mistakes],
        }
        for ex in REGISTRY.values()
        if chapter is None or ex.chapter == chapter
    ]

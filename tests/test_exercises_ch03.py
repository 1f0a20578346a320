"""Chapter 03's framework exercise, ``fully_shard``, is proven like the others
(tests/test_exercises.py): its checker accepts the reference and rejects every wrong
solution of its catalogue with the message the catalogue names, on the notebooks'
4 CPU ranks.

Beyond the catalogue: the budget is the chapter's arithmetic (4Ψ/N of fp32 shards
held, the root and two blocks of bf16 weights whole at once, 2 × 2Ψ bytes
all-gathered in at most two calls per unit, 4Ψ reduce-scattered); a passing report
names what was measured, and FSDP2's default for the root (not resharded after
forward, since backward gathers it at once) fits as well as an explicit
``reshard_after_forward=True``; a stub is "not attempted yet", and under the test
command's switch the reference runs in its place.
"""

import pytest
import torch

from dtlab import exercises
from dtlab.exercises import REGISTRY
from dtlab.exercises.ch03_fsdp2 import FSDP2_GPT, fsdp2_budget
from dtlab.lab.kernel.shipping import ship_by_value
from dtlab.model import GPT

pytestmark = pytest.mark.cluster

EXERCISE = REGISTRY["fully_shard"]


def test_fully_shard_is_a_chapter_3_exercise_with_its_mistakes():
    assert EXERCISE.chapter == 3 and not EXERCISE.local
    assert len(EXERCISE.mistakes) >= 4 and all(m.why for m in EXERCISE.mistakes)
    assert EXERCISE.checker is exercises.check_fully_shard and EXERCISE.measures


def test_the_budget_is_the_chapters_arithmetic():
    psi = GPT(FSDP2_GPT).n_params()
    b = fsdp2_budget(4)
    assert b["psi"] == psi and b["held"] == 4 * psi // 4  # every dim-0 divides by 4
    assert b["model_bytes"] == 2 * psi
    assert b["peak"] == b["root_bytes"] + 2 * b["block_bytes"] < b["model_bytes"]
    assert b["gather_bytes"] == 2 * 2 * psi and b["reduce_bytes"] == 4 * psi
    assert b["gather_calls"] == 2 * (1 + FSDP2_GPT.n_layers)


def test_checker_accepts_its_reference_on_four_ranks(lab_cluster):
    report = exercises.check_fully_shard(EXERCISE.reference, lab_cluster(4))
    assert report.passed, report
    b = fsdp2_budget(4)
    assert any(f"{b['held']:,} B per rank" in line for line in report.lines)
    assert any("all-gathers of bf16" in line for line in report.lines)


def root_resharded_too(model, mesh):
    """The reference, but the root also freed after forward (2 more gathers)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)


def test_an_explicit_reshard_of_the_root_fits_the_budget_too(lab_cluster):
    ship_by_value(root_resharded_too)  # the engines cannot import this test file
    report = exercises.check_fully_shard(root_resharded_too, lab_cluster(4))
    assert report.passed, report
    assert any("10 all-gathers" in line for line in report.lines), report


def stub(model, mesh):
    """Your wrapping."""
    raise NotImplementedError


def test_a_stub_is_not_attempted_and_substituted_under_the_switch(
    monkeypatch, lab_cluster
):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    report = exercises.check_fully_shard(stub, lab_cluster(4))
    assert report.status == "not attempted yet"
    monkeypatch.setenv(exercises.SUBSTITUTE_ENV, "1")
    report = exercises.check_fully_shard(stub, lab_cluster(4))
    assert report.status == "reference substituted" and report.lines

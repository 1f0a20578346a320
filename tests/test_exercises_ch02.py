"""Chapter 02's framework exercise, ``torch_ddp``, is proven like the others
(tests/test_exercises.py): its checker accepts the reference and rejects every wrong
solution of its catalogue with the message the catalogue names, on the notebooks'
4 CPU ranks.

Beyond the catalogue: the checker's claim that PyTorch's DDP trains like dtlab's is
bit for bit on 2 ranks (gloo adds two shares, in one order) and within the derived
float32 bound on 4 (the ring adds four shares in an order set by each element's
place in the bucket, which the two libraries lay out differently); a stub is "not
attempted yet", and under the test command's switch the reference runs in its
place.
"""

import pytest

from dtlab import exercises
from dtlab.exercises import REGISTRY
from dtlab.exercises.ch02_data_parallel import STEPS
from dtlab.exercises.ch02_torch_ddp import rounding_bounds

pytestmark = pytest.mark.cluster

EXERCISE = REGISTRY["torch_ddp"]


def test_torch_ddp_is_a_chapter_2_exercise_with_four_mistakes():
    assert EXERCISE.chapter == 2 and not EXERCISE.local
    assert len(EXERCISE.mistakes) >= 4 and all(m.why for m in EXERCISE.mistakes)
    assert EXERCISE.checker is exercises.check_torch_ddp and EXERCISE.measures


def test_checker_accepts_its_reference_on_four_ranks(lab_cluster):
    report = exercises.check_torch_ddp(EXERCISE.reference, lab_cluster(4))
    assert report.passed, report
    assert any("fed its own 6 of the 24 rows" in line for line in report.lines)
    assert any("all-reduced the 11,680 gradient bytes" in line for line in report.lines)


def test_bit_for_bit_on_two_ranks(lab_cluster):
    report = exercises.check_torch_ddp(EXERCISE.reference, lab_cluster(2))
    assert report.passed and "bit for bit" in report.lines[-1], report


def test_the_rounding_bound_is_zero_for_two_ranks_and_grows_with_n():
    sizes = [
        [{"loss": 0.5, "grad_max": 0.1, "grad_l1": 20.0, "weight_max": 1.0}] * STEPS
    ] * 4
    assert rounding_bounds(2, sizes) == (0.0, [0.0] * STEPS)
    w4, losses4 = rounding_bounds(4, sizes)
    w8, _ = rounding_bounds(8, sizes)
    assert 0 < w4 < w8 < 1e-5
    assert losses4[0] < losses4[-1]  # later steps start from drifted weights


def stub(model, batches, lr):
    """Your loop."""
    raise NotImplementedError


def test_a_stub_is_not_attempted_and_substituted_under_the_switch(
    monkeypatch, lab_cluster
):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    assert exercises.check_torch_ddp(stub, lab_cluster(4)).status == (
        "not attempted yet"
    )
    monkeypatch.setenv(exercises.SUBSTITUTE_ENV, "1")
    report = exercises.check_torch_ddp(stub, lab_cluster(4))
    assert report.status == "reference substituted" and report.lines

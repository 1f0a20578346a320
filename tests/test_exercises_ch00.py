"""Chapter 00's exercises are proven like the others (tests/test_exercises.py): each
checker accepts its reference and rejects every wrong solution of its catalogue with
the message the catalogue names. Both are pure functions, checked in this process
(no cluster)."""

import pytest

from dtlab.exercises import REGISTRY, ExerciseFailed
from dtlab.exercises.ch00_memory import fitting_gpus

CHAPTER_0 = [name for name, ex in REGISTRY.items() if ex.chapter == 0]
MISTAKES = [
    pytest.param(name, m, id=f"{name}-{m.name}")
    for name in CHAPTER_0
    for m in REGISTRY[name].mistakes
]


def test_chapter_0_has_two_local_exercises_with_four_mistakes_each():
    assert CHAPTER_0 == ["zero2_bytes", "min_gpus"]
    for name in CHAPTER_0:
        ex = REGISTRY[name]
        assert ex.local and len(ex.mistakes) >= 4 and all(m.why for m in ex.mistakes)


@pytest.mark.parametrize("name", CHAPTER_0)
def test_checker_accepts_its_reference(name):
    report = REGISTRY[name].checker(REGISTRY[name].reference)
    assert report.passed and report.lines, report


@pytest.mark.parametrize("name,mistake", MISTAKES)
def test_checker_rejects_the_mistake(name, mistake):
    with pytest.raises(ExerciseFailed) as failed:
        REGISTRY[name].checker(mistake.solution)
    assert mistake.expect in str(failed.value), str(failed.value)


def test_the_paper_figure_and_the_floor():
    """ZeRO's Figure 1 under stage 2 (16.6 GB), and 70B under ZeRO-2 on 80 GB: its
    2Ψ of bf16 weights alone exceed the GPU, so no number of GPUs is enough."""
    from dtlab import estimate as est

    ref = REGISTRY["zero2_bytes"].reference
    assert round(ref(7.5e9, 64) / est.GB, 1) == 16.6
    h100 = est.GPUS["H100-80GB"].memory_bytes
    assert fitting_gpus(est.MODELS["70B"].n_params, h100, 2) is None
    assert REGISTRY["min_gpus"].reference(est.MODELS["70B"].n_params, h100, 2) is None

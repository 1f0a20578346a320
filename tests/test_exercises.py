"""The exercises' checkers are proven: each accepts its reference solution and
rejects every wrong solution of its catalogue (the mistakes learners really make)
with the message the catalogue expects. A checker that accepts a wrong solution,
or rejects one for another reason than the one named, fails here.

Every live exercise runs on ONE shared cluster of 4 CPU ranks (the session's
``lab_cluster(4)``), the notebooks' world size; a wrong solution that raises on a
rank leaves the world to be reset by the next run, which the cluster does itself.
"""

import inspect

import pytest

from dtlab import exercises
from dtlab.exercises import REGISTRY, ExerciseFailed, Report

WORLD = 4

pytestmark = pytest.mark.cluster

MISTAKES = [
    pytest.param(name, m, id=f"{name}-{m.name}")
    for name, ex in REGISTRY.items()
    for m in ex.mistakes
]


def cluster_for(name, lab_cluster):
    return None if REGISTRY[name].local else lab_cluster(WORLD)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_checker_accepts_its_reference(name, lab_cluster):
    report = REGISTRY[name].checker(
        REGISTRY[name].reference, cluster_for(name, lab_cluster)
    )
    assert isinstance(report, Report) and report.passed, report
    assert report.lines, "a passing report says what it verified"


@pytest.mark.parametrize("name,mistake", MISTAKES)
def test_checker_rejects_the_mistake(name, mistake, lab_cluster):
    with pytest.raises(ExerciseFailed) as failed:
        REGISTRY[name].checker(mistake.solution, cluster_for(name, lab_cluster))
    assert mistake.expect in str(failed.value), (
        f"{mistake.name} was rejected for another reason than the one its "
        f"catalogue names ({mistake.expect!r}):\n{failed.value}"
    )


def test_every_exercise_has_four_mistakes_and_a_documented_checker():
    for name, ex in REGISTRY.items():
        assert len(ex.mistakes) >= 4, f"{name} has {len(ex.mistakes)} wrong solutions"
        assert all(m.why for m in ex.mistakes), f"{name}: say what each mistake is"
        assert ex.measures and inspect.getdoc(ex.reference), name


def test_every_chapter_has_two_exercises():
    chapters = [ex.chapter for ex in REGISTRY.values()]
    for chapter in sorted(set(chapters)):
        assert chapters.count(chapter) >= 2, f"chapter {chapter}"


# ---- stubs, substitution, solutions ------------------------------------------------
def stub_ring(output, input):
    """Your ring reduce-scatter."""
    raise NotImplementedError


def stub_with_a_comment(tensor):
    # write it here
    raise NotImplementedError("write your ring all-reduce")


class StubFunction:
    @staticmethod
    def forward(ctx, x):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        """Backward."""
        raise NotImplementedError


def started(tensor):
    tensor.add_(1)
    raise NotImplementedError  # not a stub any more: the learner began


def test_stubs_are_recognised():
    assert exercises.is_stub(stub_ring)
    assert exercises.is_stub(stub_with_a_comment)
    assert exercises.is_stub(StubFunction)
    assert not exercises.is_stub(started)
    assert not exercises.is_stub(exercises.ch01_solutions.ring_all_reduce)
    assert not exercises.is_stub(print)  # no source to read: not a stub


def test_a_stub_is_not_attempted_yet(monkeypatch, capsys):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    report = exercises.check_ring_reduce_scatter(stub_ring)  # needs no cluster
    assert report.status == "not attempted yet" and not report.attempted
    assert "not attempted yet" in capsys.readouterr().out


def test_the_test_command_substitutes_the_reference(monkeypatch, lab_cluster):
    monkeypatch.setenv(exercises.SUBSTITUTE_ENV, "1")
    report = exercises.check_ring_all_reduce(stub_with_a_comment, lab_cluster(WORLD))
    assert report.status == "reference substituted" and report.lines


def test_a_stub_found_only_on_the_ranks_is_not_attempted(monkeypatch, lab_cluster):
    # a function whose source cannot be read, raising NotImplementedError on a rank
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    hidden = eval("lambda output, input: (_ for _ in ()).throw(NotImplementedError())")
    report = exercises.check_ring_reduce_scatter(hidden, lab_cluster(WORLD))
    assert report.status == "not attempted yet"


def test_solution_shows_the_reference(capsys):
    source = exercises.solution("ring_reduce_scatter")
    assert "def ring_reduce_scatter" in source and "isend" in source
    assert "def ring_reduce_scatter" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no exercise"):
        exercises.solution("ring_reduce")


def test_catalogue_lists_what_each_checker_measures():
    rows = exercises.catalogue()
    assert [r["name"] for r in rows] == list(REGISTRY)
    assert all(r["measures"] and len(r["rejects"]) >= 4 for r in rows)

"""The learner's predictions: committed in any unit of the right kind, refused by
name when they cannot mean anything, compared after the run, and kept on disk."""

import json

import pytest

from dtlab.lab import predictions
from dtlab.lab.predictions import Question, compare, predict, prediction_log

Q = Question("ring_bytes_test", "01", "bytes each rank sends", "MB")
P = Question("bubble_test", "05", "the bubble's share of the step", "fraction")


@pytest.fixture
def log(tmp_path, monkeypatch):
    monkeypatch.setenv("DTLAB_HOME", str(tmp_path))
    monkeypatch.setattr(predictions, "questions", lambda: {Q.key: Q, P.key: P})
    return tmp_path / "predictions.json"


def test_a_prediction_in_another_unit_of_the_same_kind_is_converted(log, capsys):
    assert predict("ring_bytes_test", 1500, "kB") == pytest.approx(1.5)
    assert predict("ring_bytes_test", 1.5) == 1.5  # the question's own unit
    assert json.loads(log.read_text())["ring_bytes_test"]["predicted"] == 1.5e6
    assert predict("bubble_test", 20, "%") == pytest.approx(0.2)
    assert "Prediction recorded" in capsys.readouterr().out


def test_no_prediction_says_so_and_goes_on(log, capsys):
    assert predict("ring_bytes_test", None) is None
    out = capsys.readouterr().out
    assert "No prediction yet" in out and "goes on" in out
    c = compare("ring_bytes_test", measured=1.5, estimate=1.5)
    assert c.predicted is None and c.error is None
    assert "none made" in capsys.readouterr().out


@pytest.mark.parametrize(
    "key, value, unit, error, words",
    [
        ("ring_bytes_test", "1.5 MB", None, TypeError, "must be a number"),
        ("ring_bytes_test", True, None, TypeError, "must be a number"),
        ("ring_bytes_test", float("nan"), None, ValueError, "finite"),
        ("ring_bytes_test", 1.5, "ms", ValueError, "is bytes"),
        ("ring_bytes_test", 1.5, "megabytes", ValueError, "unknown unit"),
        ("ring_byte_test", 1.5, None, KeyError, "did you mean 'ring_bytes_test'"),
        (3, 1.5, None, TypeError, "key is a string"),
    ],
)
def test_what_cannot_be_a_prediction_is_refused_by_name(
    log, key, value, unit, error, words
):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        predict(key, value, unit)
    assert not log.exists()  # nothing half-recorded


def test_compare_prints_three_numbers_and_the_log_survives_a_restart(log, capsys):
    predict("ring_bytes_test", 3.0)
    c = compare("ring_bytes_test", measured=1.5e6, estimate=1.5e6, unit="B")
    assert (c.predicted, c.estimate, c.measured, c.error) == (3.0, 1.5, 1.5, 2.0)
    out = capsys.readouterr().out
    assert "your prediction: 3 MB" in out and "2× (over)" in out
    predict("bubble_test", 0.1)
    compare("bubble_test", measured=0.2)
    # a new kernel reads the same file: nothing held in memory
    rows = prediction_log(show=False)
    assert [(r["key"], r["error"]) for r in rows] == [
        ("ring_bytes_test", 2.0),
        ("bubble_test", 0.5),
    ]
    prediction_log()
    assert "off by 2× (under)" in capsys.readouterr().out
    # a new prediction waits for a new measurement
    predict("ring_bytes_test", 1.5)
    assert prediction_log(show=False)[0]["measured"] is None
    predictions.forget()
    assert prediction_log(show=False) == []


def test_a_damaged_log_starts_afresh(log):
    log.write_text("{not json")
    predict("ring_bytes_test", 1.0)
    assert json.loads(log.read_text())["ring_bytes_test"]["predicted"] == 1e6


def test_every_chapter_question_is_declared_once_with_a_real_unit():
    found = predictions.questions()
    for key, q in found.items():
        assert q.key == key and q.unit in predictions.UNITS and q.text
        assert q.chapter.isdigit() and len(q.chapter) == 2

"""The learner's predictions: a number committed before the live run, held against
the measurement and the estimate after it, and kept across the course.

Every chapter's mechanism starts with a question whose answer is a number (bytes a
rank sends, peak memory, the bubble, a step's time). The learner answers it with
``predict(key, value, unit)`` *before* the cell that measures it; afterwards the
chapter calls ``compare(key, measured=..., estimate=...)``, which prints the three
side by side and records how far off the prediction was. ``prediction_log()``
prints every comparison of the course so far: the log is a JSON file
(``$DTLAB_HOME/predictions.json``, ``~/.dtlab`` by default), so it survives a kernel
restart and a new session.

A plain Run All, with no prediction made (``predict(key, None)`` as the chapter
ships), says so and goes on. A non-number, a unit of the wrong kind or a key no
chapter asks is refused by name.

The questions themselves live with their chapters: each lesson module
(:mod:`dtlab.lab.lessons.ch01`, ...) declares ``QUESTIONS``, a list of
:class:`Question`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import math
import numbers
import os
import pathlib
import pkgutil
import time

from dtlab.units import UNITS

__all__ = [
    "Question",
    "UNITS",
    "compare",
    "forget",
    "log_path",
    "predict",
    "prediction_log",
    "questions",
]

_BASE = {"bytes": "B", "time": "s", "fraction": "fraction", "ratio": "x"}
_BASE |= {"count": "count", "flops": "FLOP"}


@dataclasses.dataclass(frozen=True)
class Question:
    """One number a chapter asks the learner to predict.

    ``key`` names it in ``predict``/``compare``; ``unit`` is the unit the chapter
    thinks in (any unit of the same kind is accepted and converted); ``text`` is
    the question as the chapter asks it."""

    key: str
    chapter: str
    text: str
    unit: str

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"Question {self.key!r}: unknown unit {self.unit!r}")

    @property
    def kind(self) -> str:
        return UNITS[self.unit][0]


def questions() -> dict[str, Question]:
    """Every question the chapters ask, by key (each lesson module's
    ``QUESTIONS``)."""
    from dtlab.lab import lessons

    found: dict[str, Question] = {}
    for info in pkgutil.iter_modules(lessons.__path__):
        module = importlib.import_module(f"dtlab.lab.lessons.{info.name}")
        for q in getattr(module, "QUESTIONS", ()):
            if q.key in found:
                raise RuntimeError(f"prediction key {q.key!r} is declared twice")
            found[q.key] = q
    return found


def log_path() -> pathlib.Path:
    """Where the log lives: ``$DTLAB_HOME/predictions.json`` (``~/.dtlab``)."""
    home = os.environ.get("DTLAB_HOME") or pathlib.Path.home() / ".dtlab"
    return pathlib.Path(home) / "predictions.json"


def _load() -> dict:
    path = log_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # a damaged log starts afresh rather than stopping a chapter


def _save(log: dict) -> None:
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(log, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: a kernel killed mid-write leaves the old log


def _question(key) -> Question:
    if not isinstance(key, str):
        raise TypeError(f"a prediction's key is a string, got {key!r}")
    known = questions()
    if key not in known:
        near = difflib.get_close_matches(key, known, n=3)
        hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
        raise KeyError(f"no chapter asks for a prediction called {key!r}{hint}")
    return known[key]


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _to_base(q: Question, value, unit: str | None) -> float:
    unit = q.unit if unit is None else unit
    if unit not in UNITS:
        raise ValueError(
            f"unknown unit {unit!r} for {q.key!r}; {q.kind} are written in "
            + ", ".join(u for u, (k, _) in UNITS.items() if k == q.kind)
        )
    kind, factor = UNITS[unit]
    if kind != q.kind:
        raise ValueError(
            f"{q.key!r} is {q.kind} (say it in {q.unit!r}, for instance), "
            f"not {kind} ({unit!r})"
        )
    return _number(f"the prediction for {q.key!r}", value) * factor


def _show(q: Question, base: float) -> str:
    return _format(base / UNITS[q.unit][1], q.unit)


def _format(value: float, unit: str) -> str:
    if unit == "fraction":
        return f"{value:.3g}"
    if unit == "%":
        return f"{value:.3g} %"
    return f"{value:,.4g} {unit}" if abs(value) < 1e6 else f"{value:.4g} {unit}"


def predict(key: str, value, unit: str | None = None) -> float | None:
    """Commit a prediction for ``key`` (the chapter's question), in ``unit``
    (default: the unit the chapter asks in; any unit of the same kind works:
    ``predict("ring_bytes", 1.5, "MB")``). ``value=None`` means no prediction yet:
    the chapter says so and goes on. Returns the prediction in the question's
    unit, or None."""
    q = _question(key)
    if value is None:
        print(
            f"No prediction yet for {key!r} ({q.text}). Put your number in this "
            "cell before running the measurement; the chapter goes on without it."
        )
        return None
    base = _to_base(q, value, unit)
    log = _load()
    entry = log.setdefault(key, {"chapter": q.chapter})
    entry.update(predicted=base, predicted_at=time.time())
    entry.pop("measured", None)  # a new prediction waits for a new measurement
    entry.pop("estimate", None)
    _save(log)
    print(f"Prediction recorded: {key} = {_show(q, base)}  ({q.text})")
    return base / UNITS[q.unit][1]


@dataclasses.dataclass(frozen=True)
class Comparison:
    """What :func:`compare` found: all in the question's unit; ``predicted`` is
    None without a prediction; ``error`` is predicted/measured (1 is exact)."""

    key: str
    unit: str
    predicted: float | None
    estimate: float | None
    measured: float
    error: float | None


def compare(key: str, measured, estimate=None, unit: str | None = None) -> Comparison:
    """Print the learner's prediction for ``key`` beside the estimate and the
    measurement (``unit`` as in :func:`predict`) and log how far off it was."""
    q = _question(key)
    measured_base = _to_base(q, measured, unit)
    estimate_base = None if estimate is None else _to_base(q, estimate, unit)
    log = _load()
    entry = log.setdefault(key, {"chapter": q.chapter})
    predicted = entry.get("predicted")
    entry.update(measured=measured_base, estimate=estimate_base)
    _save(log)
    rows = [("your prediction", predicted), ("estimate", estimate_base)]
    rows.append(("measured", measured_base))
    print(q.text)
    for name, v in rows:
        if name == "your prediction" and v is None:
            print(f"  {name:>16}: none made (predict({key!r}, ...) records one)")
        elif v is not None:
            print(f"  {name:>16}: {_show(q, v)}")
    error = _ratio(predicted, measured_base)
    if error is not None:
        print(f"  {'off by':>16}: {_describe(error)}")
    scale = UNITS[q.unit][1]
    return Comparison(
        key,
        q.unit,
        None if predicted is None else predicted / scale,
        None if estimate_base is None else estimate_base / scale,
        measured_base / scale,
        error,
    )


def _ratio(predicted, measured) -> float | None:
    if predicted is None:
        return None
    if measured == 0:
        return 1.0 if predicted == 0 else math.inf
    return predicted / measured


def _describe(ratio: float) -> str:
    if ratio == 1:
        return "nothing: exact"
    if ratio <= 0 or math.isinf(ratio):
        return f"{ratio:.3g}× the measurement (the other side of zero)"
    factor = ratio if ratio >= 1 else 1 / ratio
    side = "over" if ratio > 1 else "under"
    return f"{factor:.3g}× ({side})"


def prediction_log(show: bool = True) -> list[dict]:
    """Every prediction of the course so far, in chapter order: key, chapter,
    prediction, measurement and how far off (predicted/measured). Printed as a
    table unless ``show=False``; returned as rows either way."""
    known = questions()
    rows = []
    for key, entry in sorted(_load().items(), key=lambda kv: (kv[1]["chapter"], kv[0])):
        q = known.get(key)
        if q is None:
            continue  # a question a newer course no longer asks
        rows.append(
            {
                "key": key,
                "chapter": q.chapter,
                "unit": q.unit,
                "predicted": entry.get("predicted"),
                "measured": entry.get("measured"),
                "error": _ratio(entry.get("predicted"), entry["measured"])
                if entry.get("measured") is not None
                else None,
            }
        )
    if show:
        if not rows:
            print("No predictions yet: the chapters' predict(...) cells record them.")
        for r in rows:
            q = known[r["key"]]
            p = "—" if r["predicted"] is None else _show(q, r["predicted"])
            m = "not measured yet" if r["measured"] is None else _show(q, r["measured"])
            e = "" if r["error"] is None else f"   off by {_describe(r['error'])}"
            print(f"ch{r['chapter']} {r['key']:<24} you: {p:<14} measured: {m}{e}")
    return rows


def forget(key: str | None = None) -> None:
    """Drop one prediction from the log (``key``), or the whole log (None)."""
    log = _load()
    if key is None:
        log = {}
    else:
        _question(key)
        log.pop(key, None)
    _save(log)

"""The course's units, and reading a number the way a learner writes it on a
whiteboard: ``28 GB``, ``2.8e10``, ``28e9 B``, ``26.1 GiB``, ``28,000 MB``,
``1.2 s``, ``12 %``, ``0.12``, ``2.8 × 10^10 bytes``. The predictions a chapter
asks for (:mod:`dtlab.lab.predictions`) and the drill's numbers (chapter 10,
:mod:`dtlab.drill`) use the same table.

The units are :data:`UNITS` (kB/MB/GB powers of 1000, KiB/MiB/GiB powers of 1024,
as the course counts), plus the words and spellings a learner types for them
(:data:`ALIASES`: ``bytes``, ``sec``, ``days``, ``percent``, ``×``...).
Dimensionless kinds (a fraction, a ratio, a count) convert into each other:
``12 %`` is ``0.12`` is ``0.12x``.

:func:`parse` returns a :class:`Quantity` or raises :class:`UnitError`, a
``ValueError`` that says what could not be read and how to write it.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

__all__ = [
    "UNITS",
    "ALIASES",
    "Quantity",
    "UnitError",
    "compatible",
    "describe_kind",
    "factor",
    "kind_of",
    "parse",
    "to_unit",
]

# Each unit a learner may write, as (kind, factor to the kind's base unit). Bytes
# are counted the way the course counts them: kB/MB/GB are powers of 1000 (the
# ZeRO paper's GB), KiB/MiB/GiB powers of 1024.
UNITS: dict[str, tuple[str, float]] = {
    "B": ("bytes", 1),
    "kB": ("bytes", 1e3),
    "MB": ("bytes", 1e6),
    "GB": ("bytes", 1e9),
    "TB": ("bytes", 1e12),
    "KiB": ("bytes", 2.0**10),
    "MiB": ("bytes", 2.0**20),
    "GiB": ("bytes", 2.0**30),
    "TiB": ("bytes", 2.0**40),
    "s": ("time", 1),
    "ms": ("time", 1e-3),
    "us": ("time", 1e-6),
    "µs": ("time", 1e-6),
    "min": ("time", 60),
    "h": ("time", 3600),
    "fraction": ("fraction", 1),
    "%": ("fraction", 1e-2),
    "x": ("ratio", 1),
    "count": ("count", 1),
    "FLOP": ("flops", 1),
    "GFLOP": ("flops", 1e9),
    "TFLOP": ("flops", 1e12),
    "PFLOP": ("flops", 1e15),
}
# Spellings of the units of UNITS: each maps to (a key of UNITS, a multiplier).
ALIASES: dict[str, tuple[str, float]] = {
    **{w: ("B", 1) for w in ("byte", "bytes")},
    "KB": ("kB", 1),
    **{w: ("s", 1) for w in ("sec", "secs", "second", "seconds")},
    **{w: ("ms", 1) for w in ("msec", "millisecond", "milliseconds")},
    **{w: ("min", 1) for w in ("mins", "minute", "minutes")},
    **{w: ("h", 1) for w in ("hr", "hrs", "hour", "hours")},
    **{w: ("h", 24) for w in ("d", "day", "days")},
    **{w: ("h", 24 * 365) for w in ("y", "yr", "year", "years")},
    **{w: ("%", 1) for w in ("percent", "pct")},
    **{w: ("x", 1) for w in ("×", "times")},
    **{w: ("FLOP", 1) for w in ("FLOPs", "flops")},
    **{w: ("TFLOP", 1) for w in ("TFLOPs",)},
    # counts carry their noun: "4 microbatches", "14 steps"
    **{
        w: ("count", 1)
        for w in (
            "microbatch",
            "microbatches",
            "step",
            "steps",
            "message",
            "messages",
            "process",
            "processes",
            "GPU",
            "GPUs",
            "rank",
            "ranks",
        )
    },
}
_DIMENSIONLESS = ("fraction", "ratio", "count")
# "per step", "/GPU", "a parameter": what the question already says, dropped
_PER = re.compile(
    r"\s*(?:per|/|an?|each)\s*(?:step|gpu|rank|layer|microbatch|param|parameter|"
    r"device|sequence|token)s?\s*$",
    re.I,
)
_KIND_WORDS = {"bytes": "bytes", "time": "a time", "flops": "FLOPs"}
_NUMBER = re.compile(
    r"""^\s*(?P<num>[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+)
    (?:[eE](?P<exp>[+-]?\d+))?
    (?:\s*(?:[x×*·]|\\times)\s*10\s*(?:\^|\*\*)\s*\{?(?P<pow>[+-−]?\d+)\}?)?
    \s*(?P<unit>[^\d\s].*?)?\s*$""",
    re.X,
)


class UnitError(ValueError):
    """A number or a unit that could not be read, or one of the wrong kind."""


@dataclass(frozen=True)
class Quantity:
    """A number as read: ``value`` in its kind's base unit (bytes, seconds, a plain
    number, FLOP), ``kind`` (``None`` when written without a unit), and the text
    it was read from."""

    value: float
    kind: str | None
    text: str


def _unit(word: str) -> tuple[str, float]:
    """``(kind, factor to the base unit)`` of a unit as written."""
    w = word.strip().rstrip(".")
    if re.fullmatch(r"[KMGT]i?b", w):
        raise UnitError(
            f"{word!r} reads as bits; bytes are written with a capital B ({w[:-1]}B)"
        )
    for table in (UNITS, ALIASES):
        if w in table:
            break
    else:  # one case-insensitive match, or none
        found = [k for t in (UNITS, ALIASES) for k in t if k.casefold() == w.casefold()]
        if len(set(found)) != 1:
            known = ", ".join(UNITS)
            raise UnitError(f"unknown unit {word!r}: write one of {known}")
        w = found[0]
    if w in ALIASES:
        key, mult = ALIASES[w]
        kind, factor = UNITS[key]
        return kind, factor * mult
    return UNITS[w]


def kind_of(unit: str) -> str:
    """The kind of a unit (``bytes``, ``time``, ``fraction``...)."""
    return _unit(unit)[0]


def factor(unit: str) -> float:
    """What one ``unit`` is in its kind's base unit (``factor("GB") == 1e9``)."""
    return _unit(unit)[1]


def to_unit(value: float, unit: str) -> float:
    """A base-unit value expressed in ``unit`` (``to_unit(2.8e10, "GB") == 28``)."""
    return value / _unit(unit)[1]


def parse(answer) -> Quantity:
    """Read ``answer``: a number (int, float), a ``(value, unit)`` pair, or text
    with an optional unit. :class:`UnitError` names what could not be read."""
    if isinstance(answer, tuple) and len(answer) == 2:
        value, unit = answer
        q = parse(value)
        kind, factor = _unit(str(unit))
        return Quantity(q.value * factor, kind, f"{value} {unit}")
    if isinstance(answer, bool):
        raise UnitError(f"{answer!r} is not a number")
    if isinstance(answer, numbers.Real):
        value = float(answer)
        if not math.isfinite(value):
            raise UnitError(f"{answer!r} is not a finite number")
        return Quantity(value, None, repr(answer))
    if not isinstance(answer, str):
        raise UnitError(
            f"expected a number or text such as '3.5 GiB', got {type(answer).__name__}"
        )
    m = _NUMBER.match(answer)
    if m is None:
        shown = answer if len(answer) <= 40 else answer[:37] + "..."
        raise UnitError(
            f"could not read {shown!r} as a number: write one number with an "
            "optional unit (for instance '3.5 GiB', '4.2e9', '7 %', '0.3 s')"
        )
    value = float(m["num"].replace(",", "")) * 10.0 ** int(m["exp"] or 0)
    if m["pow"] is not None:
        value *= 10.0 ** int(m["pow"].replace("−", "-"))
    if not math.isfinite(value):
        raise UnitError(f"{answer!r} is not a finite number")
    if not m["unit"]:
        return Quantity(value, None, answer.strip())
    unit = _PER.sub("", m["unit"])
    if not unit:
        return Quantity(value, None, answer.strip())
    kind, factor = _unit(unit)
    return Quantity(value * factor, kind, answer.strip())


def compatible(kind: str | None, want: str) -> bool:
    """Whether a quantity of ``kind`` can answer a question in ``want``'s kind
    (no unit always can; the dimensionless kinds convert into each other)."""
    if kind is None or kind == want:
        return True
    return kind in _DIMENSIONLESS and want in _DIMENSIONLESS


def describe_kind(kind: str) -> str:
    """A kind in words: ``bytes``, ``a time``, ``a plain number``..."""
    if kind in _DIMENSIONLESS:
        return "a plain number (a fraction, ratio or count)"
    return _KIND_WORDS.get(kind, kind)

"""How the drill grades a card, the way an interviewer does (chapter 10): the
numbers right with their units, the structure of the strategy named exactly, no
misconception; the explanation is never graded by the program.

A card's graded parts are of two kinds:

- :class:`Number`: a concrete scenario whose right value a function of
  :mod:`dtlab.estimate` computes (never a literal), in a unit, within a stated
  relative tolerance. The answer is a number in any common notation, with or
  without a unit (:mod:`~dtlab.units`); without one it is read in the
  part's unit or in the base unit (bytes, seconds), whichever it is closer to.
  A unit of the wrong kind (seconds for bytes) is a clear error, not a zero.
- :class:`Choices`: a multi-select from a fixed vocabulary ("what is sharded:
  weights, gradients, ..."), right only as the exact set (order, case and spaces
  free). Some options are misconceptions the course warns about; choosing one
  costs a point and fails the card.

A :class:`CardGrade` is what :func:`grade_card` found. Its feedback teaches without
giving the answer away: per number how far off (ratio, direction, unit); per choice
set how many are missing or extra, and the correction of each misconception
chosen. It never prints the accepted options, so pasting it back earns nothing.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from dtlab import units

__all__ = ["CardGrade", "Choices", "Number", "PartGrade", "grade_card", "normal"]


@dataclass(frozen=True)
class Number:
    """A number to compute: ``prompt`` states the scenario, ``compute()`` returns
    the right value in the base unit of ``unit``'s kind (a :mod:`dtlab.estimate`
    call), and an answer within ``tolerance`` (relative) is right; ``why`` says
    where that tolerance comes from."""

    name: str
    prompt: str
    unit: str
    compute: Callable[[], float]
    tolerance: float = 0.05
    why: str = "5 %: the rounding of a careful whiteboard answer"

    @property
    def kind(self) -> str:
        return units.kind_of(self.unit)

    def value(self) -> float:
        return float(self.compute())

    def shown(self) -> str:
        """The right value in the part's unit (for the reveal)."""
        v = units.to_unit(self.value(), self.unit)
        unit = "" if self.unit == "count" else f" {self.unit}"
        return f"{v:,.4g}{unit}" if abs(v) < 1e6 else f"{v:.4g}{unit}"

    def reference(self) -> str:
        return self.shown()


@dataclass(frozen=True)
class Choices:
    """A multi-select: ``options`` (shown in this order), the ``right`` set, and
    ``misconceptions`` (an option the course warns about -> its correction)."""

    name: str
    prompt: str
    options: tuple[str, ...]
    right: frozenset[str]
    misconceptions: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        known = {normal(o) for o in self.options}
        if len(known) != len(self.options):
            raise ValueError(f"{self.name}: two options read the same")
        for label in (*self.right, *self.misconceptions):
            if normal(label) not in known:
                raise ValueError(f"{self.name}: {label!r} is not among its options")
        if set(self.right) & set(self.misconceptions):
            raise ValueError(f"{self.name}: an option is both right and wrong")

    def reference(self) -> list[str]:
        return [o for o in self.options if o in self.right]


Part = Number | Choices


def normal(label: str) -> str:
    """An option as compared: case, spaces and the math symbols' spellings free."""
    text = str(label).casefold()
    for a, b in (("−", "-"), ("–", "-"), ("×", "x"), ("·", "*"), ("ψ", "psi")):
        text = text.replace(a, b)
    return re.sub(r"\s+", " ", text).strip()


@dataclass(frozen=True)
class PartGrade:
    """One part's verdict: ``points`` (1 right, 0 wrong, minus one per
    misconception chosen), whether it is ``right``, and ``feedback`` (a line that
    never names an accepted option or the right value)."""

    name: str
    points: int
    right: bool
    feedback: str
    misconceptions: tuple[str, ...] = ()
    answered: bool = True


@dataclass(frozen=True)
class CardGrade:
    """A card's verdict: its parts' grades, ``points`` of ``possible``, passed
    only with every part right and no misconception."""

    key: str
    parts: tuple[PartGrade, ...]

    @property
    def points(self) -> int:
        return sum(p.points for p in self.parts)

    @property
    def possible(self) -> int:
        return len(self.parts)

    @property
    def misconceptions(self) -> tuple[str, ...]:
        return tuple(m for p in self.parts for m in p.misconceptions)

    @property
    def passed(self) -> bool:
        return all(p.right for p in self.parts) and not self.misconceptions

    @property
    def score(self) -> float:
        """Points over possible: 1 is every part right; below 0 with
        misconceptions."""
        return self.points / self.possible

    def feedback(self) -> str:
        mark = "✓ passed" if self.passed else "✗ not yet"
        head = f"{self.key}: {self.points}/{self.possible} points, {mark}"
        return "\n".join([head, *(f"  {p.name}: {p.feedback}" for p in self.parts)])

    __str__ = feedback


def _pick_reading(q: units.Quantity, part: Number) -> tuple[float, str]:
    """The value an answer without a unit means: the part's unit or the base
    unit, whichever is closer to right (``2.8e10`` for GB is bytes)."""
    want = part.value()
    readings = [(q.value * units.factor(part.unit), f"in {part.unit}")]
    base = {"bytes": "B", "time": "s", "flops": "FLOP"}.get(part.kind)
    readings.append((q.value, f"in {base}" if base else "as a plain fraction"))

    def distance(reading):
        ratio = reading[0] / want if want else math.inf
        return abs(math.log(ratio)) if ratio > 0 else math.inf

    return min(readings, key=distance)


def _hint(ratio: float) -> str:
    """What a ratio off by a power of 1000 or by 1024/1000 suggests."""
    k = round(math.log(ratio, 1000))
    if k and abs(ratio / 1000.0**k - 1) < 0.05:
        return f"; a factor of 1000^{k}: check the prefix (k, M, G, T)"
    for j in (1, 2, 3):
        for r in (1.024**j, 1.024**-j):
            if abs(ratio / r - 1) < 0.005:
                return (
                    "; GB against GiB? kB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024"
                )
    return ""


def grade_number(part: Number, answer) -> PartGrade:
    """One number: right within the part's tolerance, or how far off and why."""
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        return PartGrade(part.name, 0, False, "no answer yet", answered=False)
    try:
        q = units.parse(answer)
    except units.UnitError as exc:
        return PartGrade(part.name, 0, False, f"✗ {exc}")
    if not units.compatible(q.kind, part.kind):
        return PartGrade(
            part.name,
            0,
            False,
            f"✗ wrong unit: {q.text!r} is {units.describe_kind(q.kind)}, and this "
            f"asks for {units.describe_kind(part.kind)} (in {part.unit}, for "
            "instance)",
        )
    got, read = (q.value, None) if q.kind else _pick_reading(q, part)
    want = part.value()
    note = "" if read in (None, f"in {part.unit}") else f" (read {read})"
    if abs(got - want) <= part.tolerance * abs(want):
        return PartGrade(
            part.name, 1, True, f"✓ right within {part.tolerance:.0%}{note}"
        )
    if want == 0 or got == 0 or got / want < 0:
        side = "the other side of zero" if got * want < 0 else "not zero"
        return PartGrade(part.name, 0, False, f"✗ off{note}: the right value is {side}")
    ratio = got / want
    side = "too high" if ratio > 1 else "too low"
    return PartGrade(
        part.name,
        0,
        False,
        f"✗ off{note}: {ratio:.2g}× the right value, {side} (right is within "
        f"{part.tolerance:.0%}; the unit asked: {units.describe_kind(part.kind)})"
        + _hint(ratio),
    )


def _labels(answer) -> list[str]:
    if isinstance(answer, str):
        # one option per line, or separated as printed (" | ") or by ";": not by
        # commas, which some options contain
        return [s for s in re.split(r"[|;\n]", answer) if s.strip()]
    if isinstance(answer, (list, tuple, set, frozenset)):
        return [str(s) for s in answer]
    raise TypeError(
        f"a choice is a list of options (or one string, '|'-separated), got "
        f"{type(answer).__name__}"
    )


def grade_choices(part: Choices, answer) -> PartGrade:
    if answer is None:
        return PartGrade(part.name, 0, False, "no answer yet", answered=False)
    try:
        labels = _labels(answer)
    except TypeError as exc:
        return PartGrade(part.name, 0, False, f"✗ {exc}")
    by_normal = {normal(o): o for o in part.options}
    unknown = [s for s in labels if normal(s) not in by_normal]
    if unknown:
        near = difflib.get_close_matches(normal(unknown[0]), by_normal, n=1)
        hint = f" (did you mean {by_normal[near[0]]!r}?)" if near else ""
        shown = unknown[0] if len(unknown[0]) <= 40 else unknown[0][:37] + "..."
        return PartGrade(
            part.name,
            0,
            False,
            f"✗ {shown!r} is not one of this question's options{hint}: pick "
            "from the list as printed",
        )
    chosen = {by_normal[normal(s)] for s in labels}
    wrong = tuple(o for o in part.options if o in chosen and o in part.misconceptions)
    missing = len(part.right - chosen)
    extra = len(chosen - part.right) - len(wrong)
    right = chosen == part.right
    if right:
        return PartGrade(part.name, 1, True, "✓ exactly the right set")
    says = [f"{missing} missing", f"{extra} extra"]
    if wrong:
        says.append(f"{len(wrong)} misconception{'s' * (len(wrong) > 1)}")
    lines = [f"✗ {', '.join(says)}"]
    lines += [f"misconception {o!r}: {part.misconceptions[o]}" for o in wrong]
    return PartGrade(
        part.name, -len(wrong), False, "; ".join(lines), misconceptions=wrong
    )


def grade_card(key: str, parts: tuple[Part, ...], answer) -> CardGrade:
    """Grade ``answer`` (``{part name: value}``; an ``explanation`` entry is kept
    but never graded) on a card's ``parts``. An unknown part name is refused."""
    if not isinstance(answer, dict):
        raise TypeError(
            f"card {key!r}: an answer is a dict {{part name: value}}, got "
            f"{type(answer).__name__}"
        )
    names = {p.name for p in parts}
    unknown = sorted(set(answer) - names - {"explanation"})
    if unknown:
        raise ValueError(
            f"card {key!r} has no part {unknown[0]!r}: its parts are "
            f"{sorted(names)} (and a free 'explanation')"
        )
    out = []
    for part in parts:
        given = answer.get(part.name)
        if isinstance(part, Number):
            out.append(grade_number(part, given))
        else:
            out.append(grade_choices(part, given))
    return CardGrade(key, tuple(out))

"""The drill's cards (chapter 10): one :class:`Card` type for all of them, joining
the prose of ``cards.ini`` (question, sources, topic, the model answer in the
four-question frame) with the graded parts of
:mod:`~dtlab.drill.parts_strategies`, :mod:`~dtlab.drill.parts_systems` and
:mod:`~dtlab.drill.parts_frontier` (chapter 12's three cards) and
:mod:`~dtlab.drill.parts_resilience` (chapter 13's three)
(numbers computed by :mod:`dtlab.estimate`, structured choices) and the
measurement behind the answer (:mod:`~dtlab.lab.drill.measurements`).

``cards.ini`` is an INI file (Python's :mod:`configparser`): a ``[sources]``
section naming the course's sources, a ``[source questions]`` section mapping each
question they ask to its card, then one section per card.
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass
from pathlib import Path

from dtlab.drill import (
    parts_frontier,
    parts_resilience,
    parts_strategies,
    parts_systems,
)
from dtlab.drill.grading import CardGrade, Choices, Number, grade_card

__all__ = ["CARDS", "CARDS_FILE", "FRAME", "SOURCE_QUESTIONS", "TOPICS", "Card"]

CARDS_FILE = Path(__file__).with_name("cards.ini")

FRAME = (
    ("replicated", "What is replicated"),
    ("sharded", "What is sharded"),
    ("synchronized", "What is synchronized, and how often"),
    ("cost", "What dominates the cost"),
)
"""The four questions every answer answers, and how the drill titles them."""

TOPICS = (
    "data parallel",
    "ZeRO/FSDP",
    "tensor",
    "pipeline",
    "precision",
    "memory",
    "planning",
    "CP/EP",
    "systems",
)
"""The topics a mock round covers and scores."""

PARTS = {
    **parts_strategies.PARTS,
    **parts_systems.PARTS,
    **parts_frontier.PARTS,
    **parts_resilience.PARTS,
}
"""Every card's graded parts, by card key."""

_ANSWER = (*(key for key, _ in FRAME), "summary")
_FIELDS = ("question", "sources", "topic", "measure", *_ANSWER)


@dataclass(frozen=True)
class Card:
    """A practice question: its ``question``, ``sources``, ``topic``, the model
    ``answer`` (the four-question frame's keys and a ``summary``), ``measure`` (the name
    of the measurement behind it, a function of :mod:`dtlab.lab.drill.measurements`
    that the notebook layer runs) and its
    graded ``parts`` (:class:`~dtlab.drill.grading.Number` and
    :class:`~dtlab.drill.grading.Choices`)."""

    key: str
    question: str
    sources: tuple[str, ...]
    topic: str
    answer: dict
    measure: str
    parts: tuple[Number | Choices, ...]

    @property
    def numbers(self) -> tuple[Number, ...]:
        return tuple(p for p in self.parts if isinstance(p, Number))

    @property
    def choices(self) -> tuple[Choices, ...]:
        return tuple(p for p in self.parts if isinstance(p, Choices))

    @property
    def checklist(self) -> tuple[str, ...]:
        """The model answer's points, which the learner ticks against their own
        explanation after the reveal."""
        return (
            *(f"{title}: {self.answer[key]}" for key, title in FRAME),
            self.answer["summary"],
        )

    def prompt(self) -> str:
        """The card as asked: the question, then each part with its unit or its
        options. Nothing of the answer."""
        lines = [self.question]
        for p in self.parts:
            if isinstance(p, Number):
                unit = (
                    ""
                    if p.unit == "count"
                    else f", in {p.unit} or any unit of its kind"
                )
                lines.append(
                    f"  {p.name}: {p.prompt} [a number{unit}; right within "
                    f"{p.tolerance:.0%}]"
                )
            else:
                lines.append(f"  {p.name}: {p.prompt}")
                lines.append(f"      options: {' | '.join(p.options)}")
        lines.append("  explanation: your words (not graded: you compare them later)")
        return "\n".join(lines)

    def grade(self, answer: dict) -> CardGrade:
        """Grade ``answer`` (``{part name: value}``) on this card's parts."""
        return grade_card(self.key, self.parts, answer)

    def reference(self) -> dict:
        """A right answer to every part (for tests and the claims; a notebook
        never calls it)."""
        return {p.name: p.reference() for p in self.parts}


def _text(value: str) -> str:
    """A value as one line: continuation lines are joined with spaces."""
    return " ".join(line.strip() for line in value.splitlines() if line.strip())


def load_cards(
    path=CARDS_FILE, parts=None, measurements=None
) -> tuple[tuple[Card, ...], dict]:
    """``(cards, source questions)`` from a cards file; ``ValueError`` naming the
    card and the field for a card that is incomplete, names an unknown source or
    topic, a measurement not among ``measurements`` (when given: the notebook
    layer's, :data:`dtlab.lab.drill.measurements.MEASUREMENTS`), or has no graded
    parts."""
    parts = PARTS if parts is None else parts
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # keys as written: the questions are keys
    with open(path, encoding="utf-8") as f:
        parser.read_file(f)
    sources = {k: _text(v) for k, v in parser["sources"].items()}
    questions = {_text(q): v.strip() for q, v in parser["source questions"].items()}
    cards = []
    for key in parser.sections():
        if key in ("sources", "source questions"):
            continue
        section = parser[key]
        missing = [f for f in _FIELDS if f not in section]
        if missing:
            raise ValueError(f"card {key!r} in {path} has no {', '.join(missing)}")
        unknown = [s for s in section["sources"].split() if s not in sources]
        if unknown:
            raise ValueError(
                f"card {key!r} names unknown sources {unknown}: expected some of "
                f"{list(sources)}"
            )
        topic = section["topic"].strip()
        if topic not in TOPICS:
            raise ValueError(f"card {key!r}: unknown topic {topic!r}, not in {TOPICS}")
        measure = section["measure"].strip()
        if measurements is not None and measure not in measurements:
            raise ValueError(
                f"card {key!r} names no measurement of dtlab.lab.drill.measurements: "
                f"{measure!r}"
            )
        if not parts.get(key):
            raise ValueError(f"card {key!r} has no graded parts (parts_*.py)")
        cards.append(
            Card(
                key=key,
                question=_text(section["question"]),
                sources=tuple(sources[s] for s in section["sources"].split()),
                topic=topic,
                answer={f: _text(section[f]) for f in _ANSWER},
                measure=measure,
                parts=tuple(parts[key]),
            )
        )
    keys = {c.key for c in cards}
    lost = sorted(set(questions.values()) - keys)
    if lost:
        raise ValueError(f"source questions point to no card: {lost}")
    stray = sorted(set(parts) - keys)
    if stray:
        raise ValueError(f"parts_*.py grade cards that cards.ini lacks: {stray}")
    return tuple(cards), questions


CARDS, SOURCE_QUESTIONS = load_cards()
"""Every card, in the order the drill shows them; the sources' questions, verbatim,
each mapped to its card's key."""

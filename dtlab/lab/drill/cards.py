"""The drill's cards, read from ``cards.ini``: the questions, their model answers in
the four-question frame, and which measurement backs each (chapter 10).

The prose lives in the text file, the numbers in
:mod:`dtlab.lab.drill.measurements`; this module only joins them. ``cards.ini`` is
an INI file (Python's :mod:`configparser`): a ``[sources]`` section naming the
course's sources, a ``[source questions]`` section mapping each question they ask
to its card, then one section per card. A card's optional ``rubric`` names the graded
card of :data:`dtlab.exercises.ch10_cards.CARDS` whose rubric scores the answer
typed into it (the facts and numbers a strong answer contains).
"""

from __future__ import annotations

import configparser
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtlab.exercises.ch10_cards import all_cards
from dtlab.lab.drill.measurements import MEASUREMENTS

CARDS_FILE = Path(__file__).with_name("cards.ini")

FRAME = (
    ("replicated", "What is replicated"),
    ("sharded", "What is sharded"),
    ("synchronized", "What is synchronized, and how often"),
    ("cost", "What dominates the cost"),
)
"""The four questions every answer answers, and how the drill titles them."""

_ANSWER = (*(key for key, _ in FRAME), "summary")
_FIELDS = ("question", "sources", "measure", *_ANSWER)


@dataclass(frozen=True)
class Card:
    """A practice question. ``answer`` has the four-question frame's keys
    (``replicated``, ``sharded``, ``synchronized``, ``cost``) and a ``summary``;
    ``measure(ctx)`` returns the card's
    :class:`~dtlab.lab.drill.measurements.Measurement`; ``rubric`` is the key of
    the graded card (:func:`dtlab.exercises.grade`) that scores an answer to it, or
    ``None``."""

    key: str
    question: str
    sources: tuple[str, ...]
    answer: dict
    measure: Callable
    rubric: str | None = None


def _text(value: str) -> str:
    """A value as one line: continuation lines are joined with spaces."""
    return " ".join(line.strip() for line in value.splitlines() if line.strip())


def load_cards(path=CARDS_FILE) -> tuple[tuple[Card, ...], dict[str, str]]:
    """``(cards, source questions)`` from a cards file; ``ValueError`` naming the
    card and the field for a card that is incomplete or names an unknown source or
    measurement."""
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
        rubric = section.get("rubric", "").strip() or None
        if rubric is not None and rubric not in all_cards():
            raise ValueError(
                f"card {key!r} names no graded card as its rubric: {rubric!r} (one "
                f"of {sorted(all_cards())})"
            )
        measure = section["measure"].strip()
        if measure not in MEASUREMENTS:
            raise ValueError(
                f"card {key!r} names no measurement of dtlab.lab.drill.measurements: "
                f"{measure!r}"
            )
        cards.append(
            Card(
                key=key,
                question=_text(section["question"]),
                sources=tuple(sources[s] for s in section["sources"].split()),
                answer={f: _text(section[f]) for f in _ANSWER},
                measure=MEASUREMENTS[measure],
                rubric=rubric,
            )
        )
    keys = {c.key for c in cards}
    lost = sorted(set(questions.values()) - keys)
    if lost:
        raise ValueError(f"source questions point to no card: {lost}")
    return tuple(cards), questions


CARDS, SOURCE_QUESTIONS = load_cards()
"""Every card, in the order the drill shows them; the sources' questions, verbatim,
each mapped to its card's key."""

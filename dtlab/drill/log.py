"""The drill's mistake log and its spaced repetition (chapter 10).

Every graded attempt is kept on disk, ``$DTLAB_HOME/drill.json`` (``~/.dtlab`` by
default, beside the predictions' log of :mod:`dtlab.lab.predictions`): the card,
when, the points of each part, passed or not, late or not, and later the
learner's self-assessment of their explanation.

Spaced repetition is Leitner's five boxes. A card answered right moves up one box
(a new card counts as in box 1) and comes back after its box's interval
(:data:`INTERVALS`: 1, 3, 7, 21 days); a card missed (or answered after a mock
round's time ran out) drops to box 1 and is due at once, so the next round brings
it back first. :meth:`DrillLog.due`
lists the cards due at ``now`` (missed first, then the longest overdue); a card
never attempted is *new*, not due. The clock is a parameter, so tests pass a
fake one.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Callable

from dtlab.drill.grading import CardGrade

__all__ = ["DAY", "INTERVALS", "DrillLog", "log_path"]

DAY = 86400.0
INTERVALS = {1: 0.0, 2: 1 * DAY, 3: 3 * DAY, 4: 7 * DAY, 5: 21 * DAY}
"""Seconds until a card in each Leitner box is due again (box 1: at once)."""


def log_path() -> pathlib.Path:
    """``$DTLAB_HOME/drill.json`` (``~/.dtlab/drill.json`` by default)."""
    home = os.environ.get("DTLAB_HOME") or pathlib.Path.home() / ".dtlab"
    return pathlib.Path(home) / "drill.json"


class DrillLog:
    """The attempts and each card's Leitner box, kept in a JSON file (``path``,
    default :func:`log_path`); ``clock()`` gives the time in seconds."""

    def __init__(self, path=None, clock: Callable[[], float] = time.time):
        self.path = pathlib.Path(path) if path is not None else log_path()
        self.clock = clock
        self.data = self._load()

    def _load(self) -> dict:
        empty = {"attempts": [], "boxes": {}}
        if not self.path.exists():
            return empty
        try:
            data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return empty  # a damaged log starts afresh rather than stopping the drill
        if not isinstance(data, dict):
            return empty
        return {**empty, **data}

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)  # atomic: a killed kernel leaves the old log

    @property
    def attempts(self) -> list[dict]:
        return self.data["attempts"]

    def record(
        self, grade: CardGrade, *, late: bool = False, explanation: str = ""
    ) -> dict:
        """Keep one graded attempt and move its card's box; returns the entry."""
        now = self.clock()
        entry = {
            "card": grade.key,
            "time": now,
            "parts": {p.name: p.points for p in grade.parts},
            "points": grade.points,
            "possible": grade.possible,
            "passed": grade.passed,
            "misconceptions": list(grade.misconceptions),
            "late": late,
            "explanation": explanation,
            "self_assessment": None,
        }
        self.attempts.append(entry)
        box = self.box(grade.key) or 1  # a new card counts as in box 1
        box = min(box + 1, max(INTERVALS)) if grade.passed and not late else 1
        self.data["boxes"][grade.key] = {"box": box, "due": now + INTERVALS[box]}
        self._save()
        return entry

    def assess(self, card: str, ticked, of: int) -> dict:
        """Record the learner's ticks on the model answer's checklist (indices of
        the points their explanation contained) with the card's last attempt."""
        last = self.last(card)
        if last is None:
            raise ValueError(
                f"card {card!r} has no graded attempt to assess: answer it"
            )
        ticked = sorted({int(i) for i in ticked})
        if any(not 0 <= i < of for i in ticked):
            raise ValueError(f"checklist points are numbered 0-{of - 1}: got {ticked}")
        last["self_assessment"] = {"ticked": ticked, "of": of}
        self._save()
        return last

    def last(self, card: str) -> dict | None:
        for entry in reversed(self.attempts):
            if entry["card"] == card:
                return entry
        return None

    def box(self, card: str) -> int | None:
        """The card's Leitner box (1-5), or None if never attempted."""
        got = self.data["boxes"].get(card)
        return None if got is None else got["box"]

    def due(self, now: float | None = None) -> list[str]:
        """Cards attempted before whose review is due at ``now`` (default: the
        clock): box 1 (missed) first, then by how long overdue."""
        now = self.clock() if now is None else now
        boxes = self.data["boxes"]
        due = [k for k, b in boxes.items() if b["due"] <= now]
        return sorted(due, key=lambda k: (boxes[k]["box"], boxes[k]["due"], k))

    def seen(self) -> set[str]:
        return set(self.data["boxes"])

    def summary(self) -> str:
        """One line per card tried: its box, attempts, passes."""
        rows = []
        for card, b in sorted(self.data["boxes"].items()):
            tries = [a for a in self.attempts if a["card"] == card]
            passes = sum(a["passed"] for a in tries)
            rows.append(f"{card:<26} box {b['box']}  {passes}/{len(tries)} passed")
        return "\n".join(rows) or "No attempts yet."

"""A timed mock interview (chapter 10): five cards, one time limit for the round,
a score per topic at the end.

The round picks the cards the learner most needs: those due in the mistake log
first (missed ones before the rest), then cards of topics not yet in the round,
new ones before those seen, so five cards cover as many topics as they can. The
clock starts when the round is made; an answer after the limit is still graded
(the feedback teaches) but recorded as late, scores nothing in the round and
sends its card back to box 1.

    round_ = drill.mock_round(minutes=15)   # prints the five questions
    round_.answer("zero_stages", {...})      # each answer graded as it comes
    round_.summary()                         # points per topic, and overall
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.drill.grading import CardGrade

__all__ = ["MockRound", "pick"]


def pick(cards, log, n: int = 5, now: float | None = None) -> list:
    """``n`` cards: due ones first, then one per topic not yet covered (new cards
    before seen ones, in the drill's order), then any left."""
    by_key = {c.key: c for c in cards}
    chosen = [by_key[k] for k in log.due(now) if k in by_key][:n]
    seen = log.seen()
    rest = sorted(
        (c for c in cards if c not in chosen), key=lambda c: c.key in seen
    )  # stable: new before seen, the drill's order within each
    while len(chosen) < n and rest:
        topics = {c.topic for c in chosen}
        fresh = [c for c in rest if c.topic not in topics]
        card = (fresh or rest)[0]
        chosen.append(card)
        rest.remove(card)
    return chosen


@dataclass
class Result:
    card: str
    topic: str
    grade: CardGrade
    seconds: float
    late: bool


class MockRound:
    """``cards`` answered through ``drill`` (a :class:`~dtlab.lab.drill.Drill`,
    which grades, records and unlocks the reveal) within ``seconds`` on
    ``clock``."""

    def __init__(self, drill, cards, seconds: float, clock):
        if seconds <= 0:
            raise ValueError(f"a round needs a positive time limit, got {seconds}")
        self.drill, self.cards, self.seconds, self.clock = drill, cards, seconds, clock
        self.started = clock()
        self.results: dict[str, Result] = {}

    @property
    def elapsed(self) -> float:
        return self.clock() - self.started

    def questions(self) -> str:
        head = (
            f"Mock round: {len(self.cards)} cards, {self.seconds / 60:.0f} minutes "
            "from now. Answer each with round_.answer(key, {part: value, ...})."
        )
        return "\n\n".join(
            [head, *(f"[{c.key}] ({c.topic}) {c.prompt()}" for c in self.cards)]
        )

    def answer(self, key: str, answer: dict) -> CardGrade:
        """Grade and record one card of the round; late after the time limit."""
        keys = [c.key for c in self.cards]
        if key not in keys:
            raise ValueError(f"card {key!r} is not in this round: it asks {keys}")
        if key in self.results:
            raise ValueError(f"card {key!r} is answered already in this round")
        spent = self.elapsed
        late = spent > self.seconds
        grade = self.drill.answer(key, answer, late=late)
        topic = next(c.topic for c in self.cards if c.key == key)
        self.results[key] = Result(key, topic, grade, spent, late)
        if late:
            print(
                f"⏱ {key}: answered {spent - self.seconds:.0f} s after time was up: "
                "recorded as late, no points in this round."
            )
        return grade

    def scores(self) -> dict[str, tuple[int, int]]:
        """``{topic: (points, possible)}`` over the round's cards; an unanswered or
        late card scores nothing (misconceptions still cost their points)."""
        out: dict[str, list[int]] = {}
        for card in self.cards:
            got = self.results.get(card.key)
            points = 0
            if got is not None:
                points = min(got.grade.points, 0) if got.late else got.grade.points
            row = out.setdefault(card.topic, [0, 0])
            row[0] += points
            row[1] += len(card.parts)
        return {t: (p, n) for t, (p, n) in out.items()}

    def overall(self) -> tuple[int, int]:
        rows = self.scores().values()
        return sum(p for p, _ in rows), sum(n for _, n in rows)

    def summary(self) -> str:
        lines = [f"{t:<14} {p:>3}/{n}" for t, (p, n) in self.scores().items()]
        points, possible = self.overall()
        unanswered = [c.key for c in self.cards if c.key not in self.results]
        late = [k for k, r in self.results.items() if r.late]
        lines.append(f"{'overall':<14} {points:>3}/{possible}")
        if late:
            lines.append(f"late: {', '.join(late)}")
        if unanswered:
            lines.append(f"not answered: {', '.join(unanswered)}")
        return "\n".join(lines)

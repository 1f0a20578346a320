"""The drill as widgets: per card a question, a box for your answer, and a Reveal
button that shows the model answer next to the number behind it (chapter 10). A card
with a rubric grades the typed answer first (:func:`dtlab.exercises.grade`): the
points it earned, the ones it misses, and any misconception with its correction.
"""

from __future__ import annotations

import html
import math
import traceback
from dataclasses import dataclass, field

from ipywidgets import HTML, Button, Layout, Output, Textarea, VBox

from dtlab.exercises.ch10_cards import Grade, grade
from dtlab.lab.drill.cards import CARDS, FRAME, Card
from dtlab.lab.drill.measurements import Context, Measurement


def answer_html(card: Card, m: Measurement) -> str:
    """The model answer: the summary, the four questions, the measurement."""
    items = "".join(
        f"<li><b>{title}:</b> {html.escape(card.answer[key])}</li>"
        for key, title in FRAME
    )
    pred = "" if m.predicted is None else f" (predicted: {m.predicted:,.3g})"
    return (
        f"<p>{html.escape(card.answer['summary'])}</p><ul>{items}</ul>"
        f"<p><b>Measured</b> <i>[{m.kind}]</i>: {html.escape(m.text)}{pred}</p>"
    )


def grade_html(card: Card, typed: str) -> str:
    """What the rubric found in the typed answer ("" for a card without one)."""
    if card.rubric is None:
        return ""
    if not typed.strip():
        return (
            "<p><i>Type an answer before you reveal, and the rubric grades it.</i></p>"
        )
    g = grade(card.rubric, typed)
    mark = "✓" if g.passed else "✗"
    rows = [f"<li>✓ {html.escape(e)}</li>" for e in g.earned]
    rows += [f"<li>missing: {html.escape(m)}</li>" for m in g.missing]
    rows += [f"<li>wrong: {html.escape(w)}</li>" for w in g.misconceptions]
    return (
        f"<p><b>Your answer {mark}</b> {len(g.earned)}/{len(g.earned) + len(g.missing)}"
        f" points (pass: {g.pass_mark:.0%}, no misconception)</p><ul>{''.join(rows)}"
        "</ul>"
    )


@dataclass
class CardView:
    """One card's widgets, and its measurement once revealed."""

    card: Card
    widget: VBox
    textarea: Textarea
    answer: HTML
    button: Button
    measurement: Measurement | None = field(default=None)
    grade: Grade | None = field(default=None)  # the typed answer's, at reveal


class Drill:
    """All :data:`~dtlab.lab.drill.cards.CARDS` as widgets; ``cluster`` (world 2 or
    4) serves the live measurements. :meth:`reveal` is the Reveal button in code."""

    def __init__(self, cluster=None, *, timeout: float = 120, cards=CARDS):
        self.ctx = Context(cluster, timeout)
        self.views: dict[str, CardView] = {}
        boxes = []
        for i, card in enumerate(cards, 1):
            text = Textarea(
                placeholder="Your answer, before you reveal…",
                layout=Layout(width="98%", height="70px"),
            )
            button = Button(description="Reveal", button_style="info")
            answer = HTML()
            title = HTML(f"<h4>{i}. {html.escape(card.question)}</h4>")
            view = CardView(
                card, VBox([title, text, button, answer]), text, answer, button
            )
            button.on_click(lambda _, key=card.key: self._click(key))
            self.views[card.key] = view
            boxes.append(view.widget)
        self.output = Output()  # a failed Reveal shows its traceback here
        self.widget = VBox([*boxes, self.output])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _click(self, key: str) -> None:
        self.output.clear_output()
        with self.output:
            try:
                self.reveal(key)
            except Exception:  # shown under the cards, not lost in a callback
                traceback.print_exc()

    def reveal(self, key: str) -> Measurement:
        """Measure (once) and show card ``key``'s model answer."""
        if key not in self.views:
            raise ValueError(f"no card {key!r}: expected one of {list(self.views)}")
        view = self.views[key]
        if view.measurement is None:
            view.measurement = view.card.measure(self.ctx)
            value = view.measurement.value
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"card {key!r} measured a non-number: {value!r}")
        typed = view.textarea.value
        if view.card.rubric is not None and typed.strip():
            view.grade = grade(view.card.rubric, typed)
        view.answer.value = grade_html(view.card, typed) + answer_html(
            view.card, view.measurement
        )
        view.button.description = "Revealed"
        return view.measurement

    def reveal_all(self) -> dict[str, Measurement]:
        """Every card revealed: ``{key: measurement}``."""
        return {key: self.reveal(key) for key in self.views}

    def answers(self) -> dict[str, str]:
        """What the learner typed, by card."""
        return {k: v.textarea.value for k, v in self.views.items()}

    def grade(self, key: str, answer: str | None = None) -> Grade:
        """Grade ``answer`` (default: what is typed in card ``key``) on the card's
        rubric; ``ValueError`` for a card without one."""
        card = self.views[key].card if key in self.views else None
        if card is None or card.rubric is None:
            graded = [k for k, v in self.views.items() if v.card.rubric]
            raise ValueError(f"card {key!r} has no rubric: these do: {graded}")
        typed = self.views[key].textarea.value if answer is None else answer
        return grade(card.rubric, typed)

"""The drill as a session (chapter 10): answer a card, see it graded, then reveal
its model answer, its numbers and the measurement behind it, and tick what your
explanation contained.

:class:`Drill` is both the code interface and the widgets. Its order is the
learner's: :meth:`Drill.answer` (or a card's **Grade** button) grades and records
an attempt in the mistake log; only then does :meth:`Drill.reveal` (or **Reveal**)
show the answer. Revealing a card not yet answered in this session raises an
error that says to answer first, so a Run All reveals nothing.
"""

from __future__ import annotations

import html
import math
import time
import traceback
from dataclasses import dataclass, field

from ipywidgets import (
    HTML,
    Button,
    Checkbox,
    Dropdown,
    HBox,
    Layout,
    Output,
    Text,
    Textarea,
    VBox,
)

from dtlab.drill.cards import CARDS, FRAME, Card
from dtlab.drill.grading import CardGrade, Number
from dtlab.drill.log import DrillLog
from dtlab.drill.mock import MockRound, pick
from dtlab.lab.drill.measurements import MEASUREMENTS, Context, Measurement

__all__ = ["Drill", "NotAnsweredYet"]


def _tick(label: str) -> tuple[Checkbox, HBox]:
    """A checkbox beside its label, the label wrapping (a Checkbox's own
    description is cut to one line)."""
    box = Checkbox(indent=False, layout=Layout(width="28px"))
    return box, HBox([box, HTML(html.escape(label))])


class NotAnsweredYet(RuntimeError):
    """A reveal asked for before the card was answered in this session."""


def grade_html(g: CardGrade) -> str:
    mark = "✓ passed" if g.passed else "✗ not yet"
    rows = "".join(
        f"<li><b>{html.escape(p.name)}</b>: {html.escape(p.feedback)}</li>"
        for p in g.parts
    )
    return f"<p><b>{g.points}/{g.possible} points, {mark}</b></p><ul>{rows}</ul>"


def answer_html(card: Card, m: Measurement) -> str:
    """The model answer: the right parts, the summary, the four questions, the
    measurement."""
    parts = "".join(
        f"<li><b>{html.escape(p.name)}</b>: "
        + html.escape(p.shown() if isinstance(p, Number) else " | ".join(p.reference()))
        + "</li>"
        for p in card.parts
    )
    items = "".join(
        f"<li><b>{title}:</b> {html.escape(card.answer[key])}</li>"
        for key, title in FRAME
    )
    pred = "" if m.predicted is None else f" (predicted: {m.predicted:,.3g})"
    return (
        f"<p><b>Right answers</b></p><ul>{parts}</ul>"
        f"<p>{html.escape(card.answer['summary'])}</p><ul>{items}</ul>"
        f"<p><b>Measured</b> <i>[{m.kind}]</i>: {html.escape(m.text)}{pred}</p>"
    )


@dataclass
class CardView:
    """One card's widgets."""

    card: Card
    inputs: dict
    explanation: Textarea
    feedback: HTML
    reveal_button: Button
    answer: HTML
    checklist: list
    assess_box: VBox
    widget: VBox
    measurement: Measurement | None = field(default=None)


class Drill:
    """Every card of :data:`~dtlab.drill.cards.CARDS`; ``cluster`` (world 2 or
    4) serves the live measurements; ``log`` is the mistake log (default
    ``$DTLAB_HOME/drill.json``) and ``clock`` the time in seconds (tests pass a
    fake one)."""

    def __init__(self, cluster=None, *, timeout=120, cards=CARDS, log=None, clock=None):
        self.ctx = Context(cluster, timeout)
        self.cards = {c.key: c for c in cards}
        self.clock = clock or time.time
        self.log = log if log is not None else DrillLog(clock=self.clock)
        self.graded: dict[str, CardGrade] = {}  # this session's attempts
        self.views: dict[str, CardView] = {}
        self.output = Output()  # a failed button shows its traceback here

    # ---- the code interface ----------------------------------------------------
    def card(self, key: str) -> Card:
        if key not in self.cards:
            raise ValueError(f"no card {key!r}: expected one of {list(self.cards)}")
        return self.cards[key]

    def ask(self, key: str) -> None:
        """Print card ``key`` as asked: its parts, units and options."""
        print(self.card(key).prompt())

    def answer(self, key: str, answer: dict, *, late: bool = False) -> CardGrade:
        """Grade ``answer`` (``{part: value}``, and an optional ``explanation``)
        on card ``key``, record it in the log and unlock its reveal."""
        card = self.card(key)
        grade = card.grade(answer)
        if not any(p.answered for p in grade.parts):
            raise ValueError(
                f"card {key!r}: no part answered; its parts are "
                f"{[p.name for p in card.parts]}"
            )
        self.log.record(
            grade, late=late, explanation=str(answer.get("explanation", ""))
        )
        self.graded[key] = grade
        if key in self.views:
            view = self.views[key]
            view.feedback.value = grade_html(grade)
            view.reveal_button.disabled = False
        return grade

    def reveal(self, key: str) -> Measurement:
        """Card ``key``'s right answers, model answer and measurement, once it has
        a graded attempt in this session (:class:`NotAnsweredYet` otherwise)."""
        card = self.card(key)
        if key not in self.graded:
            raise NotAnsweredYet(
                f"answer card {key!r} first (drill.answer({key!r}, {{...}}) or its "
                "Grade button): the model answer is shown only after your own is "
                "graded"
            )
        view = self.view(key)
        if view.measurement is None:
            m = MEASUREMENTS[card.measure](self.ctx)
            if not isinstance(m.value, (int, float)) or not math.isfinite(m.value):
                raise ValueError(f"card {key!r} measured a non-number: {m.value!r}")
            view.measurement = m
        view.answer.value = answer_html(card, view.measurement)
        view.assess_box.layout.display = None  # the checklist, to tick
        view.reveal_button.description = "Revealed"
        return view.measurement

    def reveal_all(self) -> dict[str, Measurement]:
        """Every card revealed (each must have been answered first)."""
        return {key: self.reveal(key) for key in self.cards}

    def assess(self, key: str, ticked) -> dict:
        """Record which points of card ``key``'s checklist your explanation held
        (indices into ``card.checklist``), with its last graded attempt."""
        if key not in self.graded:
            raise NotAnsweredYet(f"answer card {key!r} first, then assess it")
        return self.log.assess(key, ticked, len(self.card(key).checklist))

    def due(self, now: float | None = None) -> list[str]:
        """Cards the mistake log says are due (missed first)."""
        return [k for k in self.log.due(now) if k in self.cards]

    def mock_round(self, minutes: float = 15, n: int = 5, show=True) -> MockRound:
        """A timed round of ``n`` cards (due first, then covering the topics),
        ``minutes`` for the whole round; prints its questions."""
        cards = pick(list(self.cards.values()), self.log, n, self.clock())
        round_ = MockRound(self, cards, minutes * 60, self.clock)
        if show:
            print(round_.questions())
        return round_

    # ---- the widgets -----------------------------------------------------------
    def view(self, key: str) -> CardView:
        """Card ``key``'s widgets (built on first use)."""
        if key not in self.views:
            self.views[key] = self._build(self.card(key))
            if key in self.graded:
                self.views[key].feedback.value = grade_html(self.graded[key])
                self.views[key].reveal_button.disabled = False
        return self.views[key]

    def _build(self, card: Card) -> CardView:
        rows, inputs = [HTML(f"<h4>{html.escape(card.question)}</h4>")], {}
        for p in card.parts:
            rows.append(HTML(f"<b>{html.escape(p.name)}</b>: {html.escape(p.prompt)}"))
            if isinstance(p, Number):
                box = Text(placeholder=f"a number, in {p.unit} or any unit of its kind")
                inputs[p.name] = box
                rows.append(box)
            else:
                ticks = [_tick(o) for o in p.options]
                inputs[p.name] = [(o, box) for o, (box, _) in zip(p.options, ticks)]
                rows.extend(row for _, row in ticks)
        explanation = Textarea(
            placeholder="Your explanation (not graded: compare it after the reveal)",
            layout=Layout(width="98%", height="70px"),
        )
        grade_button = Button(description="Grade", button_style="primary")
        reveal_button = Button(description="Reveal", button_style="info", disabled=True)
        feedback, answer = HTML(), HTML()
        ticks = [_tick(point) for point in card.checklist]
        save = Button(description="Save my ticks", button_style="success")
        head = HTML("<b>Which of these points did your explanation make?</b>")
        assess_box = VBox(
            [head, *(row for _, row in ticks), save], layout=Layout(display="none")
        )
        key = card.key
        grade_button.on_click(lambda _: self._click(lambda: self._grade_view(key)))
        reveal_button.on_click(lambda _: self._click(lambda: self.reveal(key)))
        save.on_click(lambda _: self._click(lambda: self._save_checklist(key)))
        buttons = [grade_button, feedback, reveal_button, answer, assess_box]
        return CardView(
            card=card,
            inputs=inputs,
            explanation=explanation,
            feedback=feedback,
            reveal_button=reveal_button,
            answer=answer,
            checklist=[box for box, _ in ticks],
            assess_box=assess_box,
            widget=VBox([*rows, explanation, *buttons]),
        )

    def _grade_view(self, key: str) -> CardGrade:
        view = self.view(key)
        answer = {"explanation": view.explanation.value}
        for name, w in view.inputs.items():
            if isinstance(w, list):
                chosen = [option for option, box in w if box.value]
                answer[name] = chosen or None
            else:
                answer[name] = w.value or None
        return self.answer(key, answer)

    def _save_checklist(self, key: str) -> None:
        ticked = [i for i, b in enumerate(self.view(key).checklist) if b.value]
        self.assess(key, ticked)
        total = len(self.view(key).checklist)
        print(
            f"{key}: your explanation made {len(ticked)} of {total} points (recorded)"
        )

    def _click(self, action) -> None:
        self.output.clear_output()
        with self.output:
            try:
                action()
            except Exception:  # shown under the cards, not lost in a callback
                traceback.print_exc()

    def widget(self) -> VBox:
        """A card picker (due cards first) and the picked card."""
        due = self.due()
        order = due + [k for k in self.cards if k not in due]
        labels = [f"{'(due) ' * (k in due)}{self.cards[k].question}" for k in order]
        picker = Dropdown(options=list(zip(labels, order)), layout=Layout(width="98%"))
        holder = VBox([self.view(order[0]).widget])

        def show(change):
            holder.children = [self.view(change["new"]).widget]

        picker.observe(show, names="value")
        return VBox([picker, holder, self.output])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget())

"""The drill grades what the learner typed (chapter 10): a card with a rubric
(``rubric = <graded card>`` in cards.ini) scores the answer in its box on Reveal with
:func:`dtlab.exercises.grade`, names the missing points and the misconceptions, and
shows that above the model answer; a cards file naming an unknown rubric is refused.
The cards used here reveal without a cluster (a simulated number)."""

import pytest

from dtlab.exercises import grade
from dtlab.exercises.ch10_solutions import drill_answers
from dtlab.lab.drill import CARDS, Drill
from dtlab.lab.drill.cards import CARDS_FILE, load_cards


def test_the_graded_cards_name_real_rubrics():
    rubrics = {c.key: c.rubric for c in CARDS if c.rubric}
    assert rubrics == {
        "zero_stages": "zero_stages",
        "one_f_one_b": "one_f_one_b",
        "amp_loss_scaling": "mixed_precision",
        "long_context_moe": "long_context",
    }


def test_reveal_grades_the_typed_answer_first():
    drill = Drill()
    view = drill.views["one_f_one_b"]
    view.textarea.value = "1F1B alternates one forward and one backward."
    drill.reveal("one_f_one_b")
    assert view.grade is not None and not view.grade.passed
    assert "missing: warm-up of p − stage − 1 forwards" in view.answer.value
    assert view.answer.value.index("Your answer") < view.answer.value.index("<ul>")
    # a strong answer passes, and the drill's grade() is the exercises' grade()
    strong = drill_answers()["one_f_one_b"]
    assert drill.grade("one_f_one_b", strong).passed
    assert drill.grade("one_f_one_b", strong) == grade("one_f_one_b", strong)


def test_an_empty_box_is_invited_and_a_card_without_rubric_is_not_graded():
    drill = Drill()
    drill.reveal("pipeline_bubble")  # no rubric: the model answer only
    assert "Your answer" not in drill.views["pipeline_bubble"].answer.value
    drill.reveal("one_f_one_b")
    assert "Type an answer" in drill.views["one_f_one_b"].answer.value
    with pytest.raises(ValueError, match="has no rubric"):
        drill.grade("pipeline_bubble", "anything")


def test_an_unknown_rubric_is_refused_by_name(tmp_path):
    text = CARDS_FILE.read_text(encoding="utf-8")
    bad = tmp_path / "cards.ini"
    bad.write_text(text.replace("rubric = one_f_one_b", "rubric = 1f1b"))
    with pytest.raises(ValueError, match="'one_f_one_b' names no graded card"):
        load_cards(bad)

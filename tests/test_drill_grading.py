"""The drill grades what an interviewer grades (chapter 10): every card's numbers
against dtlab.estimate with their units, its choice sets exactly, misconceptions
penalised; right answers written differently are accepted, pasted feedback earns
nothing. No engines: the cards' graded parts are pure functions."""

import inspect
import math
import re

import pytest

from dtlab.drill.grading import grade_card, normal
from dtlab.exercises import REGISTRY, ExerciseFailed
from dtlab.exercises.ch10_drill import DRILL_CARDS
from dtlab.exercises.ch10_solutions import drill_answers
from dtlab.lab.drill import CARDS, TOPICS, Choices, Number, UnitError, parse
from dtlab.units import to_unit

NUMBERS = [pytest.param(c, p, id=f"{c.key}.{p.name}") for c in CARDS for p in c.numbers]
CHOICES = [pytest.param(c, p, id=f"{c.key}.{p.name}") for c in CARDS for p in c.choices]
MISCONCEPTIONS = [
    pytest.param(c, p, label, id=f"{c.key}.{p.name}:{label}")
    for c in CARDS
    for p in c.choices
    for label in p.misconceptions
]


def test_every_card_is_graded_and_its_reference_passes():
    assert len(CARDS) == 26  # 20, chapter 12's three and chapter 13's three
    assert {c.topic for c in CARDS} == set(TOPICS)  # every topic has a card
    for card in CARDS:
        assert card.numbers and card.choices, card.key
        grade = card.grade(card.reference())
        assert grade.passed and grade.points == grade.possible, grade.feedback()
    # the course's named misconceptions are among the choices
    offered = {m for c in CARDS for p in c.choices for m in p.misconceptions}
    for label in (
        "activations",  # DDP all-reduces activations
        "the same bytes as DDP (2Ψ)",
        "across nodes: its messages are small",  # TP across nodes is cheap
        "(N−1)·Ψ values",
        "nothing more: concatenate the rank files in order",  # chapter 13
    ):
        assert label in offered, label


@pytest.mark.parametrize("card,part", NUMBERS)
def test_a_number_is_computed_by_dtlab_estimate(card, part):
    # its scenario's value comes from a call into dtlab.estimate (or dtlab.ft, for
    # chapter 13's checkpoint intervals), not a literal
    source = inspect.getsource(part.compute)
    called = set(re.findall(r"\b(\w+)\(", source))
    helpers = "".join(
        inspect.getsource(part.compute.__globals__[h])
        for h in called
        if h in part.compute.__globals__
    )
    assert re.search(r"\b(est|ft)\.", source + helpers), source
    assert math.isfinite(part.value()) and part.value() > 0
    assert part.tolerance <= 0.10 and part.why


@pytest.mark.parametrize("card,part", NUMBERS)
def test_right_numbers_in_other_notations_are_accepted(card, part):
    v = part.value()
    forms = [v, f"{v:.6e}", (to_unit(v, part.unit), part.unit)]
    forms.append(f"{to_unit(v, part.unit):.4g} {part.unit} per step")
    if part.kind == "bytes":
        forms += [f"{v / 2**30:.5g} GiB", f"{v / 1e6:,.6g} MB", f"{v:.4g} bytes"]
        forms += [f"{v / 1e9:.4g} × 10^9 B", f"{v / 2**20:.6g}MiB"]
    elif part.kind == "time":
        forms += [f"{v * 1e3:.5g} ms", f"{v / 60:.5g} min", f"{v:.4g} seconds"]
    elif part.kind in ("fraction", "ratio"):
        forms += [f"{v * 100:.4g} %", f"{v:.4g}", f"{v * 100:.4g} percent"]
    else:
        forms += [int(round(v)), f"{v:.0f} microbatches"]
    for form in forms:
        got = grade_card(card.key, card.parts, {part.name: form}).parts
        mine = next(g for g in got if g.name == part.name)
        assert mine.right and mine.points == 1, (form, mine.feedback)


@pytest.mark.parametrize(
    "text,value",
    [
        ("28 GB", 28e9),
        ("2.8e10", 2.8e10),
        ("28e9 B", 28e9),
        ("26.1 GiB", 26.1 * 2**30),
        ("28000 MB", 28e9),
        ("28,000 MB", 28e9),
        ("2.8 × 10^10 bytes", 2.8e10),
        ("1.2 s", 1.2),
        ("1200 ms", 1.2),
        ("12 %", 0.12),
        ("12%", 0.12),
        ("0.12", 0.12),
        ("1.5x", 1.5),
        ("3 days", 3 * 86400),
        ("16 bytes/param", 16),
        (7, 7),
    ],
)
def test_units_are_read_with_their_prefixes(text, value):
    assert parse(text).value == pytest.approx(value)


@pytest.mark.parametrize(
    "text,says",
    [
        ("28 Gb", "reads as bits"),
        ("about twenty", "could not read"),
        ("1.2 parsecs", "unknown unit 'parsecs'"),
        ("", "could not read"),
    ],
)
def test_unreadable_numbers_are_refused_by_name(text, says):
    with pytest.raises(UnitError, match=re.escape(says)):
        parse(text)


def test_a_wrong_unit_or_dimension_is_a_clear_error_not_a_zero():
    card = next(c for c in CARDS if c.key == "ddp_traffic")
    g = card.grade({"bytes_n8": "1.2 s", "slow_link": "24.5 GB"})
    by = {p.name: p for p in g.parts}
    assert "wrong unit: '1.2 s' is a time, and this asks for bytes" in str(g)
    assert "wrong unit: '24.5 GB' is bytes" in by["slow_link"].feedback
    assert not by["bytes_n8"].right and by["bytes_n8"].answered


def test_how_far_off_a_number_is_said_not_the_value():
    card = next(c for c in CARDS if c.key == "ddp_traffic")
    part = card.numbers[0]
    v = part.value()
    for factor, says in ((2, "2× the right value, too high"), (0.5, "0.5×")):
        fb = card.grade({part.name: v * factor}).parts[0].feedback
        assert says in fb and part.shown() not in fb, fb
    assert "too low" in card.grade({part.name: v / 3}).parts[0].feedback
    # the tolerance is the stated one: 4 % off passes, 7 % off does not
    assert card.grade({part.name: v * 1.04}).parts[0].right
    assert not card.grade({part.name: v * 1.07}).parts[0].right


@pytest.mark.parametrize("card,part", CHOICES)
def test_right_choices_in_any_order_case_or_spacing_are_accepted(card, part):
    right = part.reference()
    assert set(part.options) - part.right, "pasting every option must not pass"
    for form in (
        list(reversed(right)),
        [f"  {o.upper()}  " for o in right],
        " | ".join(right),
        "\n".join(right),
        tuple(right),
        set(right),
    ):
        got = grade_card(card.key, card.parts, {part.name: form}).parts
        mine = next(g for g in got if g.name == part.name)
        assert mine.right and mine.points == 1, (form, mine.feedback)


@pytest.mark.parametrize("card,part,label", MISCONCEPTIONS)
def test_each_misconception_is_penalised(card, part, label):
    answer = card.reference()
    answer[part.name] = [*part.reference(), label]
    g = card.grade(answer)
    mine = next(p for p in g.parts if p.name == part.name)
    assert mine.points == -1 and not mine.right and mine.misconceptions == (label,)
    assert not g.passed and g.points == g.possible - 2
    assert part.misconceptions[label] in mine.feedback  # the correction is shown
    assert "0 missing, 0 extra, 1 misconception" in mine.feedback


@pytest.mark.parametrize("card,part", CHOICES)
def test_feedback_never_names_an_accepted_option(card, part):
    # every wrong answer a learner could give from the options' list, one by one
    for label in sorted(set(part.options) - part.right):
        fb = grade_card(card.key, card.parts, {part.name: [label]}).feedback()
        for right in part.right:
            assert not re.search(rf"(?<!\w){re.escape(normal(right))}(?!\w)",
                                 normal(fb)), (label, right, fb)  # fmt: skip


def _wrong_answer(card) -> dict:
    """Every number 3× off, every choice set one wrong option."""
    out = {}
    for p in card.parts:
        if isinstance(p, Number):
            out[p.name] = p.value() * 3
        else:
            out[p.name] = [sorted(set(p.options) - p.right)[0]]
    return out


@pytest.mark.parametrize("card", CARDS, ids=lambda c: c.key)
def test_pasted_feedback_or_question_earns_nothing(card):
    graded = [card.grade(_wrong_answer(card)), card.grade({})]
    texts = [card.question, card.prompt()]
    for g in graded:
        texts.append(g.feedback())
        texts += [p.feedback for p in g.parts]
    for text in texts:
        pasted = card.grade({p.name: text for p in card.parts})
        assert not any(p.right for p in pasted.parts), pasted.feedback()
        assert pasted.points <= 0 and not pasted.passed
        # and each part's own feedback line as that part's answer
    for g in graded:
        own = card.grade({p.name: p.feedback for p in g.parts})
        assert own.points <= 0 and not own.passed


def test_an_unknown_part_or_a_shapeless_answer_is_refused():
    card = CARDS[0]
    with pytest.raises(ValueError, match=f"card '{card.key}' has no part 'bytes'"):
        card.grade({"bytes": "1 GB"})
    with pytest.raises(TypeError, match="an answer is a dict"):
        card.grade("1.1 TB")
    g = card.grade({"explanation": "all of it", card.numbers[0].name: None})
    assert g.points == 0 and not any(p.answered for p in g.parts)


def test_a_choice_set_refuses_an_option_it_does_not_offer():
    with pytest.raises(ValueError, match="'weights' is not among its options"):
        Choices("x", "?", ("a", "b"), frozenset({"weights"}))
    card = next(c for c in CARDS if c.key == "zero_stages")
    fb = card.grade({"stage1_shards": ["optimiser states"]}).feedback()
    assert "not one of this question's options (did you mean" in fb


# ---- the exercise ------------------------------------------------------------------
def test_the_drill_exercise_accepts_right_answers_written_otherwise(monkeypatch):
    monkeypatch.delenv("DTLAB_SUBSTITUTE_SOLUTIONS", raising=False)
    check = REGISTRY["drill"].checker
    assert check(drill_answers).passed
    cards = {c.key: c for c in CARDS}

    def as_references():  # the exact values, in base units, options as printed
        return {
            k: {p.name: p.value() if isinstance(p, Number) else " | ".join(
                p.reference()) for p in cards[k].parts}
            for k in DRILL_CARDS
        }  # fmt: skip

    assert check(as_references).passed
    for m in REGISTRY["drill"].mistakes:
        with pytest.raises(ExerciseFailed, match=re.escape(m.expect)):
            check(m.solution)
    with pytest.raises(ExerciseFailed, match="returns a dict"):
        check(lambda: ["24.5 GB"])


# ---- chapter 13's cards ----------------------------------------------------------
CARD = {c.key: c for c in CARDS}


def test_the_checkpoint_interval_is_young_daly_with_its_units():
    """√(2CM) with C = 2 min and M = 264 days / 128 servers: 6,540 s, written in
    any unit of time; the waste √(2C/M) as a share. Both are dtlab.ft's."""
    from dtlab import ft

    card = CARD["checkpoint_interval"]
    m = ft.cluster_mtbf(264 * 86_400, 128)
    tau = ft.young_daly_interval(120, m)
    assert math.isclose(tau, math.sqrt(2 * 120 * m)) and 6500 < tau < 6600
    for form in ("1.82 h", "109 min", f"{tau:.0f} s", "1.8 hours", 6540):
        g = card.grade({"interval": form})
        assert next(p for p in g.parts if p.name == "interval").right, form
    waste = next(p for p in card.parts if p.name == "waste")
    assert waste.value() == pytest.approx(math.sqrt(2 * 120 / m))
    for wrong, says in (("3.6 days", "too high"), ("6540 ms", "too low")):
        fb = card.grade({"interval": wrong}).parts[0].feedback
        assert says in fb, fb
    # a job four times larger: the interval halves, it does not shrink fourfold
    g = card.grade(
        {**card.reference(), "four_times": ["the interval shrinks fourfold"]}
    )
    assert g.misconceptions == ("the interval shrinks fourfold",) and not g.passed
    assert 2 * ft.young_daly_interval(120, m / 4) == pytest.approx(tau)


def test_diloco_sends_one_hth_of_ddps_bytes():
    from dtlab import estimate as est
    from dtlab import ft

    card = CARD["diloco_traffic"]
    psi = est.MODELS["7B"].n_params
    values = {p.name: p.value() for p in card.numbers}
    assert values["ddp_over_diloco"] == pytest.approx(500)  # H-fold
    assert values["bytes_per_step"] == pytest.approx(
        est.ddp_bytes_per_step(psi, 8) / 500
    )
    assert values["bytes_per_step"] == ft.local_sgd_bytes_per_step(psi, 8, 500)
    # every step's gradients is DDP, and the inner moments never travel
    for label in ("every inner step's gradient", "the inner AdamW moments"):
        g = card.grade({**card.reference(), "meeting": [label]})
        assert label in g.misconceptions and not g.passed


def test_a_resharding_checkpoint_records_global_offsets_not_rank_order():
    from dtlab import estimate as est

    card = CARD["reshard_checkpoint"]
    assert card.numbers[0].value() == pytest.approx(12 * 7e9 / 32)
    assert (
        card.numbers[0].value() == est.zero_memory_per_device(7e9, 32, 3)["optimizer"]
    )
    concat = "nothing more: concatenate the rank files in order"
    g = card.grade({**card.reference(), "records": [concat]})
    mine = next(p for p in g.parts if p.name == "records")
    assert mine.misconceptions == (concat,) and "padded" in mine.feedback
    # the offsets alone are not the whole answer: the full shapes too
    g = card.grade(
        {
            **card.reference(),
            "records": ["the offsets of each piece in the full tensor"],
        }
    )
    assert not g.passed and "1 missing" in str(g)

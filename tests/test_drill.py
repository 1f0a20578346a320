"""The interview drill as a session (chapter 10): every source question has a card,
nothing is revealed before the card is answered, every attempt goes to the mistake
log whose Leitner boxes bring missed cards back, a mock round is timed and scored
per topic, and every card's number is measured and agrees with its formula (the
last tests use the live cluster)."""

import json
import os
import re
from pathlib import Path

import pytest

from dtlab import estimate
from dtlab.drill.cards import CARDS_FILE, load_cards
from dtlab.drill.log import DAY, INTERVALS, log_path
from dtlab.lab.drill import (
    CARDS,
    SOURCE_QUESTIONS,
    Drill,
    DrillLog,
    Measurement,
    NotAnsweredYet,
)
from dtlab.lab.drill.measurements import MEASUREMENTS

SOURCES = Path("/work/shared/sources")
BY_KEY = {c.key: c for c in CARDS}


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now=1_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def session(tmp_path):
    clock = Clock()
    return Drill(log=DrillLog(tmp_path / "drill.json", clock), clock=clock), clock


def wrong(key):
    """An answer to card ``key`` with its first number twice too large."""
    answer = BY_KEY[key].reference()
    first = BY_KEY[key].numbers[0]
    answer[first.name] = first.value() * 2
    return answer


def test_every_source_question_has_a_card():
    keys = {c.key for c in CARDS}
    assert len(keys) == len(CARDS) == 26  # 20, chapter 12's three, chapter 13's three
    assert set(SOURCE_QUESTIONS.values()) <= keys
    for card in CARDS:
        assert card.question.endswith("?")
        assert set(card.answer) == {"replicated", "sharded", "synchronized"} | {
            "cost",
            "summary",
        }
        # five different sentences, not one pasted into every slot
        assert len(set(card.answer.values())) == 5, card.key
        assert all(v.endswith(".") for v in card.answer.values()), card.key
        assert len(card.checklist) == 5


def test_a_broken_cards_file_is_refused_by_name(tmp_path):
    text = CARDS_FILE.read_text(encoding="utf-8")
    bad = tmp_path / "cards.ini"
    bad.write_text(text.replace("measure = fsdp_param_shards", "measure = fsdp"))
    with pytest.raises(ValueError, match="card 'fsdp_shards' names no measurement"):
        load_cards(bad, measurements=MEASUREMENTS)
    bad.write_text(text.replace("sources = strategies\n", "sources = blog\n", 1))
    with pytest.raises(ValueError, match="unknown sources \\['blog'\\]"):
        load_cards(bad)
    bad.write_text(text.replace("topic = tensor", "topic = tensors"))
    with pytest.raises(ValueError, match="card 'tp_in_node': unknown topic"):
        load_cards(bad)
    parts = {c.key: c.parts for c in CARDS if c.key != "offload"}
    with pytest.raises(ValueError, match="card 'offload' has no graded parts"):
        load_cards(CARDS_FILE, parts)


@pytest.mark.skipif(not SOURCES.is_dir(), reason="the syllabus texts are not here")
def test_the_sources_questions_are_all_mapped():
    # 001's "Q:" lines and 004's priority list, verbatim, against SOURCE_QUESTIONS
    text = (SOURCES / "001_476e64376f9701f1.txt").read_text()
    asked = re.findall(r"^Q: (.+)$", text, flags=re.M)
    assert len(asked) == 5
    prio = (SOURCES / "004_54ae9c96a53cfc37.txt").read_text()
    topics = re.findall(r"^\s+\d\. (?:🔥)+ (.+?)(?: — .*)?$", prio, flags=re.M)
    assert len(topics) == 7
    for q in asked + topics:
        assert q.strip() in SOURCE_QUESTIONS, q


# ---- no answer before an attempt ---------------------------------------------------
def test_a_reveal_needs_a_graded_attempt_in_this_session(session):
    drill, _ = session
    with pytest.raises(NotAnsweredYet, match="answer card 'pipeline_bubble' first"):
        drill.reveal("pipeline_bubble")
    with pytest.raises(NotAnsweredYet):
        drill.reveal_all()
    with pytest.raises(NotAnsweredYet, match="answer card 'pipeline_bubble' first"):
        drill.assess("pipeline_bubble", [0])
    with pytest.raises(ValueError, match="no part answered"):
        drill.answer("pipeline_bubble", {"explanation": "the idle time"})
    drill.answer("pipeline_bubble", wrong("pipeline_bubble"))  # wrong still unlocks
    m = drill.reveal("pipeline_bubble")  # simulated: no cluster needed
    assert m.value == pytest.approx(estimate.pipeline_bubble_fraction(4, 4))
    # a new session (a new kernel) starts locked again, whatever the log holds
    fresh = Drill(log=drill.log, clock=drill.clock)
    with pytest.raises(NotAnsweredYet):
        fresh.reveal("pipeline_bubble")
    with pytest.raises(ValueError, match="no card 'bubble'"):
        drill.answer("bubble", {})


def test_the_chapter_never_reveals_a_card_or_calls_a_reference():
    notebook = Path(__file__).resolve().parent.parent / "notebooks"
    cells = json.loads((notebook / "10_interview_drill.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for call in (".reveal(", ".reveal_all(", ".reference(", ".assess("):
        assert call not in code, call


def test_a_live_card_needs_the_cluster_once_answered(session):
    drill, _ = session
    drill.answer("zero_stages", BY_KEY["zero_stages"].reference())
    with pytest.raises(ValueError, match="live cluster"):
        drill.reveal("zero_stages")


def test_the_widgets_grade_then_reveal_then_record_the_checklist(session):
    drill, _ = session
    key = "pipeline_bubble"
    view = drill.view(key)
    assert view.reveal_button.disabled and not view.answer.value
    assert view.assess_box.layout.display == "none"  # no checklist before
    for part in BY_KEY[key].parts:
        w = view.inputs[part.name]
        if isinstance(w, list):
            for option, box in w:
                box.value = option in part.right
        else:
            w.value = f"{part.value() * 100:.3g} %"
    view.explanation.value = "More microbatches per step amortise the fill."
    drill._grade_view(key)
    assert "points, ✓ passed" in view.feedback.value
    assert not view.reveal_button.disabled
    view.reveal_button.click()
    assert "Right answers" in view.answer.value and "Measured" in view.answer.value
    assert view.reveal_button.description == "Revealed"
    assert view.assess_box.layout.display is None
    view.checklist[0].value = view.checklist[4].value = True
    drill._save_checklist(key)
    last = drill.log.last(key)
    assert last["self_assessment"] == {"ticked": [0, 4], "of": 5}
    assert last["passed"] and last["explanation"].startswith("More microbatches")


# ---- the mistake log and spaced repetition ------------------------------------------
def test_every_attempt_is_kept_on_disk(session, tmp_path):
    drill, clock = session
    assert log_path() == Path(os.environ["DTLAB_HOME"]) / "drill.json"
    drill.answer("ddp_traffic", wrong("ddp_traffic"))
    clock.now += 60
    drill.answer("ddp_traffic", BY_KEY["ddp_traffic"].reference())
    saved = json.loads((tmp_path / "drill.json").read_text())
    first, second = saved["attempts"]
    assert first["card"] == "ddp_traffic" and first["time"] == clock.now - 60
    assert first["parts"]["bytes_n8"] == 0 and first["parts"]["ring"] == 1
    assert not first["passed"] and second["passed"] and not second["late"]
    # a damaged file starts afresh rather than stopping the drill
    (tmp_path / "drill.json").write_text("{not json")
    assert DrillLog(tmp_path / "drill.json").attempts == []


def test_a_missed_card_comes_back_first_a_right_one_later(session):
    drill, clock = session
    t0 = clock.now
    assert drill.due() == []  # nothing tried yet: new cards are not due
    drill.answer("zero_stages", BY_KEY["zero_stages"].reference())  # right: box 2
    drill.answer("offload", BY_KEY["offload"].reference())
    clock.now += 2 * DAY
    drill.answer("offload", BY_KEY["offload"].reference())  # right again: box 3
    drill.answer("dp_vs_mp", wrong("dp_vs_mp"))  # missed: box 1, due at once
    log = drill.log
    assert (log.box("zero_stages"), log.box("offload"), log.box("dp_vs_mp")) == (
        2,
        3,
        1,
    )
    # the missed card first, then the one overdue since day 1; offload waits
    assert drill.due() == ["dp_vs_mp", "zero_stages"]
    assert drill.due(now=t0) == []
    assert "offload" in drill.due(now=clock.now + INTERVALS[3])
    # missing a card in box 3 sends it back to box 1
    drill.answer("offload", wrong("offload"))
    assert log.box("offload") == 1 and drill.due()[0] in ("dp_vs_mp", "offload")
    # a reloaded log keeps the boxes
    again = DrillLog(log.path, clock)
    assert again.box("offload") == 1 and again.due() == log.due()


# ---- the mock round ---------------------------------------------------------------
def test_a_fresh_mock_round_covers_five_topics(session, capsys):
    drill, _ = session
    round_ = drill.mock_round(minutes=15)
    assert len(round_.cards) == 5 and len({c.topic for c in round_.cards}) == 5
    printed = capsys.readouterr().out
    assert "Mock round: 5 cards, 15 minutes" in printed
    assert all(f"[{c.key}]" in printed for c in round_.cards)


def test_a_mock_round_is_timed_and_scored_per_topic(session):
    drill, clock = session
    drill.answer("zero_stages", wrong("zero_stages"))
    drill.answer("tp_in_node", wrong("tp_in_node"))
    round_ = drill.mock_round(minutes=10, show=False)
    keys = [c.key for c in round_.cards]
    assert keys[:2] == ["tp_in_node", "zero_stages"] or keys[:2] == [
        "zero_stages",
        "tp_in_node",
    ]  # the due ones first
    clock.now += 120
    drill_right = round_.answer("zero_stages", BY_KEY["zero_stages"].reference())
    assert drill_right.passed
    answer = BY_KEY["tp_in_node"].reference()
    answer["where"] = ["across nodes: its messages are small"]
    round_.answer("tp_in_node", answer)  # a misconception: -1 and no point
    clock.now += 600  # time is up
    late_key = keys[2]
    late = round_.answer(late_key, BY_KEY[late_key].reference())
    assert late.passed  # graded for the feedback...
    scores = round_.scores()
    zero, tp = len(BY_KEY["zero_stages"].parts), len(BY_KEY["tp_in_node"].parts)
    assert scores["ZeRO/FSDP"] == (zero, zero)
    assert scores["tensor"] == (tp - 2, tp)
    assert scores[BY_KEY[late_key].topic][0] == 0  # ...but scores nothing
    assert round_.overall() == (zero + tp - 2, sum(len(c.parts) for c in round_.cards))
    last = drill.log.last(late_key)
    assert last["late"] and drill.log.box(late_key) == 1  # it comes back
    summary = round_.summary()
    assert f"late: {late_key}" in summary and "not answered:" in summary
    assert re.search(r"overall\s+\d+/\d+", summary)
    with pytest.raises(ValueError, match="answered already"):
        round_.answer("zero_stages", {})
    with pytest.raises(ValueError, match="is not in this round"):
        round_.answer(next(k for k in BY_KEY if k not in keys), {})
    # its cards were answered in this session: their reveals are unlocked
    assert {"zero_stages", "tp_in_node", late_key} <= set(drill.graded)


# ---- the live measurements ----------------------------------------------------------
@pytest.fixture(scope="module")
def revealed(lab_cluster, tmp_path_factory):
    drill = Drill(
        lab_cluster(4), log=DrillLog(tmp_path_factory.mktemp("drill") / "d.json")
    )
    for card in CARDS:
        drill.answer(card.key, card.reference())
    return drill, drill.reveal_all()


def test_every_card_reveals_a_measurement(revealed):
    drill, results = revealed
    assert set(results) == {c.key for c in CARDS}
    for key, m in results.items():
        assert isinstance(m, Measurement)
        assert m.kind in ("live", "simulate", "local", "estimate"), key
        assert m.text and m.unit
        view = drill.views[key]
        assert "Measured" in view.answer.value and view.reveal_button.description == (
            "Revealed"
        )
        for title in ("What is replicated", "What is sharded", "What dominates"):
            assert title in view.answer.value
    # at least half of the cards are measured on the course's own runs
    kinds = [m.kind for m in results.values()]
    assert kinds.count("live") + kinds.count("simulate") >= len(kinds) // 2


def test_measurements_agree_with_the_formulas(revealed):
    _, r = revealed
    assert r["zero3_vs_fsdp"].value == pytest.approx(1.5)  # 3Ψ vs 2Ψ, measured
    assert r["fsdp_shards"].value == r["fsdp_shards"].predicted  # bytes, exact
    assert r["ddp_traffic"].value == pytest.approx(r["ddp_traffic"].predicted)
    assert r["tp_in_node"].value == pytest.approx(r["tp_in_node"].predicted)
    assert r["dp_vs_mp"].value == pytest.approx(r["dp_vs_mp"].predicted)
    assert r["pipeline_bubble"].value == pytest.approx(r["pipeline_bubble"].predicted)
    assert r["one_f_one_b"].value == r["one_f_one_b"].predicted == 4
    # ZeRO-3 holds 1/N of stage 0's model states (up to Adam's step counters)
    assert r["zero_stages"].value == pytest.approx(4.0, rel=1e-3)
    assert r["accelerate_vs_deepspeed"].value < 1e-6  # same maths, other sharding
    assert r["processes"].value == 4
    amp = r["amp_loss_scaling"]
    assert amp.value > 10 * amp.extra["lost_with_scaling"]  # scaling saves them
    assert r["dp_vs_ddp"].value > 1  # the primary holds more than the others
    assert 6 < r["long_context_moe"].value <= 8  # cp = 8 divides activations by ~8
    assert r["why_distribute"].value > 80  # GB of model states for 70B: > one GPU
    assert r["checkpointing"].value > 10  # full checkpointing keeps far less
    # chapter 12: a jump saturates under delayed scaling only; the simulated V's
    # bubble is the formula's; owner-compute Muon divides the work by N = 8
    assert r["fp8_scaling"].value > 0.5
    assert r["fp8_scaling"].extra["current"] == 0
    assert r["zero_bubble_v"].value == pytest.approx(r["zero_bubble_v"].predicted)
    assert r["muon_sharding"].value == pytest.approx(1 / 8)
    # chapter 13: the simulated best interval is Young-Daly's within 5 %; DiLoCo
    # sends one H-th of DDP's bytes; the 32 new ranks read the tensor exactly once
    ci = r["checkpoint_interval"]
    assert ci.value == pytest.approx(ci.extra["young_daly_h"], rel=0.05)
    assert r["diloco_traffic"].value == pytest.approx(500)
    plan = r["reshard_checkpoint"]
    assert plan.value == plan.predicted == 1 / 32
    assert plan.extra["total_read"] == plan.extra["numel"]

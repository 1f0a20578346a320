"""The interview drill (chapter 10): every question of the course's sources has a
card, every card reveals a model answer in the four-question frame, and every
card's number is measured — and agrees with what the formulas predict."""

import re
from pathlib import Path

import pytest

from dtlab import estimate
from dtlab.lab.drill import CARDS, SOURCE_QUESTIONS, Drill, Measurement
from dtlab.lab.drill.cards import CARDS_FILE, load_cards

SOURCES = Path("/work/shared/sources")


def test_every_source_question_has_a_card():
    keys = {c.key for c in CARDS}
    assert len(keys) == len(CARDS)  # one card per key
    assert set(SOURCE_QUESTIONS.values()) <= keys
    # the themes the chapter promises (the brief's list), each a card
    for key in (
        "dp_vs_mp",
        "fsdp_shards",
        "tp_in_node",
        "pipeline_bubble",
        "zero3_vs_fsdp",
        "zero_stages",
        "dp_vs_ddp",
        "one_f_one_b",
        "amp_loss_scaling",
        "three_d",
        "accelerate_vs_deepspeed",
        "offload",
        "comm_dominates",
        "training_vs_serving",
    ):
        assert key in keys
    for card in CARDS:
        assert card.question.endswith("?")
        assert set(card.answer) == {
            "replicated",
            "sharded",
            "synchronized",
            "cost",
            "summary",
        }
        # five different sentences, not one pasted into every slot
        assert len(set(card.answer.values())) == 5, card.key
        assert all(v.endswith(".") for v in card.answer.values()), card.key


def test_a_broken_cards_file_is_refused_by_name(tmp_path):
    text = CARDS_FILE.read_text(encoding="utf-8")
    bad = tmp_path / "cards.ini"
    bad.write_text(text.replace("measure = fsdp_param_shards", "measure = fsdp"))
    with pytest.raises(ValueError, match="card 'fsdp_shards' names no measurement"):
        load_cards(bad)
    bad.write_text(text.replace("sources = strategies\n", "sources = blog\n", 1))
    with pytest.raises(ValueError, match="unknown sources \\['blog'\\]"):
        load_cards(bad)


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


@pytest.fixture(scope="module")
def revealed(lab_cluster):
    drill = Drill(lab_cluster(4))
    return drill, drill.reveal_all()


def test_every_card_reveals_a_measurement(revealed):
    drill, results = revealed
    assert set(results) == {c.key for c in CARDS}
    for key, m in results.items():
        assert isinstance(m, Measurement)
        assert m.kind in ("live", "simulate", "local", "estimate"), key
        assert m.text and m.unit
        view = drill.views[key]
        assert "Measured" in view.answer.value and view.button.description == "Revealed"
        for title in ("What is replicated", "What is sharded", "What dominates"):
            assert title in view.answer.value
    # at least half of the cards are measured on the course's own runs
    kinds = [m.kind for m in results.values()]
    assert kinds.count("live") + kinds.count("simulate") >= len(kinds) // 2


def test_measurements_agree_with_the_formulas(revealed):
    _, r = revealed
    assert r["zero3_vs_fsdp"].value == pytest.approx(1.5)  # 3Ψ vs 2Ψ, measured
    assert r["fsdp_shards"].value == r["fsdp_shards"].predicted  # bytes, exact
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
    assert r["long_context_moe"].value == pytest.approx(8.0)
    assert r["why_distribute"].value > 80  # GB of model states for 70B: > one GPU


def test_reveal_rejects_unknown_cards_and_needs_a_cluster_for_live_ones():
    drill = Drill()
    with pytest.raises(ValueError, match="no card"):
        drill.reveal("dp-vs-ddp")
    with pytest.raises(ValueError, match="live cluster"):
        drill.reveal("zero_stages")
    # simulated and analytic cards need no cluster
    assert drill.reveal("pipeline_bubble").value == pytest.approx(
        estimate.pipeline_bubble_fraction(4, 4)
    )

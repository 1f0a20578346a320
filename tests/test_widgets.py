"""The control panel of chapter 07: the layout picker offers exactly the layouts
that fit, a bad choice says why, Run trains the config the widgets show (driven by
``button.click()``, as a person would), and Stop ends every rank at the same step
without breaking the next run."""

import time

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from dtlab.lab import RankError  # noqa: E402
from dtlab.lab.figures.dashboard import Dashboard  # noqa: E402
from dtlab.lab.kernel.training import start_run  # noqa: E402
from dtlab.lab.widgets import ControlPanel, factorisations, layout_choices  # noqa: E402
from dtlab.model import GPTConfig  # noqa: E402
from dtlab.topology import Layout  # noqa: E402
from dtlab.train import TrainConfig  # noqa: E402

# 2 layers and 4 heads: tp must divide 4 and pp must divide 2
MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, n_heads=4, d_model=32)
BASE = TrainConfig(model=MODEL, steps=4, global_batch_size=8)


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached in time")
        time.sleep(0.02)


def test_factorisations_are_every_ordered_triple():
    triples = {(lay.dp, lay.tp, lay.pp) for lay in factorisations(8)}
    assert triples == {
        (dp, tp, pp)
        for dp in range(1, 9)
        for tp in range(1, 9)
        for pp in range(1, 9)
        if dp * tp * pp == 8
    }
    assert len(triples) == 10
    with pytest.raises(ValueError, match="world_size"):
        factorisations(0)


def test_layout_picker_offers_exactly_the_valid_factorisations():
    panel = ControlPanel(base=BASE, world_sizes=(4, 8))
    panel.world.value = 8
    # by hand: tp in {1, 2, 4} (divides 4 heads), pp in {1, 2} (divides 2 layers)
    want = {(8 // (tp * pp), tp, pp) for tp in (1, 2, 4) for pp in (1, 2)}
    offered = panel.valid_layouts
    assert {(lay.dp, lay.tp, lay.pp) for lay in offered} == want
    assert len(offered) == len(want)  # each once
    assert [label for label, _ in panel.layout.options] == [str(x) for x in offered]
    # the others are listed with Layout.validate's own reason
    _, invalid = layout_choices(8, MODEL)
    assert set(invalid) == set(factorisations(8)) - set(offered)
    assert "tp=8 does not divide n_heads=4" in invalid[Layout(dp=1, tp=8, pp=1)]
    assert "pp=4 does not divide n_layers=2" in invalid[Layout(dp=2, tp=1, pp=4)]
    for layout, reason in invalid.items():
        assert str(layout) in panel.invalid.value
        assert reason in panel.invalid.value
    # a new world size gives a new list, and keeps none of the old layouts
    panel.world.value = 4
    assert {(lay.dp, lay.tp, lay.pp) for lay in panel.valid_layouts} == {
        (4, 1, 1),
        (2, 2, 1),
        (1, 4, 1),
        (2, 1, 2),
        (1, 2, 2),
    }
    assert panel.layout.value in panel.valid_layouts
    assert "pp=4 does not divide" in panel.invalid.value


def test_a_config_that_cannot_run_disables_run_and_says_why():
    panel = ControlPanel(base=BASE.replace(global_batch_size=6), world_sizes=(4,))
    panel.layout.value = Layout(dp=4)
    assert panel.run_button.disabled
    assert "does not split" in panel.check_message.value  # TrainConfig.check's words
    # a click anyway (a cell can click a disabled button): the error is shown
    panel.run_button.click()
    assert panel.live is None
    assert len(panel.errors) == 1 and isinstance(panel.errors[0], ValueError)
    text = "".join(o.get("text", "") for o in panel.output.outputs)
    assert "ValueError" in text and "does not split" in text
    panel.world.value = 4
    panel.base = BASE
    panel.refresh()
    assert not panel.run_button.disabled and "✓" in panel.check_message.value


def test_pipeline_settings_go_into_the_config_only_with_a_pipeline():
    panel = ControlPanel(base=BASE, world_sizes=(4,))
    panel.layout.value = Layout(dp=4)
    panel.microbatches.value = 3
    assert panel.schedule.disabled and panel.microbatches.disabled
    assert panel.config().microbatches is None and panel.config().chunks == 1
    panel.layout.value = Layout(dp=2, pp=2)
    assert not panel.schedule.disabled and not panel.microbatches.disabled
    # 8 sequences over dp=2 leave 4 per rank: 3 microbatches do not split them
    assert panel.run_button.disabled and "microbatches=3" in panel.check_message.value
    panel.microbatches.value = 2
    panel.schedule.value = "gpipe"
    panel.precision.value = "bf16"
    assert not panel.run_button.disabled
    assert panel.check() == BASE.replace(
        layout=Layout(dp=2, pp=2), microbatches=2, schedule="gpipe", precision="bf16"
    )


@pytest.mark.cluster
def test_run_button_trains_the_config_the_widgets_show(lab_cluster):
    cluster = lab_cluster(4)
    panel = ControlPanel(
        cluster, base=BASE, dashboard=Dashboard(min_interval=0.05), pace=0.05
    )
    panel.layout.value = Layout(dp=2, pp=2)
    panel.strategy.value = "zero1"
    panel.microbatches.value = 2
    panel.steps.value = 5
    config = BASE.replace(
        layout=Layout(dp=2, pp=2), strategy="zero1", microbatches=2, steps=5
    )
    assert panel.config() == config
    panel.run_button.click()
    assert panel.stop_button.disabled is False  # returned at once: the run is going
    run = panel.wait(timeout=120)
    assert not panel.errors, panel.output.outputs
    assert run.config == config and [len(r) for r in run.records] == [5] * 4
    assert {r["strategy"] for recs in run.records for r in recs} == {"zero1"}
    assert [run.records[r][0]["coords"]["pp"] for r in range(4)] == [0, 0, 1, 1]
    # the same config run directly gives the same numbers, bit for bit
    direct = cluster.train(config, live=False, timeout=120)
    assert run.losses() == direct.losses()
    assert panel.progress.value == 5 and panel.progress.bar_style == "success"
    assert panel.runs[-1] is run
    assert "done" in panel.status.value and not panel.run_button.disabled
    # the dashboard's loss view holds what the ranks reported
    loss = panel.dashboard.figures["loss"]
    assert [list(t.y) for t in loss.data] == [run.losses()] * 4
    # and its timeline shows the pipeline: both stages, with their bubble
    timeline = panel.dashboard.figures["timeline"]
    names = {t.name for t in timeline.data if len(t.x)}
    assert {"F", "B", "idle"} <= names
    assert len({y for t in timeline.data for y in t.y}) == 4  # a lane per rank


@pytest.mark.cluster
def test_stop_ends_every_rank_at_the_same_step_and_the_next_run_works(lab_cluster):
    cluster = lab_cluster(4)
    panel = ControlPanel(cluster, base=BASE.replace(steps=500), pace=0.05)
    panel.layout.value = Layout(dp=4)
    panel.run_button.click()
    _wait_for(lambda: panel.live.step >= 1)
    panel.stop_button.click()
    stopped = panel.wait(timeout=60)
    live = panel.live
    lengths = [len(r) for r in stopped.records]
    assert len(set(lengths)) == 1 and 2 <= lengths[0] < 500  # same step everywhere
    assert live.stopped_at == lengths[0] - 1 and not live.interrupted
    assert "stopped after step" in panel.status.value
    assert panel.progress.bar_style == "warning" and not panel.errors
    # the agreement is one MAX all-reduce per step over the whole world
    control = [e for e in stopped.events if e.get("tag") == "control"]
    assert len(control) == 4 * lengths[0] and {e["axis"] for e in control} == {"world"}
    # the next run works and, from the same seeds, repeats the stopped run's steps
    panel.steps.value = 3
    panel.run_button.click()
    again = panel.wait(timeout=60)
    # (the stopped run may hold only 2 steps: Stop can land right after step 1)
    shared = min(3, len(stopped.losses()))
    assert len(again.losses()) == 3
    assert again.losses()[:shared] == stopped.losses()[:shared]
    assert [h["broken"] for h in cluster.health()] == [None] * 4


@pytest.mark.cluster
def test_stop_falls_back_to_an_interrupt_when_ranks_do_not_reach_a_step_boundary(
    lab_cluster,
):
    cluster = lab_cluster(4)
    # each step ends with a 30 s pause: no rank reaches the boundary within 0.5 s
    live = start_run(cluster, BASE.replace(steps=3), pace=30.0)
    _wait_for(lambda: live.step >= 0)
    t0 = time.monotonic()
    message = live.stop(timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert live.interrupted and "interrupted" in message
    assert isinstance(live.error, RankError)
    assert live.wait(1) is None  # no result, and the interrupt is not raised again
    # the cluster resets its process group by itself for the next run
    run = start_run(cluster, BASE.replace(steps=2)).wait(60)
    assert [len(r) for r in run.records] == [2] * 4


# ---- beyond 3D (chapter 11) -------------------------------------------------------
def test_beyond_3d_panel_offers_exactly_the_cp_and_ep_layouts_that_run():
    panel = ControlPanel(beyond_3d=True, world_sizes=(4,))
    offered = set(panel.valid_layouts)
    config = panel.config()
    # by hand: the layouts of 4 ranks whose whole config TrainConfig.check accepts
    runs = set()
    for layout in factorisations(4, beyond_3d=True):
        try:
            config.replace(layout=layout).check(4)
        except ValueError:
            continue
        runs.add(layout)
    assert offered == runs and len(offered) == len(panel.valid_layouts)
    assert Layout(dp=2, cp=2, ep=2) in offered and Layout(cp=4, ep=4) in offered
    # the others say why in TrainConfig.check's words
    assert "a mixture of experts with pp=2" in panel.invalid.value
    assert "and these choices" in panel.invalid.value
    # a ZeRO strategy does not compose with ep: those layouts leave the picker
    panel.layout.value = Layout(dp=2, cp=2, ep=2)
    panel.strategy.value = "zero2"
    assert {lay.ep for lay in panel.valid_layouts} == {1}
    assert panel.layout.value in panel.valid_layouts and panel.layout.value.ep == 1
    # the cp variant is a choice only with a cp axis, and goes into the config
    panel.strategy.value = "ddp"
    panel.layout.value = Layout(dp=4)
    assert panel.cp_variant.disabled
    panel.layout.value = Layout(cp=4)
    assert not panel.cp_variant.disabled
    panel.cp_variant.value = "ulysses"
    assert panel.check().cp_variant == "ulysses" and not panel.run_button.disabled
    # the 3D panel keeps to dp x tp x pp
    assert all(lay.cp == lay.ep == 1 for lay in ControlPanel().valid_layouts)


@pytest.mark.cluster
def test_beyond_3d_run_shows_the_all_to_all_the_ring_and_the_experts(lab_cluster):
    cluster = lab_cluster(4)
    panel = ControlPanel(
        cluster, beyond_3d=True, dashboard=Dashboard(min_interval=0.05)
    )
    panel.base = panel.base.replace(global_batch_size=8)
    panel.layout.value = Layout(dp=2, cp=2, ep=2)
    panel.steps.value = 2
    assert not panel.run_button.disabled, panel.check_message.value
    panel.run_button.click()
    run = panel.wait(timeout=180)
    assert not panel.errors, panel.output.outputs
    assert [len(r) for r in run.records] == [2] * 4
    board = panel.dashboard
    m = board.matrix
    layout = Layout(dp=2, cp=2, ep=2)
    # ring attention: each rank sends to the other rank of its cp pair
    for r in range(4):
        (mate,) = [x for x in layout.group_of("cp", r) if x != r]
        assert m[r][mate] > 0
    # every byte of the matrix is one the ranks reported sending
    sent = sum(e["wire_bytes"] for e in run.events if e.get("kind") == "comm")
    assert sum(map(sum, m)) == pytest.approx(sent)
    # the all-to-alls' rows land on their ep group
    a2a = [e for e in run.events if e.get("op") == "all_to_all" and e["axis"] == "ep"]
    assert a2a and all(len(e["send_bytes"]) == 2 for e in a2a)
    # the experts view: every rank routed its tokens, top-2 of 4 experts
    experts = board.figures["experts"]
    assert len(experts.data) == 4 and all(len(t.y) == 4 for t in experts.data)
    assert board.moe and experts in board.widget.children

"""The live dashboard of chapter 07: who-sends-to-whom is the ring (and the
pipeline's neighbours), the views keep bounded windows and a throttle, they are
redrawn *while* the ranks train, and comparisons are built from real runs."""

import time

import pytest

pytest.importorskip("plotly")

import plotly.graph_objects as go  # noqa: E402

from dtlab import estimate  # noqa: E402
from dtlab.lab.figures.base import COMPUTE_SPANS  # noqa: E402
from dtlab.lab.figures.composed import (  # noqa: E402
    compare,
    compare_table,
    placement_figure,
)
from dtlab.lab.figures.dashboard import (  # noqa: E402
    Dashboard,
    predicted_memory,
    predicted_traffic,
    rank_memory_figure,
)
from dtlab.lab.figures.traffic import (  # noqa: E402
    peer_of,
    traffic_by_step,
    traffic_matrix,
)
from dtlab.lab.kernel.training import start_run  # noqa: E402
from dtlab.model import GPT, GPTConfig  # noqa: E402
from dtlab.topology import Layout  # noqa: E402
from dtlab.train import TrainConfig  # noqa: E402

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, n_heads=4, d_model=32)
BASE = TrainConfig(model=MODEL, steps=4, global_batch_size=8)


def _comm(rank, op, axis, wire, step=0, tag=None):
    return {
        "kind": "comm",
        "rank": rank,
        "op": op,
        "axis": axis,
        "wire_bytes": wire,
        "step": step,
        "tag": tag,
    }


def test_peers_follow_the_ring_of_each_group_and_the_pipeline():
    layout = Layout(dp=2, tp=2, pp=2)  # ranks: tp fastest, then dp, then pp
    # rank 5 = pp1 dp0 tp1: tp group [4, 5], dp group [5, 7], pp group [1, 5]
    assert peer_of(_comm(5, "all_reduce", "tp", 1), layout) == 4  # wraps
    assert peer_of(_comm(5, "reduce_scatter", "dp", 1), layout) == 7
    assert peer_of(_comm(1, "send", "pp", 1, tag="act"), layout) == 5
    assert peer_of(_comm(5, "send", "pp", 1, tag="grad"), layout) == 1
    assert peer_of(_comm(5, "all_reduce", "world", 1), layout) == 6
    assert peer_of({**_comm(2, "send", "pp", 1), "peer": 0}, layout) == 0
    assert peer_of(_comm(5, "recv", "pp", 0), layout) is None
    assert peer_of(_comm(5, "barrier", "world", 0), layout) is None
    events = [_comm(r, "all_reduce", "dp", 10.0) for r in range(8)]
    m = traffic_matrix(events, layout)
    # every rank sent its 10 bytes to its dp partner, nobody else
    assert [[c for c, v in enumerate(row) if v] for row in m] == [
        [layout.group_of("dp", r)[1 - layout.coords(r)["dp"]]] for r in range(8)
    ]
    assert sum(map(sum, m)) == 80.0


def test_an_all_to_all_sends_its_row_to_its_group_and_cp_has_its_own_ring():
    layout = Layout(dp=2, cp=2, ep=4)  # ranks: cp fastest, then dp; one ep group
    # Ulysses on cp: rank 2's cp group is [2, 3]; an ep dispatch spans all four
    ulysses = {**_comm(2, "all_to_all", "cp", 30.0), "send_bytes": [30.0, 30.0]}
    dispatch = {**_comm(1, "all_to_all", "ep", 60.0), "send_bytes": [10, 5, 20, 30]}
    m = traffic_matrix([ulysses, dispatch], layout)
    assert m[2] == [0, 0, 0, 30.0]  # what it keeps for itself is not sent
    assert m[1] == [10, 0, 20, 30]
    assert sum(map(sum, m)) == 90.0  # the events' wire bytes, all of them
    # a ring collective on dp·cp (the gradients under cp) follows that group's ring
    assert peer_of(_comm(3, "all_reduce", "dp_cp", 1), layout) == 0


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_dashboard_throttles_and_keeps_bounded_windows():
    clock = _Clock()
    # trailing=False: on this fake clock, a trailing redraw (real time) would
    # come at a real-time moment the count below cannot foresee
    board = Dashboard(
        BASE,
        2,
        min_interval=0.2,
        trailing=False,
        loss_window=5,
        traffic_steps=3,
        clock=clock,
    )
    assert len(board.updates) == 0  # built empty, not redrawn yet
    drawn = []
    for step in range(20):
        clock.t = step * 0.05  # four batches per throttle interval
        batch = [
            {"kind": "step", "rank": r, "step": step, "loss": 1.0 / (step + 1)}
            for r in range(2)
        ] + [_comm(r, "all_reduce", "dp", 100.0, step) for r in range(2)]
        drawn.append(board.update(batch))
    assert sum(drawn) == 5  # every fourth batch: t = 0, 0.2, 0.4, ...
    assert board.flush() and not board.flush()  # what was held back, then nothing
    loss = board.figures["loss"]
    assert [list(t.x) for t in loss.data] == [list(range(15, 20))] * 2
    traffic = board.figures["traffic"]
    assert list(traffic.data[0].x) == [17, 18, 19]
    assert list(traffic.data[0].y) == [0.1] * 3  # 200 B over 2 ranks, in kB
    assert board.received == 80
    # the rank x rank matrix keeps the whole run: 20 steps of 100 B each way
    assert board.matrix == [[0.0, 2000.0], [2000.0, 0.0]]
    # a new run starts from empty views
    board.reset(BASE, 2)
    assert list(board.figures["loss"].data) == [] and board.received == 0


def test_what_the_throttle_held_back_is_drawn_without_another_batch():
    # a rank that goes quiet after a batch (building its optimizer, say): the
    # held-back batch is drawn once min_interval has passed, not at the next one
    board = Dashboard(None, 2, min_interval=0.1)  # no predictions: quick
    first = [{"kind": "step", "rank": r, "step": 0, "loss": 1.0} for r in range(2)]
    assert board.update(first)  # nothing drawn before: drawn at once
    assert not board.update([_comm(0, "all_reduce", "dp", 100.0, 0)])  # held back
    deadline = time.monotonic() + 30  # generous: a loaded machine
    while board.updates[-1]["why"] != "trailing" and time.monotonic() < deadline:
        time.sleep(0.01)
    last = board.updates[-1]
    assert last["why"] == "trailing" and last["received"] == 3, list(board.updates)
    assert not board.flush()  # nothing left to draw


def test_memory_view_stacks_measured_next_to_predicted():
    measured = {r: {"params": 4000, "grads": 4000, "optimizer": 8000} for r in (0, 1)}
    predicted = {r: {"params": 4000, "grads": 4000, "optimizer": 8000} for r in (0, 1)}
    fig = go.Figure(rank_memory_figure(measured, predicted))  # a figure dict
    params = next(t for t in fig.data if t.name == "params")
    assert [list(c) for c in params.x] == [
        ["rank 0", "rank 0", "rank 1", "rank 1"],
        ["measured", "predicted"] * 2,
    ]
    assert list(params.y) == [4.0] * 4
    no_estimate = rank_memory_figure(measured, None)
    assert len(no_estimate["data"][0]["y"]) == 2


@pytest.mark.cluster
def test_views_are_redrawn_while_the_ranks_train(lab_cluster):
    cluster = lab_cluster(4)
    config = BASE.replace(steps=8)
    board = Dashboard(config, 4, min_interval=0.05)
    live = start_run(cluster, config, on_events=board, pace=0.15)
    run = live.wait(120)
    board.flush()
    # redraws that happened before the last rank finished its last step, showing
    # steps in progress: live, not only at the end
    during = [u for u in board.updates if u["t"] < min(live.rank_t_end)]
    steps_seen = {u["step"] for u in during if u["step"] >= 0}
    assert len(steps_seen) >= 2 and min(steps_seen) < 7, board.updates
    # redraws are throttled: never two within min_interval of each other (the
    # flush after the run draws what the throttle held back, whenever it is called)
    times = [u["t"] for u in board.updates if u["why"] == "update"]
    assert all(b - a >= 0.04 for a, b in zip(times, times[1:]))
    # what the views show at the end is what the ranks recorded
    memory = {e["rank"]: e for e in run.events if e["kind"] == "memory"}
    assert board.memory == memory
    spans = [e for e in run.events if e["kind"] == "span" and e["step"] == 7]
    timeline = board.figures["timeline"]
    assert sum(len(t.x) for t in timeline.data) == len(
        [e for e in spans if e["name"] in COMPUTE_SPANS]
    )
    traffic = traffic_by_step(run.events)
    assert board.traffic[7] == traffic[7]
    assert traffic_matrix(run.events, Layout(dp=4)) == board.matrix
    # DDP's gradient all-reduce: every rank sends 2(N-1)/N * 4 bytes * Psi per step
    psi = GPT(MODEL).n_params()
    grads = sum(
        e["wire_bytes"]
        for e in run.events
        if e["kind"] == "comm" and e["step"] == 7 and e.get("tag") == "ddp"
    )
    assert grads == pytest.approx(4 * estimate.wire_bytes("all_reduce", 4 * psi, 4))


@pytest.mark.cluster
def test_compare_is_built_from_two_real_runs(lab_cluster):
    cluster = lab_cluster(4)
    ddp = start_run(cluster, BASE).wait(120)
    zero3 = start_run(cluster, BASE.replace(strategy="zero3")).wait(120)
    rows = compare_table([ddp, zero3])
    assert [r["name"] for r in rows] == ["dp4·tp1·pp1"] * 2
    # ZeRO-3 shards the model states over 4 ranks: less memory, 1.5x the dp bytes
    assert rows[1]["memory"]["params"] < rows[0]["memory"]["params"] / 3
    assert rows[1]["bytes_per_step"]["dp"] > 1.4 * rows[0]["bytes_per_step"]["dp"]
    # the same training: losses agree up to the order of the gradient sums
    assert rows[1]["final_loss"] == pytest.approx(rows[0]["final_loss"], rel=1e-5)
    fig = compare(ddp, zero3, names=["DDP", "ZeRO-3"])
    lines = [t for t in fig.data if t.type == "scatter"]
    assert [t.name for t in lines] == ["DDP", "ZeRO-3"]
    assert list(lines[0].y) == ddp.losses() and list(lines[1].y) == zero3.losses()
    dp_bars = next(t for t in fig.data if t.name == "dp traffic")
    assert list(dp_bars.y) == [r["bytes_per_step"]["dp"] / 1e3 for r in rows]
    (table,) = [t for t in fig.data if t.type == "table"]
    assert list(table.cells.values[0]) == ["DDP", "ZeRO-3"]
    step_ms = next(t for t in fig.data if t.name == "ms/step")
    assert list(step_ms.y) == [r["step_ms"] for r in rows]


def test_predictions_are_the_estimates_for_each_stage():
    config = BASE.replace(layout=Layout(dp=2, pp=2))
    by_rank = predicted_memory(config, 4)
    for rank in range(4):
        stage = Layout(dp=2, pp=2).coords(rank)["pp"]
        assert by_rank[rank] == estimate.layout_memory(
            MODEL,
            Layout(dp=2, pp=2),
            stage=stage,
            micro_batch_size=2,
            microbatches=2,
            activations="dtlab",  # what the run's saved-tensor count measures
        )
    traffic = predicted_traffic(config, 4)
    assert set(traffic) >= {"dp", "tp", "pp"}


def test_placement_puts_tp_groups_inside_nodes_in_megatron_order():
    fig = placement_figure(Layout(dp=2, tp=2, pp=2), gpus_per_node=4)
    (heat,) = fig.data
    # node 0 holds pp stage 0 (ranks 0-3), node 1 stage 1 (ranks 4-7)
    assert [list(row) for row in heat.z] == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert heat.text[1][3] == "r7<br>pp1 dp1 tp1"
    assert "inside a node" in fig.layout.title.text
    crossing = placement_figure(Layout(dp=1, tp=8, pp=1), gpus_per_node=4)
    assert "CROSS nodes" in crossing.layout.title.text
    with pytest.raises(ValueError, match="gpus_per_node"):
        placement_figure(Layout(dp=6), gpus_per_node=4)


def test_snapshot_reads_layouts():
    from dtlab.lab.snapshot import parse_layout

    assert parse_layout("tp2·pp2") == Layout(tp=2, pp=2)
    assert parse_layout("dp2,pp2") == Layout(dp=2, pp=2)
    with pytest.raises(ValueError, match="tp2·pp2"):
        parse_layout("tp2·tp2")


@pytest.mark.cluster
def test_snapshot_draws_the_dashboard_of_a_real_run(lab_cluster):
    from dtlab.lab import snapshot

    board, run = snapshot.train_3d(lab_cluster(4), Layout(dp=4), steps=2)
    fig = board.figure()  # what the README picture is made of
    lines = [t for t in fig.data if t.type == "scatter" and t.name.startswith("rank")]
    assert [list(t.y) for t in lines] == [run.losses()] * 4
    (heat,) = [t for t in fig.data if t.type == "heatmap"]
    matrix = traffic_matrix(run.events, Layout(dp=4))
    assert [list(row) for row in heat.z] == [[v / 1e3 for v in row] for row in matrix]
    bars = {t.name for t in fig.data if t.type == "bar"}
    assert {"params", "grads", "optimizer", "F", "B", "dp · all_reduce"} <= bars

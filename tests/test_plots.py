"""Figures built from telemetry events: what they draw must be what was recorded,
and what they predict must be the formulas of dtlab.estimate."""

import statistics
import struct

import pytest
import torch

pytest.importorskip("plotly")

from dtlab import comm, estimate, telemetry  # noqa: E402
from dtlab.lab.figures.collectives import (  # noqa: E402
    collective_time_figure,
    collective_times,
    rank_tensors_figure,
    summarize_times,
    traffic_figure,
)
from dtlab.lab.figures.export import save_png  # noqa: E402
from dtlab.lab.figures.live import LiveFigure  # noqa: E402
from dtlab.lab.figures.timeline import align_clocks, timeline_figure  # noqa: E402

N = 4


# ---- what the ranks run (shipped to the engines by value) ---------------------------
def _collectives_and_ring(ring_numel, sizes, reps):
    import torch.distributed as dist

    r = dist.get_rank()
    x = torch.arange(8, dtype=torch.float32) + r
    comm.all_reduce(x)
    shard = torch.empty(2)
    comm.reduce_scatter(shard, torch.ones(2 * dist.get_world_size()))
    full = torch.empty(3 * dist.get_world_size())
    comm.all_gather(full, torch.full((3,), float(r)))
    comm.broadcast(torch.ones(5), src=0)
    ring = torch.randn(ring_numel, generator=torch.Generator().manual_seed(r))
    comm.ring_all_reduce(ring, tag="ring")
    for size in sizes:
        y = torch.ones(size // 4)
        for _ in range(reps):
            comm.barrier(tag="sweep")
            comm.all_reduce(y, tag="sweep")
    return x


def _steps_with_spans(n_steps):
    rec = telemetry.current()
    g = torch.ones(64)
    for step in range(n_steps):
        rec.step = step
        with rec.span("F", stage=0, microbatch=0):
            g = g * 1.0
        comm.all_reduce(g, tag="grads")


@pytest.fixture(scope="module")
def recorded(lab_cluster):
    cluster = lab_cluster(N)
    cluster.run(
        _collectives_and_ring, 1000 * N, [1024, 16384], 3, record=True, timeout=120
    )
    return cluster.last_events


# ---- traffic ------------------------------------------------------------------------
def _bars(fig):
    return {t.name: list(t.y) for t in fig.data if t.type == "bar"}


def _predicted(fig):
    (trace,) = [t for t in fig.data if t.name == "predicted"]
    return list(trace.y)


@pytest.mark.cluster
def test_traffic_bars_are_the_recorded_wire_bytes(recorded):
    fig = traffic_figure(recorded)
    bars = _bars(fig)
    assert set(bars) == {
        "all_reduce",
        "reduce_scatter",
        "all_gather",
        "broadcast",
        "send",
        "recv",
        "barrier",
    }
    for op, ys in bars.items():
        for rank, y in enumerate(ys):
            recorded_bytes = sum(
                e["wire_bytes"]
                for e in telemetry.comm_events(recorded, op=op)
                if e["rank"] == rank
            )
            assert y == recorded_bytes
    # the default prediction applies estimate.wire_bytes to each recorded call
    for rank, y in enumerate(_predicted(fig)):
        expected = sum(
            estimate.wire_bytes(
                e["op"], e["payload_bytes"], 2 if e["op"] in ("send", "recv") else N
            )
            for e in telemetry.comm_events(recorded)
            if e["rank"] == rank
        )
        assert y == pytest.approx(expected, rel=1e-12)


@pytest.mark.cluster
def test_ring_sends_match_two_n_minus_one_over_n(recorded):
    sends = telemetry.comm_events(recorded, op="send", tag="ring")
    S = 1000 * N * 4  # fp32 bytes of the ring tensor
    fig = traffic_figure(sends, predicted=estimate.wire_bytes("all_reduce", S, N))
    # every rank sent 2(N-1) chunks of S/N bytes, counted one send at a time
    assert _bars(fig)["send"] == [2 * (N - 1) / N * S] * N
    assert _predicted(fig) == [2 * (N - 1) / N * S] * N
    assert [t.x for t in fig.data][0] == tuple(f"rank {r}" for r in range(N))


def test_traffic_by_tag_and_bad_predictions():
    events = [
        {
            "kind": "comm",
            "rank": r,
            "op": "all_reduce",
            "axis": "dp",
            "payload_bytes": 400,
            "wire_bytes": 300.0,
            "tag": t,
            "t_start": 0,
            "t_end": 1,
        }
        for r in range(2)
        for t in ("a", "b")
    ]
    fig = traffic_figure(events, key="tag", predicted=[600, 600])
    assert _bars(fig) == {"a": [300.0, 300.0], "b": [300.0, 300.0]}
    with pytest.raises(ValueError, match="group_sizes"):
        traffic_figure(events)  # the dp group's size is unknown
    fig = traffic_figure(events, group_sizes={"dp": 4})
    assert _predicted(fig) == [2 * estimate.wire_bytes("all_reduce", 400, 4)] * 2
    with pytest.raises(ValueError, match="one number per rank"):
        traffic_figure(events, predicted=[1, 2, 3])
    with pytest.raises(ValueError, match="make_subplots"):
        traffic_figure(events, row=1, col=1)
    assert len(traffic_figure([]).data) == 0  # nothing recorded: empty axes


# ---- time against size --------------------------------------------------------------
@pytest.mark.cluster
def test_collective_times_take_the_slowest_rank_per_call(recorded):
    sizes, times = collective_times(recorded, "all_reduce", tag="sweep")
    assert sizes == [1024, 16384]
    assert [len(t) for t in times] == [3, 3]
    for size, reps in zip(sizes, times):
        per_rank = {
            r: [
                e["t_end"] - e["t_start"]
                for e in telemetry.comm_events(recorded, op="all_reduce", tag="sweep")
                if e["rank"] == r and e["payload_bytes"] == size
            ]
            for r in range(N)
        }
        assert reps == [max(per_rank[r][k] for r in range(N)) for k in range(3)]


def test_time_figure_draws_fit_and_its_two_terms():
    sizes = [1024, 16384, 262144, 4194304]
    times = [[1e-3, 1.2e-3], [1.1e-3, 1.3e-3], [2e-3, 2.2e-3], [9e-3, 9.5e-3]]
    mid = summarize_times(times)
    wire = [estimate.wire_bytes("all_reduce", s, N) for s in sizes]
    fit = estimate.fit_alpha_beta(wire, mid)
    fig = collective_time_figure(sizes, times, fit, op="all_reduce", n=N)
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == "log"
    by_name = {t.name.split(":")[0]: t for t in fig.data}
    assert list(by_name["measured"].y) == [statistics.median(t) for t in times]
    assert len(by_name["repetitions"].y) == 8
    line = by_name["α-β fit"]
    for s, t in zip(line.x, line.y):
        assert t == pytest.approx(
            fit.alpha_s + fit.beta_s_per_byte * 2 * (N - 1) / N * s, rel=1e-12
        )
    assert set(by_name["α (latency term)"].y) == {fit.alpha_s}
    # hover carries the bus bandwidth, nccl-tests' way
    assert list(by_name["measured"].customdata) == [
        pytest.approx(estimate.bus_bandwidth("all_reduce", s, N, t) / 1e9)
        for s, t in zip(sizes, mid)
    ]
    with pytest.raises(ValueError, match="sizes"):
        collective_time_figure([1, 2], [1.0])


# ---- tensors and timeline ----------------------------------------------------------
def test_rank_tensors_figure_shows_each_rank_row():
    before = [torch.arange(4.0) + r for r in range(N)]
    after = [torch.full((1,), float(r)) for r in range(N)]  # ragged is fine
    fig = rank_tensors_figure(before, after)
    left, right = fig.data
    assert [list(row) for row in left.z] == [[float(v) for v in t] for t in before]
    assert [list(row) for row in right.z] == [[float(r)] for r in range(N)]
    assert list(left.y) == [f"rank {r}" for r in range(N)]
    with pytest.raises(ValueError, match="ranks"):
        rank_tensors_figure(before, after[:2])


@pytest.mark.cluster
def test_timeline_bars_are_the_events(lab_cluster):
    cluster = lab_cluster(N)
    cluster.run(_steps_with_spans, 3, record=True, timeout=60)
    events = cluster.last_events
    fig = timeline_figure(events, align=False)
    bars = {t.name: t for t in fig.data}
    assert set(bars) == {"F", "all_reduce"}
    comm_ev = telemetry.comm_events(events)
    assert len(bars["all_reduce"].x) == len(comm_ev) == 3 * N
    assert list(bars["all_reduce"].base) == [e["t_start"] * 1e3 for e in comm_ev]
    assert "rank 0 · compute" in set(bars["F"].y)
    # after alignment every rank's k-th all-reduce ends when rank 0's does
    # (medians of offsets: exact for the middle call of three)
    aligned = align_clocks(events)
    ends = {
        r: [e["t_end"] for e in telemetry.comm_events(aligned) if e["rank"] == r]
        for r in range(N)
    }
    for r in range(1, N):
        gaps = [a - b for a, b in zip(ends[r], ends[0])]
        assert statistics.median(gaps) == pytest.approx(0.0, abs=1e-9)


def test_align_clocks_removes_a_known_offset():
    events = []
    for r, skew in enumerate([0.0, 0.5, -0.25]):
        for k in range(3):
            events.append(
                {
                    "kind": "comm",
                    "rank": r,
                    "op": "all_reduce",
                    "axis": "world",
                    "t_start": k + skew - 0.1 * r,
                    "t_end": k + 0.2 + skew,
                    "k": k,
                }
            )
        events.append(
            {
                "kind": "span",
                "rank": r,
                "name": "F",
                "t_start": 5 + skew,
                "t_end": 6 + skew,
            }
        )
    out = align_clocks(events)
    for e in out:
        if e["kind"] == "comm":
            assert e["t_end"] == pytest.approx(e["k"] + 0.2)
            assert e["t_start"] == pytest.approx(e["k"] - 0.1 * e["rank"])
        else:
            assert (e["t_start"], e["t_end"]) == pytest.approx((5, 6))
    assert events[1]["t_end"] == 1.2  # the input is not modified


# ---- live figures -------------------------------------------------------------------
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _fake_events(start, count):
    return [
        {
            "kind": "comm",
            "rank": 0,
            "op": "all_reduce",
            "axis": "world",
            "payload_bytes": 4,
            "wire_bytes": 6.0,
            "t_start": i * 1e-3,
            "t_end": i * 1e-3 + 5e-4,
            "tag": None,
        }
        for i in range(start, start + count)
    ]


def test_live_figure_throttles_and_keeps_a_bounded_window():
    clock = _Clock()
    live = LiveFigure(
        timeline_figure, window=5, min_interval=0.2, clock=clock, align=False
    )
    assert live.redraws == 0
    drawn = [live(_fake_events(i, 1)) for i in range(10)]  # all at t = 0
    assert drawn == [True] + [False] * 9  # the first draws, the rest wait
    assert live.redraws == 1
    assert live.received == 10 and len(live.events) == 5  # the newest five
    assert [e["t_start"] for e in live.events] == [i * 1e-3 for i in range(5, 10)]
    clock.t = 0.25
    assert live.update(_fake_events(10, 1)) is True
    assert live.redraws == 2
    (bar,) = live.widget.data
    assert list(bar.base) == pytest.approx([i * 1.0 for i in range(6, 11)])
    live.update(_fake_events(11, 2))  # throttled ...
    assert live.flush() is True  # ... until flushed
    assert len(live.widget.data[0].base) == 5
    assert live.flush() is False  # nothing pending
    with pytest.raises(ValueError, match="window"):
        LiveFigure(window=0)


@pytest.mark.cluster
def test_live_figure_as_on_events_of_a_run(lab_cluster):
    cluster = lab_cluster(N)
    live = LiveFigure(traffic_figure, window=10_000, min_interval=0.0)
    cluster.run(_steps_with_spans, 5, on_events=live, timeout=60)
    live.flush()
    assert live.received == len(cluster.last_events) > 0
    bars = {t.name: list(t.y) for t in live.widget.data if t.type == "bar"}
    assert bars == _bars(traffic_figure(cluster.last_events))


# ---- static export ------------------------------------------------------------------
def test_save_png_writes_a_png(tmp_path):
    fig = traffic_figure(_fake_events(0, 3))
    try:
        path = save_png(fig, tmp_path / "t.png", width=320, height=200)
    except RuntimeError as exc:  # kaleido found no Chromium (CI installs one)
        if "chrome" not in str(exc).lower():
            raise
        pytest.skip(f"no Chromium for kaleido: apt-get install -y chromium ({exc})")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (320, 200)

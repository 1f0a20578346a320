"""A static dashboard from a real run: ``python -m dtlab.lab.snapshot OUT.png``.

Makes the README picture (``docs/dashboard.png``): start a 4-engine CPU cluster,
train a small GPT under a 3D layout (``--layout tp2·pp2`` by default) and draw
chapter 07's live dashboard (:mod:`dtlab.lab.figures.dashboard`) as it stands at the
end of the run: loss, memory per rank next to ``estimate.layout_memory``, the pipeline
timeline, traffic per step by group and op next to ``estimate.layout_traffic``,
and the rank × rank traffic matrix.

``--collectives`` draws chapter 01's dashboard instead: real collectives with
telemetry on, each measurement next to its prediction. Its four panels:

1. bytes each rank sent during a ring all-reduce built from send/recv
   (:func:`dtlab.comm.ring_all_reduce`) against ``2(N-1)/N·S``;
2. all-reduce time against message size, 1 KB to 4 MB, with the α-β fit;
3. the timeline of a few data-parallel-like steps (compute spans, then an
   all-reduce of the "gradients");
4. bytes sent per op over a mix of collectives against the ring formulas.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from plotly.subplots import make_subplots

from dtlab import estimate, telemetry
from dtlab.lab.engine.collectives import (
    collective_mix,
    data_parallel_steps,
    ring_matches_all_reduce,
    sweep_all_reduce,
)
from dtlab.lab.figures.collectives import (
    collective_time_figure,
    collective_times,
    summarize_times,
    traffic_figure,
)
from dtlab.lab.figures.export import save_png
from dtlab.lab.figures.timeline import timeline_figure
from dtlab.topology import Layout

SIZES = [2**k for k in range(10, 23, 2)]  # 1 KiB .. 4 MiB payloads
RING_BYTES = 1 << 20  # the ring all-reduce's tensor: 1 MiB of fp32


def collect(cluster, *, reps: int = 5, timeout: float = 120) -> dict:
    """Run everything on ``cluster`` and return the recorded events and numbers."""
    n = cluster.world_size
    cluster.run(sweep_all_reduce, SIZES, reps, record=True, timeout=timeout)
    sweep = cluster.last_events
    ok = cluster.run(ring_matches_all_reduce, RING_BYTES, record=True, timeout=timeout)
    if not all(ok):
        raise AssertionError(f"ring all-reduce differs from dist.all_reduce: {ok}")
    ring_events = cluster.last_events
    cluster.run(data_parallel_steps, record=True, timeout=timeout)
    step_events = cluster.last_events
    cluster.run(collective_mix, record=True, timeout=timeout)
    mix_events = cluster.last_events

    sizes, times = collective_times(sweep, "all_reduce", tag="sweep")
    mid = summarize_times(times)
    wire = [estimate.wire_bytes("all_reduce", s, n) for s in sizes]
    return {
        "n": n,
        "sizes": sizes,
        "times": times,
        "fit": estimate.fit_alpha_beta(wire, mid),
        "busbw": [
            estimate.bus_bandwidth("all_reduce", s, n, t) for s, t in zip(sizes, mid)
        ],
        "ring_events": ring_events,
        "step_events": step_events,
        "mix_events": mix_events,
    }


def dashboard(data: dict):
    """The 2x2 figure from :func:`collect`'s output."""
    n = data["n"]
    ring_pred = estimate.wire_bytes("all_reduce", RING_BYTES, n)
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=[
            f"Ring all-reduce of {RING_BYTES >> 20} MiB from send/recv: "
            f"bytes sent vs 2(N-1)/N·S, N={n}",
            "All-reduce time vs message size, α-β fit",
            "Timeline of 3 steps: compute, then all-reduce of grads",
            "Bytes sent by op (broadcast, all-reduce, reduce-scatter, all-gather)",
        ],
        horizontal_spacing=0.1,
        vertical_spacing=0.14,
    )
    sends = telemetry.comm_events(data["ring_events"], op="send")
    traffic_figure(sends, predicted=ring_pred, key="op", fig=fig, row=1, col=1)
    collective_time_figure(
        data["sizes"],
        data["times"],
        data["fit"],
        op="all_reduce",
        n=n,
        name="all-reduce (median of reps)",
        fig=fig,
        row=1,
        col=2,
    )
    timeline_figure(data["step_events"], fig=fig, row=2, col=1)
    traffic_figure(data["mix_events"], key="op", fig=fig, row=2, col=2)
    fig.update_layout(
        height=900,
        width=1500,
        title=(
            f"dtlab: collectives on a live {n}-rank gloo cluster, measured vs predicted"
        ),
        legend=dict(tracegroupgap=4, font=dict(size=11)),
        margin=dict(t=90),
    )
    fig.update_annotations(font_size=13)
    return fig


# ---- the 3D dashboard (chapter 07) ------------------------------------------------
SNAPSHOT_MODEL = dict(vocab_size=64, seq_len=32, n_layers=4, n_heads=4, d_model=64)


def parse_layout(text: str) -> Layout:
    """``"tp2·pp2"`` or ``"dp2.pp2"`` or ``"dp2,tp2"`` -> ``Layout``."""
    import re

    parts = [p for p in re.split(r"[·.,x* ]+", text.strip()) if p]
    sizes = {}
    for part in parts:
        m = re.fullmatch(r"(dp|tp|pp)(\d+)", part)
        if m is None or m.group(1) in sizes:
            raise ValueError(
                f"cannot read layout {text!r}: write it like 'tp2·pp2' or 'dp2,pp2' "
                "(each of dp, tp, pp at most once)"
            )
        sizes[m.group(1)] = int(m.group(2))
    return Layout(**sizes)


def train_3d(cluster, layout: Layout, *, steps: int = 6, timeout: float = 300):
    """Train the snapshot's GPT under ``layout`` with the live dashboard attached;
    return ``(dashboard, run)``."""
    from dtlab.lab.figures.dashboard import Dashboard
    from dtlab.lab.kernel.training import start_run
    from dtlab.model import GPTConfig
    from dtlab.train import TrainConfig

    config = TrainConfig(
        model=GPTConfig(**SNAPSHOT_MODEL),
        layout=layout,
        steps=steps,
        global_batch_size=8,
        lr=1e-2,
    )
    board = Dashboard(config, cluster.world_size)
    run = start_run(cluster, config, on_events=board, timeout=timeout).wait(timeout)
    board.flush()
    return board, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtlab.lab.snapshot",
        description="Train a small GPT under a 3D layout on a 4-engine CPU cluster "
        "and write the live dashboard as a PNG (the README picture).",
    )
    parser.add_argument("out", nargs="?", default="docs/dashboard.png")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layout", default="tp2·pp2", help="e.g. tp2·pp2, dp2,pp2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="chapter 01's collectives dashboard instead of the 3D training one",
    )
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.collectives:
        return _main_collectives(args)
    try:
        layout = parse_layout(args.layout)
        layout.validate(args.world_size)
    except ValueError as exc:
        parser.error(str(exc))

    from dtlab.lab import LabCluster

    t0 = time.perf_counter()
    cluster = LabCluster(args.world_size, backend="gloo")
    try:
        cluster.start()
        board, run = train_3d(cluster, layout, steps=args.steps)
    finally:
        cluster.stop()
    print(
        f"{layout}: {args.steps} steps, loss {run.losses()[0]:.4f} -> "
        f"{run.losses()[-1]:.4f}"
    )
    fig = board.figure()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_png(fig, args.out)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


def _main_collectives(args) -> int:
    """Chapter 01's dashboard: real collectives, each next to its prediction."""
    from dtlab.lab import LabCluster

    t0 = time.perf_counter()
    cluster = LabCluster(args.world_size, backend="gloo")
    try:
        cluster.start()
        data = collect(cluster, reps=args.reps)
    finally:
        cluster.stop()
    fit = data["fit"]
    print(
        f"{args.world_size} ranks: all-reduce α = {fit.alpha_s * 1e6:,.0f} µs, "
        f"1/β = {fit.bandwidth_Bps / 1e9:.2f} GB/s; bus bandwidth at 4 MiB "
        f"{data['busbw'][-1] / 1e9:.2f} GB/s"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_png(dashboard(data), args.out)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Chapter 07's other figures: runs of different layouts side by side, and the ranks
of a 3D layout placed on nodes.

    rows = compare_table([run_a, run_b])   # dtlab.lab.kernel.training.TrainRun each
    compare(run_a, run_b).show()                 # loss, memory, bytes, step time
    placement_figure(Layout(dp=2, tp=2, pp=2), gpus_per_node=4).show()
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.events import MEMORY_CATEGORIES
from dtlab.lab.figures.base import (
    AXES,
    AXIS_COLORS,
    MEMORY_COLORS,
    PREDICTED_COLOR,
    add_trace,
)
from dtlab.lab.figures.traffic import traffic_by_step
from dtlab.lab.figures.zero import latest_memory
from dtlab.topology import Layout


def run_summary(run, name: str | None = None) -> dict:
    """One row of numbers for a finished :class:`dtlab.lab.kernel.training.TrainRun`:
    final loss, memory of the most loaded rank (bytes by category and in total),
    wire bytes one rank sends per step by axis (mean over ranks and over steps
    after the first, which also holds the start-up broadcasts), and the median step
    time (the slowest rank's, per step)."""
    n = len(run.records)  # one list of records per rank
    layout = run.config.resolve_layout(n)
    events = run.events
    memory = latest_memory(events)
    totals = {r: sum(m.get(c, 0) for c in MEMORY_CATEGORIES) for r, m in memory.items()}
    top = max(totals, key=totals.get) if totals else None
    per_step = traffic_by_step(events)
    steady = [s for s in per_step if s > 0] or list(per_step)
    by_axis = {a: 0.0 for a in AXES}
    for s in steady:
        for (axis, _op), b in per_step[s].items():
            by_axis[axis if axis in by_axis else "world"] += b
    by_axis = {a: b / max(len(steady), 1) / n for a, b in by_axis.items()}
    times = [
        max(recs[i]["time_s"] for recs in run.records)
        for i in range(min(len(r) for r in run.records))
    ]
    step_s = statistics.median(times[1:] or times) if times else float("nan")
    return {
        "name": name or str(layout),
        "layout": str(layout),
        "strategy": run.config.strategy,
        "steps": len(run.records[0]),
        "final_loss": run.losses()[-1] if run.records[0] else float("nan"),
        "memory": dict(memory.get(top, {})) if top is not None else {},
        "memory_bytes": totals.get(top, 0),
        "bytes_per_step": by_axis,
        "wire_bytes": sum(by_axis.values()),
        "step_ms": step_s * 1e3,
    }


def compare_table(runs: Sequence, names: Sequence[str] | None = None) -> list[dict]:
    """:func:`run_summary` of each run."""
    names = list(names) if names is not None else [None] * len(runs)
    if len(names) != len(runs):
        raise ValueError(f"{len(runs)} runs but {len(names)} names: give one each")
    return [run_summary(r, n) for r, n in zip(runs, names)]


def table_figure(rows: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """The rows of :func:`compare_table` as a plotly table."""
    header = [
        "run",
        "strategy",
        "final loss",
        "memory kB (max rank)",
        *(f"{a} kB/step" for a in ("dp", "tp", "pp")),
        "other kB/step",
        "ms/step",
    ]
    cells = [
        [r["name"] for r in rows],
        [r["strategy"] for r in rows],
        [f"{r['final_loss']:.4f}" for r in rows],
        [f"{r['memory_bytes'] / 1e3:,.1f}" for r in rows],
        *[
            [f"{r['bytes_per_step'][a] / 1e3:,.1f}" for r in rows]
            for a in ("dp", "tp", "pp", "world")
        ],
        [f"{r['step_ms']:.1f}" for r in rows],
    ]
    fig = go.Figure(go.Table(header=dict(values=header), cells=dict(values=cells)))
    fig.update_layout(
        height=80 + 30 * len(rows),
        margin=dict(t=40, b=10, l=10, r=10),
        title=title or "Runs side by side",
    )
    return fig


def compare(run_a, run_b, names: Sequence[str] | None = None) -> go.Figure:
    """Two runs side by side: loss per step, memory of the most loaded rank by
    category, bytes per step by axis, median step time, and the table of
    :func:`compare_table` under them."""
    runs = [run_a, run_b]
    rows = compare_table(runs, names)
    labels = [r["name"] for r in rows]
    if labels[0] == labels[1]:
        labels = [f"{labels[0]} (a)", f"{labels[1]} (b)"]
        for row, label in zip(rows, labels):
            row["name"] = label
    fig = make_subplots(
        rows=3,
        cols=2,
        specs=[[{}, {}], [{}, {}], [{"type": "table", "colspan": 2}, None]],
        row_heights=[0.38, 0.38, 0.24],
        subplot_titles=[
            "loss per step",
            "memory of the most loaded rank (kB)",
            "kB one rank sends per step, by axis",
            "step time (ms, median)",
        ],
        vertical_spacing=0.1,
    )
    for run, label in zip(runs, labels):
        fig.add_scatter(
            x=list(range(len(run.losses()))),
            y=run.losses(),
            mode="lines+markers",
            name=label,
            legendgroup=label,
            row=1,
            col=1,
        )
    for cat in MEMORY_CATEGORIES:
        add_trace(
            fig,
            go.Bar(
                x=labels,
                y=[r["memory"].get(cat, 0) / 1e3 for r in rows],
                name=cat,
                legendgroup=cat,
                marker_color=MEMORY_COLORS[cat],
            ),
            row=1,
            col=2,
        )
    for axis in AXES:
        add_trace(
            fig,
            go.Bar(
                x=labels,
                y=[r["bytes_per_step"][axis] / 1e3 for r in rows],
                name=f"{axis} traffic",
                legendgroup=f"axis {axis}",
                marker_color=AXIS_COLORS[axis],
            ),
            row=2,
            col=1,
        )
    fig.add_bar(
        x=labels,
        y=[r["step_ms"] for r in rows],
        name="ms/step",
        marker_color=PREDICTED_COLOR,
        row=2,
        col=2,
    )
    table = table_figure(rows)
    fig.add_trace(table.data[0], row=3, col=1)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_layout(
        barmode="stack",
        height=900,
        title=f"{labels[0]} vs {labels[1]}",
    )
    return fig


# ---- where the ranks sit -----------------------------------------------------------
def placement_figure(
    layout: Layout, gpus_per_node: int, *, title: str | None = None
) -> go.Figure:
    """Ranks on a node × GPU grid, Megatron's way (rank ``r`` on GPU ``r % g`` of
    node ``r // g``; tp fastest, then dp, then pp): each cell coloured by pipeline
    stage and labelled with the rank and its coordinates. A tensor-parallel group
    stays inside one node exactly when ``tp`` divides ``gpus_per_node``."""
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int):
        raise ValueError(f"gpus_per_node must be a positive integer: {gpus_per_node!r}")
    if gpus_per_node < 1 or layout.world_size % gpus_per_node:
        raise ValueError(
            f"{layout.world_size} ranks do not fill nodes of {gpus_per_node} GPUs: "
            "use a gpus_per_node that divides the world size"
        )
    nodes = layout.world_size // gpus_per_node
    z, text = [], []
    for node in range(nodes):
        zrow, trow = [], []
        for gpu in range(gpus_per_node):
            rank = node * gpus_per_node + gpu
            c = layout.coords(rank)
            zrow.append(c["pp"])
            trow.append(f"r{rank}<br>pp{c['pp']} dp{c['dp']} tp{c['tp']}")
        z.append(zrow)
        text.append(trow)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"GPU {g}" for g in range(gpus_per_node)],
            y=[f"node {n}" for n in range(nodes)],
            text=text,
            texttemplate="%{text}",
            textfont=dict(size=10 if gpus_per_node <= 8 else 8),
            colorscale="Tealgrn",
            colorbar=dict(title="pp stage"),
            xgap=3,
            ygap=3,
            hovertemplate="%{y}, %{x}<br>%{text}<extra></extra>",
        )
    )
    inside = gpus_per_node % layout.tp == 0
    fig.update_layout(
        title=title
        or f"{layout} on {nodes} node(s) × {gpus_per_node} GPUs: tp groups "
        + ("inside a node" if inside else "CROSS nodes"),
        yaxis=dict(autorange="reversed"),
        height=110 + 60 * nodes,
        margin=dict(t=50, b=30, l=70, r=10),
    )
    return fig

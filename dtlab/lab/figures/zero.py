"""Chapter 03's figures: the bytes each rank holds by category next to the ZeRO
paper's formula (and what CPU offload moves to the host), one rank's model states
per stage, the traffic of each stage against 2Ψ / 3Ψ, and the trade-off table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from dtlab.events import HOST_CATEGORIES, MEMORY_CATEGORIES
from dtlab.lab.figures.base import MEMORY_COLORS, OP_COLORS, PREDICTED_COLOR


def latest_memory(events, phase: str | None = None) -> dict[int, dict]:
    """``{rank: the latest memory event}`` (of ``phase`` if given)."""
    out: dict[int, dict] = {}
    for e in events:
        if e.get("kind") == "memory" and (phase is None or e.get("phase") == phase):
            out[e["rank"]] = e
    return out


def zero_memory_figure(
    events,
    *,
    predicted: Mapping[str, float] | None = None,
    phase: str | None = None,
    title: str | None = None,
) -> go.Figure:
    """Bytes each rank holds, one stacked bar per rank by category, from the latest
    telemetry ``memory`` event (of ``phase``, or of any phase: the live view), with
    the formula's bar beside them (``predicted``: bytes by category, e.g.
    :func:`dtlab.estimate.zero_states_per_rank`). Host bytes (CPU offload) get bars
    of their own, so offload shows as bytes leaving the device. Usable as
    ``LiveFigure(zero_memory_figure, predicted=...)``."""
    latest = latest_memory(events, phase)
    ranks = sorted(latest)
    has_host = any(latest[r].get("host") for r in ranks) or bool(
        predicted and predicted.get("host")
    )
    x, rows = [], []
    for r in ranks:
        x.append(f"rank {r}")
        rows.append((latest[r], False))
        if has_host:
            x.append(f"rank {r} host")
            rows.append((latest[r], True))
    if predicted is not None:
        x.append("ZeRO formula")
        rows.append((predicted, False))
        if has_host:
            x.append("formula host")
            rows.append((predicted, True))
    fig = go.Figure()
    for cat in (*MEMORY_CATEGORIES, *HOST_CATEGORIES):
        color = MEMORY_COLORS[cat]
        host_cat = cat.startswith("host_")
        y = [
            (row.get(cat, 0) if host_cat == is_host else 0) / 1e3
            for row, is_host in rows
        ]
        fig.add_bar(
            x=x,
            y=y,
            name=cat,
            marker_color=color,
            marker_opacity=[
                0.55 if s.endswith(("formula", "formula host")) else 1 for s in x
            ],
            hovertemplate="%{x}<br>" + cat + ": %{y:,.1f} kB<extra></extra>",
        )
    what = f"at the end of {phase}" if phase else "latest sample"
    fig.update_layout(
        barmode="stack",
        height=360,
        yaxis_title="kB (1e3 bytes)",
        title=title or f"Memory per rank, {what}: measured vs the ZeRO formula",
    )
    return fig


def zero_stages_figure(
    measured: Mapping[int, Mapping], predicted: Mapping[int, Mapping], *, title=None
) -> go.Figure:
    """One rank's model states under each ZeRO stage: the measured bytes by category
    (``measured[stage]``: a memory event) next to the formula's
    (``predicted[stage]``), side by side per stage."""
    stages = sorted(measured)
    xs = [
        [f"stage {s}" for s in stages for _ in (0, 1)],
        ["measured", "formula"] * len(stages),
    ]
    fig = go.Figure()
    for cat in ("params", "grads", "optimizer", "host_grads", "host_optimizer"):
        y = []
        for s in stages:
            y += [measured[s].get(cat, 0) / 1e3, predicted[s].get(cat, 0) / 1e3]
        if any(y):
            fig.add_bar(x=xs, y=y, name=cat, marker_color=MEMORY_COLORS[cat])
    fig.update_layout(
        barmode="stack",
        height=380,
        yaxis_title="kB per rank (1e3 bytes)",
        title=title or "Model states per rank by ZeRO stage: measured vs formula",
    )
    return fig


def zero_traffic_figure(
    comm_by_stage: Mapping[int, Sequence[Mapping]],
    psi_bytes: float,
    world_size: int,
    *,
    title=None,
) -> go.Figure:
    """Wire bytes one rank sends in one step, stacked by collective, per stage;
    diamonds at the paper's 2Ψ / 3Ψ, i.e. ``(N-1)/N · {2, 3} · Ψ · bytes``
    (``psi_bytes`` = Ψ · bytes per value as communicated)."""
    stages = sorted(comm_by_stage)
    x = [f"stage {s}" for s in stages]
    fig = go.Figure()
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        y = [
            sum(e["wire_bytes"] for e in comm_by_stage[s] if e["op"] == op) / 1e3
            for s in stages
        ]
        if any(y):
            fig.add_bar(x=x, y=y, name=op, marker_color=OP_COLORS[op])
    ring = (world_size - 1) / world_size
    fig.add_scatter(
        x=x,
        y=[ring * (3 if s == 3 else 2) * psi_bytes / 1e3 for s in stages],
        mode="markers+text",
        text=["3Ψ" if s == 3 else "2Ψ" for s in stages],
        textposition="top center",
        name="ZeRO §7: 2Ψ / 3Ψ",
        marker=dict(symbol="diamond", size=12, color=PREDICTED_COLOR),
    )
    fig.update_layout(
        barmode="stack",
        height=360,
        yaxis_title="kB sent per rank per step",
        title=title or f"Traffic per step on {world_size} ranks: measured vs 2Ψ / 3Ψ",
    )
    return fig


def zero_tradeoff_table(rows: Sequence[Mapping]) -> go.Figure:
    """The trade-off table: for each stage, model-state bytes per rank and traffic
    per step, each against stage 0 (``rows``: dicts with ``stage``,
    ``states_bytes``, ``wire_bytes``, ``step_ms``)."""
    base = {k: rows[0][k] for k in ("states_bytes", "wire_bytes")}
    cells = [
        [f"stage {r['stage']}" for r in rows],
        [f"{r['states_bytes'] / 1e3:,.1f}" for r in rows],
        [f"{1 - r['states_bytes'] / base['states_bytes']:.0%}" for r in rows],
        [f"{r['wire_bytes'] / 1e3:,.1f}" for r in rows],
        [f"{r['wire_bytes'] / base['wire_bytes'] - 1:+.0%}" for r in rows],
        [f"{r['step_ms']:.1f}" for r in rows],
    ]
    header = [
        "stage",
        "model states kB/rank",
        "memory saved",
        "kB sent/step",
        "traffic added",
        "ms/step (this machine)",
    ]
    fig = go.Figure(go.Table(header=dict(values=header), cells=dict(values=cells)))
    fig.update_layout(height=260, margin=dict(t=30, b=10), title="What each stage buys")
    return fig

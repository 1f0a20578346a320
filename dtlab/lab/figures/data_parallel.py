"""Chapter 02's figures: loss curves per rank next to the single-process reference,
DDP's bucket all-reduces against the backward they hide behind, bucket sizes
against the number of calls and the exposed communication, and the memory each
device holds under nn.DataParallel's design.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.events import Kind
from dtlab.lab.figures.base import (
    MEMORY_COLORS,
    OP_COLORS,
    PREDICTED_COLOR,
    SPAN_COLORS,
    add_trace,
    cell,
    color_of,
)
from dtlab.lab.figures.collectives import ranks_of


def step_records(events) -> list[dict]:
    """The per-step records (events of kind ``"step"`` that :mod:`dtlab.train`
    emits), sorted by rank and step."""
    out = [e for e in events if e.get("kind") == Kind.STEP]
    return sorted(out, key=lambda e: (e["rank"], e["step"]))


def loss_figure(
    events,
    *,
    key: str = "loss",
    reference: Sequence[float] | None = None,
    title: str | None = "Training loss per rank",
    fig: go.Figure | None = None,
    row: int | None = None,
    col: int | None = None,
) -> go.Figure:
    """Loss against step, one line per rank, from ``"step"`` records (events, or the
    records themselves). ``key="local_loss"`` shows each rank's own microbatches
    instead of the global-batch loss. ``reference``: the single-process losses of
    :func:`dtlab.reference.train_reference`, dashed. Usable with
    :class:`~dtlab.lab.figures.live.LiveFigure` (``LiveFigure(loss_figure)``)."""
    fig, where = cell(fig, row, col)
    records = step_records(events)
    for rank in ranks_of(records) if records else []:
        mine = [e for e in records if e["rank"] == rank]
        add_trace(
            fig,
            go.Scatter(
                x=[e["step"] for e in mine],
                y=[e[key] for e in mine],
                mode="lines+markers",
                marker_size=4,
                name=f"rank {rank}",
                legendgroup=f"rank {rank}",
            ),
            **where,
        )
    if reference is not None:
        add_trace(
            fig,
            go.Scatter(
                x=list(range(len(reference))),
                y=list(reference),
                mode="lines",
                line={"dash": "dash", "color": PREDICTED_COLOR},
                name="reference (1 process)",
                legendgroup="reference",
            ),
            **where,
        )
    fig.update_xaxes(title_text="step", **where)
    fig.update_yaxes(title_text=key.replace("_", " "), **where)
    if title and not where:
        fig.update_layout(title=title, height=360)
    return fig


def ddp_overlap_figure(
    events,
    *,
    step: int | None = None,
    title: str | None = None,
    fig: go.Figure | None = None,
    row: int | None = None,
    col: int | None = None,
) -> go.Figure:
    """One DDP step on every rank: the compute lane holds the forward (F), the
    backward (B), the wait for the last buckets after backward (idle) and the
    optimizer step (opt); the bucket lane holds each bucket's all-reduce from launch
    to completion (``ddp_bucket`` events of :mod:`dtlab.ddp`). A bucket bar that
    starts inside the B bar is communication hidden behind compute.

    Times are ms from the start of that rank's step. ``step=None`` picks the last
    step that has bucket events.
    """
    fig, where = cell(fig, row, col)
    buckets = [e for e in events if e.get("kind") == Kind.DDP_BUCKET]
    if step is None and buckets:
        step = max(e["step"] for e in buckets)
    chosen = [
        e
        for e in events
        if e.get("step") == step and e.get("kind") in (Kind.DDP_BUCKET, Kind.SPAN)
    ]
    starts: dict[int, float] = {}
    for e in chosen:
        starts[e["rank"]] = min(starts.get(e["rank"], math.inf), e["t_start"])
    lanes = []
    for rank in sorted(starts):
        lanes += [f"rank {rank} · compute", f"rank {rank} · buckets"]
    groups: dict[str, list[dict]] = {}
    for e in chosen:
        name = "all_reduce" if e["kind"] == Kind.DDP_BUCKET else str(e["name"])
        groups.setdefault(name, []).append(e)
    for name, evs in groups.items():
        is_bucket = name == "all_reduce"
        lane = "buckets" if is_bucket else "compute"
        what = "bucket %{customdata[0]}: %{customdata[1]:,.0f} B" if is_bucket else name
        add_trace(
            fig,
            go.Bar(
                orientation="h",
                y=[f"rank {e['rank']} · {lane}" for e in evs],
                base=[(e["t_start"] - starts[e["rank"]]) * 1e3 for e in evs],
                x=[max(e["t_end"] - e["t_start"], 0.0) * 1e3 for e in evs],
                text=[f"b{e['bucket']}" if is_bucket else name for e in evs],
                textposition="inside",
                customdata=[
                    [e.get("bucket", ""), e.get("payload_bytes", 0)] for e in evs
                ],
                name="bucket all-reduce" if is_bucket else name,
                legendgroup=name,
                marker_color=color_of(name, OP_COLORS if is_bucket else SPAN_COLORS),
                marker_line_width=1 if is_bucket else 0,
                marker_line_color="white",
                hovertemplate=what
                + "<br>%{base:.2f} ms + %{x:.2f} ms<extra>%{y}</extra>",
            ),
            **where,
        )
    fig.update_xaxes(title_text="ms from the start of the step", **where)
    fig.update_yaxes(
        categoryorder="array", categoryarray=lanes[::-1], type="category", **where
    )
    if not where:
        fig.update_layout(
            title=title or f"DDP step {step}: bucket all-reduces against backward",
            barmode="overlay",
            height=120 + 60 * len(lanes),
        )
    return fig


def ddp_bucket_sweep_figure(
    rows: Sequence[Mapping], *, title: str | None = None
) -> go.Figure:
    """Bucket size against the number of all-reduces per step and the exposed
    communication (what the step waits for after backward), measured next to
    :func:`dtlab.estimate.ddp_bucket_assignment` and :func:`dtlab.estimate.ddp_overlap`.

    Each row: ``bucket_cap_mb``, ``buckets`` and ``predicted_buckets``, and
    ``exposed_s`` / ``predicted_exposed_s`` (seconds).
    """

    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("all-reduces per step", "exposed communication (ms)"),
    )
    caps = [r["bucket_cap_mb"] for r in rows]
    for col, (measured, predicted, scale) in enumerate(
        (
            ("buckets", "predicted_buckets", 1),
            ("exposed_s", "predicted_exposed_s", 1e3),
        ),
        start=1,
    ):
        add_trace(
            fig,
            go.Scatter(
                x=caps,
                y=[r[measured] * scale for r in rows],
                mode="markers+lines",
                name="measured",
                legendgroup="measured",
                marker_color=OP_COLORS["all_reduce"],
            ),
            row=1,
            col=col,
        )
        if all(predicted in r for r in rows):
            add_trace(
                fig,
                go.Scatter(
                    x=caps,
                    y=[r[predicted] * scale for r in rows],
                    mode="markers+lines",
                    name="predicted",
                    legendgroup="predicted",
                    line={"dash": "dash", "color": PREDICTED_COLOR},
                    marker_symbol="x",
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="bucket_cap_mb (MiB)", type="log", row=1, col=col)
    fig.update_layout(
        title=title or "Bucket size: fewer calls against later start", height=380
    )
    return fig


def dp_memory_figure(
    report: Sequence[Mapping], *, title: str | None = None, label: str = "device"
) -> go.Figure:
    """Bytes each device holds, stacked by category: ``report`` is a list of dicts
    with a ``label`` key (the device or rank) and byte counts per category, e.g.
    :meth:`dtlab.ddp.DataParallel.memory_report`."""
    fig = go.Figure()
    cats = [k for k in MEMORY_COLORS if any(k in r for r in report)]
    for cat in cats:
        fig.add_bar(
            x=[f"{label} {r[label]}" for r in report],
            y=[r.get(cat, 0) / 1e6 for r in report],
            name=cat,
            marker_color=MEMORY_COLORS[cat],
        )
    fig.update_layout(
        barmode="stack",
        yaxis_title="MB (1e6 bytes)",
        title=title or "Memory per device",
        height=360,
    )
    return fig

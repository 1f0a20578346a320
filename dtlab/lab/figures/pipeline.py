"""Chapter 05's figures: a pipeline schedule as a Gantt chart (ideal or measured, the
bubble in grey), the bubble against the number of microbatches next to
``(p-1)/(v·m+p-1)``, and the activations each stage holds over a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab import estimate
from dtlab.events import Kind, Span
from dtlab.lab.figures.base import (
    PREDICTED_COLOR,
    SPAN_COLORS,
    add_trace,
    cell,
    color_of,
)

PIPELINE_SPANS = tuple(str(s) for s in (Span.F, Span.B, Span.W, Span.IDLE))


def pipeline_gantt(
    spans,
    *,
    title: str | None = None,
    scale: float = 1e3,
    unit: str = "ms",
    fig: go.Figure | None = None,
    row: int | None = None,
    col: int | None = None,
    showlegend: bool = True,
) -> go.Figure:
    """A pipeline schedule as a Gantt chart: one row per stage, one bar per
    ``F``/``B``/``W`` (labelled with its microbatch, and chunk when interleaved) and
    grey ``idle`` bars where the stage waits: the bubble.

    ``spans`` are :func:`dtlab.pipeline.simulate`'s ideal timeline or
    :func:`dtlab.pipeline.measured_timeline`'s measured one (same fields). Times are
    multiplied by ``scale`` and labelled ``unit`` (``scale=1, unit="t_f"`` for a
    simulation in units of one forward).
    """
    fig, where = cell(fig, row, col)
    spans = [e for e in spans if e.get("name") in PIPELINE_SPANS]
    stages = sorted({e["stage"] for e in spans})
    chunked = any(e.get("chunk") for e in spans)
    for name in PIPELINE_SPANS:
        evs = [e for e in spans if e["name"] == name]
        if not evs:
            continue
        labels = [
            ""
            if name == Span.IDLE
            else f"{e['microbatch']}" + (f".{e['chunk']}" if chunked else "")
            for e in evs
        ]
        add_trace(
            fig,
            go.Bar(
                orientation="h",
                y=[f"stage {e['stage']}" for e in evs],
                base=[e["t_start"] * scale for e in evs],
                x=[max(e["t_end"] - e["t_start"], 0.0) * scale for e in evs],
                text=labels,
                textposition="inside",
                insidetextanchor="middle",
                name=name,
                legendgroup=name,
                showlegend=showlegend,
                marker_color=color_of(name, SPAN_COLORS),
                marker_line_width=0.5,
                marker_line_color="white",
                hovertemplate=name
                + " microbatch %{text}<br>%{base:.2f} + %{x:.2f} "
                + unit
                + "<extra>%{y}</extra>",
            ),
            **where,
        )
    fig.update_xaxes(title_text=f"time ({unit})", **where)
    order = [f"stage {s}" for s in stages][::-1]
    fig.update_yaxes(
        categoryorder="array", categoryarray=order, type="category", **where
    )
    if not where:
        fig.update_layout(barmode="overlay", title=title, height=120 + 45 * len(stages))
    return fig


def pipeline_ideal_vs_measured(
    ideal, measured, *, title: str | None = None, bubbles=None
) -> go.Figure:
    """Two Gantt charts on one time axis: the simulated ideal above, the measured
    step below. ``bubbles``: optional ``(ideal, measured)`` fractions for the
    subplot titles."""

    names = ["ideal (simulated)", "measured"]
    if bubbles is not None:
        names = [f"{n}: bubble {b:.0%}" for n, b in zip(names, bubbles)]
    n_stages = len({e["stage"] for e in measured} | {e["stage"] for e in ideal})
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, subplot_titles=names, vertical_spacing=0.12
    )
    pipeline_gantt(ideal, fig=fig, row=1, col=1)
    pipeline_gantt(measured, fig=fig, row=2, col=1, showlegend=False)
    fig.update_xaxes(title_text="", row=1, col=1)  # one time axis, at the bottom
    fig.update_layout(
        barmode="overlay",
        title=title or "Pipeline step: ideal next to measured",
        height=200 + 90 * n_stages,
    )
    return fig


def pipeline_bubble_figure(
    rows: Sequence[Mapping], *, title: str | None = None
) -> go.Figure:
    """Bubble against microbatches ``m``: the formula ``(p-1)/(v·m+p-1)`` as a line
    per ``(p, v)``, and markers for every row that carries a ``"simulated"`` or
    ``"measured"`` value. ``rows``: dicts with ``p``, ``m``, optional ``v`` and
    ``label``, and the values."""
    fig = go.Figure()
    keys = sorted({(r["p"], r.get("v", 1)) for r in rows})
    for p, v in keys:
        ms = sorted({r["m"] for r in rows if (r["p"], r.get("v", 1)) == (p, v)})
        grid = list(range(1, max(ms) + 1))
        fig.add_scatter(
            x=grid,
            y=[estimate.pipeline_bubble_fraction(p, m, v) for m in grid],
            mode="lines",
            name=f"(p-1)/(v·m+p-1), p={p}, v={v}",
            line={"color": PREDICTED_COLOR, "dash": "dot" if v > 1 else "solid"},
        )
    for what, symbol in (("simulated", "circle-open"), ("measured", "diamond")):
        labels = sorted({r.get("label", what) for r in rows if what in r})
        for k, label in enumerate(labels):
            pts = [r for r in rows if what in r and r.get("label", what) == label]
            fig.add_scatter(
                x=[r["m"] for r in pts],
                y=[r[what] for r in pts],
                mode="markers",
                # shrinking sizes keep points that coincide (GPipe, 1F1B) visible
                marker={"symbol": symbol, "size": 15 - 4 * (k % 3)},
                name=f"{what}: {label}",
            )
    fig.update_layout(
        title=title or "Bubble: idle share of the step against microbatches",
        xaxis_title="microbatches m",
        yaxis_title="bubble (share of step time)",
        yaxis_tickformat=".0%",
        height=380,
    )
    return fig


def pipeline_in_flight_figure(
    events, *, replica: int = 0, bytes_axis: bool = False, title: str | None = None
) -> go.Figure:
    """Activations held per stage over one pipeline step: the ``pp`` memory samples
    that :class:`dtlab.pipeline.Pipeline` records after every forward and backward,
    as microbatches in flight (or bytes with ``bytes_axis``), times relative to each
    rank's step start (the last step in ``events``)."""
    steps = [
        e
        for e in events
        if e.get("kind") == Kind.SPAN
        and e.get("name") == Span.STEP
        and e.get("replica", 0) == replica
    ]
    if not steps:
        raise ValueError("no pipeline 'step' span in these events: record a step")
    last = max(e["step"] for e in steps)
    start = {e["rank"]: e for e in steps if e["step"] == last}
    fig = go.Figure()
    samples = [
        e
        for e in events
        if e.get("kind") == Kind.MEMORY
        and e.get("phase") == "pp"
        and e.get("rank") in start
        and e.get("step") == last
    ]
    for rank in sorted(start):
        st = start[rank]
        mine = [e for e in samples if e["rank"] == rank]
        x = [0.0] + [(e["t"] - st["t_start"]) * 1e3 for e in mine]
        y = [0] + [
            e["activations"] / 1e6 if bytes_axis else e["in_flight"] for e in mine
        ]
        fig.add_scatter(
            x=x, y=y, mode="lines", line_shape="hv", name=f"stage {st['stage']}"
        )
    fig.update_layout(
        title=title or "Activations in flight per stage",
        xaxis_title="time in the step (ms)",
        yaxis_title="activation MB" if bytes_axis else "microbatches in flight",
        height=340,
    )
    return fig

"""What every chapter's figures share: one colour per op, span, memory category and
axis; drawing into one cell of a subplot grid; and measured bars next to predicted
diamonds.

Used by every module of :mod:`dtlab.lab.figures`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from dtlab.events import HOST_CATEGORIES, MEMORY_CATEGORIES, Span

# one colour per op, the same in every figure and chapter
OP_COLORS = {
    "all_reduce": "#4c78a8",
    "reduce_scatter": "#f58518",
    "all_gather": "#54a24b",
    "broadcast": "#e45756",
    "send": "#72b7b2",
    "recv": "#b6d7d5",
    "barrier": "#9d755d",
    "all_to_all": "#b279a2",
    "reduce": "#ff9da6",
}
COMPUTE_SPANS = tuple(str(s) for s in (Span.F, Span.B, Span.W, Span.OPT, Span.IDLE))
# compute spans in colours no op uses
SPAN_COLORS = dict(
    zip(COMPUTE_SPANS, "#8cd17d #f1ce63 #ffbe7d #79706e #d0d0d0".split(), strict=True)
)
# device categories, what CPU offload keeps on the host instead, and the gathered
# outputs of nn.DataParallel's design (dtlab.ddp.DataParallel.memory_report)
MEMORY_COLORS = dict(
    zip(
        (*MEMORY_CATEGORIES, *HOST_CATEGORIES, "outputs"),
        "#4c78a8 #f58518 #54a24b #b279a2 #9d755d #9ecae9 #ffbf79 #88d27a "
        "#e45756".split(),
        strict=True,
    )
)
AXES = ("dp", "tp", "pp", "world")  # the groups of a 3D layout, then the whole world
BEYOND_3D_AXES = ("cp", "ep", "dp_cp", "edp")  # chapter 11's groups
AXIS_COLORS = dict(
    zip(
        (*AXES, *BEYOND_3D_AXES),
        "#4c78a8 #f58518 #54a24b #9d755d #e45756 #72b7b2 #b279a2 #ff9da6".split(),
        strict=True,
    )
)
RANK_COLORS = tuple(
    "#4c78a8 #f58518 #54a24b #e45756 #72b7b2 #b279a2 #ff9da6 #9d755d".split()
)
PREDICTED_COLOR = "#222222"
_FALLBACK = ("#8c564b", "#bcbd22", "#17becf", "#7f7f7f", "#e377c2")


def color_of(name: str, table: Mapping[str, str]) -> str:
    """``name``'s colour in ``table``, else one of a few others, stable per name."""
    name = str(name)
    if name in table:
        return table[name]
    return _FALLBACK[sum(map(ord, name)) % len(_FALLBACK)]


def cell(fig, row, col) -> tuple[go.Figure, dict]:
    """A new figure, or the given one; plus the ``row``/``col`` keywords that put a
    trace or an axis into that cell of a ``make_subplots`` grid."""
    if (row is None) != (col is None):
        raise ValueError("pass both row and col (a cell of a subplot grid), or neither")
    if fig is None:
        if row is not None:
            raise ValueError("row/col need fig=: a figure made by make_subplots")
        fig = go.Figure()
    return fig, ({} if row is None else {"row": row, "col": col})


def add_trace(fig, trace, **where) -> None:
    """``fig.add_trace``, showing each legend group once (a dashboard draws the same
    op in several cells)."""
    group = trace.legendgroup
    if group and any(
        t.legendgroup == group and t.showlegend is not False for t in fig.data
    ):
        trace.showlegend = False
    fig.add_trace(trace, **where)


def measured_vs_predicted_figure(
    x: Sequence,
    measured: Mapping[str, Sequence[float]],
    predicted: Mapping[str, Sequence[float]],
    *,
    xaxis_title: str = "",
    yaxis_title: str = "",
    title: str | None = None,
) -> go.Figure:
    """Grouped bars of measured series with the matching predicted series as
    diamonds (same key, same colour), e.g. bytes per rank against tp (chapter 04)
    or measured step times against the planner's (chapter 09)."""
    fig = go.Figure()
    xs = [str(v) for v in x]
    for i, (name, values) in enumerate(measured.items()):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        fig.add_bar(
            x=xs,
            y=list(values),
            name=f"{name} (measured)",
            marker_color=color,
            offsetgroup=str(i),
        )
        if name in predicted:
            fig.add_scatter(
                x=xs,
                y=list(predicted[name]),
                mode="markers",
                name=f"{name} (predicted)",
                offsetgroup=str(i),
                marker=dict(
                    symbol="diamond",
                    size=11,
                    color=PREDICTED_COLOR,
                    line=dict(color=color, width=2),
                ),
            )
    fig.update_layout(
        barmode="group",
        scattermode="group",
        height=360,
        title=title,
        xaxis_title=xaxis_title,
        yaxis_title=yaxis_title,
    )
    return fig

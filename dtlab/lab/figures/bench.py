"""``dtlab bench --plot``: the benchmark table as a picture.

Taught in chapter 02 (reading a benchmark). :func:`bench_figure` draws the rows of
:func:`dtlab.bench.assemble`: each comparison's ratio as a bar (1 = as fast as
PyTorch, or exactly as predicted), coloured by section, above the full table.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.lab.figures.export import save_png

SECTION_COLORS = {
    "speed": "#4c78a8",
    "bytes": "#54a24b",
    "memory": "#f58518",
    "bubble": "#b279a2",
    "overhead": "#e45756",
}


def _label(r: dict) -> str:
    n = "" if r["n"] is None else f" (N={r['n']})"
    return f"{r['what']}{n}"


BAR_PX, ROW_PX, PAD_PX = 18, 21, 140  # pixels per bar, per table row, margins


def _heights(rows) -> tuple[int, int]:
    bars = sum(1 for r in rows if r["ratio"] is not None)
    return max(bars, 1) * BAR_PX + 60, (len(rows) + 1) * ROW_PX + 20


def bench_figure(rows, title: str = "dtlab bench") -> go.Figure:
    """Ratios as horizontal bars (log axis, a line at 1) above every row as a
    table; sized so that every row is readable."""
    rows = list(rows)
    with_ratio = [r for r in rows if r["ratio"] is not None]
    bars_px, table_px = _heights(rows)
    fig = make_subplots(
        rows=2,
        cols=1,
        vertical_spacing=0.03,
        row_heights=[bars_px / (bars_px + table_px), table_px / (bars_px + table_px)],
        specs=[[{"type": "xy"}], [{"type": "table"}]],
    )
    order = [_label(r) for r in with_ratio][::-1]  # first row on top
    for section, color in SECTION_COLORS.items():
        part = [r for r in with_ratio if r["section"] == section]
        if not part:
            continue
        fig.add_trace(
            go.Bar(
                y=[_label(r) for r in part],
                x=[r["ratio"] for r in part],
                orientation="h",
                name=section,
                marker_color=color,
                text=[f"{r['ratio']:.3f}" for r in part],
                textposition="outside",
                hovertext=[f"vs {r['against']}" for r in part],
            ),
            row=1,
            col=1,
        )
    fig.add_vline(x=1.0, line_dash="dash", line_color="black", row=1, col=1)
    fig.update_xaxes(type="log", title_text="dtlab / reference (log)", row=1, col=1)
    fig.update_yaxes(
        categoryorder="array", categoryarray=order, tickfont_size=10, row=1, col=1
    )

    def fmt(x):
        return "-" if x is None else f"{x:.4g}"

    columns = {
        "section": [r["section"] for r in rows],
        "comparison": [r["what"] for r in rows],
        "N": ["" if r["n"] is None else r["n"] for r in rows],
        "dtlab": [fmt(r["dtlab"]) for r in rows],
        "reference": [fmt(r["reference"]) for r in rows],
        "unit": [r["unit"] for r in rows],
        "ratio": [fmt(r["ratio"]) for r in rows],
        "against": [r["against"] for r in rows],
        "note": [r["note"] for r in rows],
    }
    fig.add_trace(
        go.Table(
            columnwidth=[50, 170, 20, 50, 50, 40, 45, 140, 160],
            header=dict(values=list(columns), fill_color="#ddd", font_size=11),
            cells=dict(values=list(columns.values()), font_size=10, height=ROW_PX),
        ),
        row=2,
        col=1,
    )
    fig.update_layout(
        title=title,
        barmode="overlay",
        bargap=0.25,
        legend=dict(orientation="h", x=1, xanchor="right", y=1.0, yanchor="bottom"),
        margin=dict(l=20, r=20, t=60, b=20),
    )
    return fig


def write_png(rows, path, *, title: str = "dtlab bench") -> str:
    """Draw :func:`bench_figure` into ``path`` (kaleido + Chromium); the path."""
    rows = list(rows)
    bars_px, table_px = _heights(rows)
    height = bars_px + table_px + PAD_PX
    return save_png(bench_figure(rows, title), path, width=1400, height=height)

"""Chapter 04's figures: who holds which part of a weight under Megatron's column and
row splits, the collectives of every layer against the 2 + 2 all-reduces the paper
predicts, and compute against communication time per interconnect.
"""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab import estimate, telemetry
from dtlab.lab.figures.base import OP_COLORS, PREDICTED_COLOR, RANK_COLORS, color_of


def tp_split_figure(tp: int, d_in: int = 8, d_out: int = 8) -> go.Figure:
    """Who holds which entries of ``A`` (``d_in × d_out``, ``Y = X·A``) under
    Megatron's column split (left: rank i owns columns i·out/t…) and row split
    (right: rank i owns rows i·in/t…). Each cell is coloured by its owner."""

    if tp < 1 or d_in % tp or d_out % tp:
        raise ValueError(f"tp={tp} must divide d_in={d_in} and d_out={d_out}")
    scale = []  # a discrete colour scale: one flat band per rank
    for i in range(tp):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        scale += [[i / tp, color], [(i + 1) / tp, color]]
    column = [[j * tp // d_out for j in range(d_out)] for _ in range(d_in)]
    row = [[i * tp // d_in] * d_out for i in range(d_in)]
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=[
            "column parallel: A = [A₁ … Aₜ], Yᵢ = X·Aᵢ",
            "row parallel: A = [A₁; …; Aₜ], Y = Σ Xᵢ·Aᵢ",
        ],
    )
    for c, z in ((1, column), (2, row)):
        fig.add_trace(
            go.Heatmap(
                z=z,
                zmin=-0.5,
                zmax=tp - 0.5,
                colorscale=scale,
                showscale=c == 2,
                colorbar=dict(title="rank", tickvals=list(range(tp))),
                xgap=2,
                ygap=2,
                hovertemplate="row %{y}, col %{x}: rank %{z}<extra></extra>",
            ),
            row=1,
            col=c,
        )
        fig.update_xaxes(title_text="output features (columns of A)", row=1, col=c)
        fig.update_yaxes(
            title_text="input features (rows of A)", autorange="reversed", row=1, col=c
        )
    fig.update_layout(height=360, title=f"Splitting one weight over tp={tp} ranks")
    return fig


def tp_layer_comm(events) -> dict[tuple[int, str], dict[str, dict[str, float]]]:
    """``{(layer, "forward"|"backward"): {op: {"calls", "wire_bytes"}}}`` from the comm
    events of one rank, read from the tags dtlab.tensor_parallel writes
    (``blocks.{i}.attn:fwd``, ``blocks.{i}.mlp:bwd``, ...)."""
    table: dict = {}
    for e in telemetry.comm_events(events):
        tag = e.get("tag") or ""
        if not tag.startswith("blocks.") or ":" not in tag:
            continue
        layer = int(tag.split(".")[1])
        phase = {"fwd": "forward", "bwd": "backward"}[tag.rsplit(":", 1)[1]]
        row_ = table.setdefault((layer, phase), {}).setdefault(
            e["op"], {"calls": 0, "wire_bytes": 0.0}
        )
        row_["calls"] += 1
        row_["wire_bytes"] += e["wire_bytes"]
    return table


TP_OPS = ("all_reduce", "all_gather", "reduce_scatter")  # what a TP layer runs


def tp_layer_comm_figure(
    events,
    *,
    rank: int = 0,
    sequence_parallel: bool = False,
    fig: go.Figure | None = None,
) -> go.Figure:
    """Collectives per layer and pass, measured on one rank (bars stacked by op)
    against :func:`dtlab.estimate.tp_collectives_per_layer` (◆): 2 all-reduces
    forward and 2 backward, or 2 all-gathers + 2 reduce-scatters each way with
    sequence parallelism.

    Pass the ``fig`` (e.g. a ``go.FigureWidget``) an earlier call returned to
    redraw it in place, in one ``batch_update``."""
    table = tp_layer_comm([e for e in events if e.get("rank") == rank])
    keys = sorted(table)
    x = [f"layer {layer} {phase[:3]}" for layer, phase in keys]
    expected = estimate.tp_collectives_per_layer(sequence_parallel)
    if fig is None:
        fig = go.Figure()
        for op in TP_OPS:
            fig.add_bar(
                name=op,
                marker_color=color_of(op, OP_COLORS),
                hovertemplate="%{x}: %{y} calls, %{customdata:,.0f} B sent"
                "<extra>" + op + "</extra>",
            )
        fig.add_scatter(
            mode="markers",
            name="predicted",
            marker=dict(symbol="diamond", size=12, color=PREDICTED_COLOR),
        )
        fig.update_layout(
            barmode="stack", height=340, yaxis_title="collectives on the tp group"
        )
    with fig.batch_update():  # one redraw of a FigureWidget for all the changes
        for trace, op in zip(fig.data, TP_OPS):
            trace.x = x
            trace.y = [table[k].get(op, {}).get("calls", 0) for k in keys]
            trace.customdata = [table[k].get(op, {}).get("wire_bytes", 0) for k in keys]
        fig.data[len(TP_OPS)].x = x
        fig.data[len(TP_OPS)].y = [sum(expected[phase].values()) for _, phase in keys]
        mode = "sequence parallel" if sequence_parallel else "plain TP"
        fig.layout.title.text = f"rank {rank}: collectives per layer ({mode})"
    return fig


def tp_step_time_figure(times: Mapping[str, Mapping[str, float]], title=None):
    """Stacked compute and communication time per interconnect, from
    :func:`dtlab.estimate.tp_step_time` results keyed by link name."""
    names = list(times)
    labels = [estimate.LINKS[n].name if n in estimate.LINKS else n for n in names]
    fig = go.Figure()
    for part, color in (("compute_s", "#8cd17d"), ("comm_s", OP_COLORS["all_reduce"])):
        fig.add_bar(
            x=labels,
            y=[times[n][part] * 1e3 for n in names],
            name=part.replace("_s", ""),
            marker_color=color,
            text=[
                f"{times[n]['comm_fraction']:.0%} comm" if part == "comm_s" else ""
                for n in names
            ],
            textposition="outside",
        )
    fig.update_layout(
        barmode="stack", height=380, yaxis_title="ms per microbatch", title=title
    )
    return fig

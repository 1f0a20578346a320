"""Who sends how many bytes to whom, per group and per step: two of the views of
chapter 07's dashboard (:mod:`dtlab.lab.figures.dashboard`).

A ring collective (all-reduce, reduce-scatter, all-gather, and broadcast as
pipelined along the ring) sends only to the next rank of its group's ring; a
pipeline send goes to the next stage (activations) or to the previous one
(gradients); ring attention's sends name their peer (the next rank of the cp ring);
an all-to-all (Ulysses, expert parallelism's dispatch and combine: chapter 11)
sends a piece to every other rank of its group, its event's ``send_bytes`` row
saying how much to each. :func:`peer_of` and :func:`traffic_matrix` apply those
rules to comm events, so a rank × rank matrix of the whole run shows the layout's
rings, its pipeline and its all-to-all blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dtlab.events import Kind
from dtlab.lab.figures.base import (
    AXES,
    AXIS_COLORS,
    BEYOND_3D_AXES,
    OP_COLORS,
    PREDICTED_COLOR,
)
from dtlab.topology import Layout

_MARGIN = dict(t=50, b=40, l=50, r=10)


_ORDER = (*AXES[:3], *BEYOND_3D_AXES, AXES[3])


def _group(axis: str, rank: int, layout: Layout) -> list[int]:
    if axis in _ORDER[:-1]:
        return layout.group_of(axis, rank)
    return list(range(layout.world_size))  # "world", or a group we cannot name


def peer_of(event: Mapping, layout: Layout) -> int | None:
    """The rank that receives the wire bytes of one comm event of ``event['rank']``.

    A ring collective sends only to the next rank of its group's ring. A send goes
    to ``event['peer']`` when recorded, else along the pipeline: the activations
    (tag ``act``) to the next stage, the gradients (``grad``) to the previous one.
    Receives and barriers put no payload on the wire: ``None``.
    """
    if event.get("wire_bytes", 0) <= 0 or event["op"] in ("recv", "barrier"):
        return None
    if event.get("peer") is not None:
        return int(event["peer"])
    group = _group(event.get("axis"), event["rank"], layout)
    if len(group) < 2:
        return None
    i = group.index(event["rank"])
    step = -1 if event["op"] == "send" and event.get("tag") == "grad" else 1
    return group[(i + step) % len(group)]


def traffic_matrix(events, layout: Layout, into=None) -> list[list[float]]:
    """``m[src][dst]``: wire bytes ``src`` sent to ``dst`` (:func:`peer_of`), added
    to ``into`` (a matrix of an earlier call) if given."""
    n = layout.world_size
    m = into if into is not None else [[0.0] * n for _ in range(n)]
    for e in events:
        if e.get("kind") == Kind.COMM and e.get("rank") is not None and e["rank"] < n:
            if e.get("send_bytes") is not None:  # an all-to-all: a row per group
                group = _group(e.get("axis"), e["rank"], layout)
                for dst, sent in zip(group, e["send_bytes"], strict=True):
                    if dst != e["rank"]:
                        m[e["rank"]][dst] += sent
                continue
            dst = peer_of(e, layout)
            if dst is not None and dst < n:
                m[e["rank"]][dst] += e["wire_bytes"]
    return m


def traffic_by_step(events, into=None) -> dict[int, dict[tuple[str, str], float]]:
    """``{step: {(axis, op): wire bytes}}`` summed over ranks, added to ``into`` (a
    result of an earlier call) if given."""
    out = into if into is not None else {}
    for e in events:
        if e.get("kind") == Kind.COMM and e.get("wire_bytes"):
            row = out.setdefault(e["step"], {})
            key = (str(e.get("axis")), e["op"])
            row[key] = row.get(key, 0.0) + e["wire_bytes"]
    return out


def _axis_order(key: tuple[str, str]) -> tuple:
    axis, op = key
    return (_ORDER.index(axis) if axis in _ORDER else len(_ORDER), axis, op)


def step_traffic_figure(
    per_step: Mapping[int, Mapping[tuple[str, str], float]],
    world_size: int,
    predicted: Mapping[str, float] | None = None,
) -> dict:
    """Bytes one rank sends per step (the ranks' sum / world size) as a figure dict
    (:mod:`dtlab.lab.figures.dashboard` says why a dict), stacked by
    ``group · op`` (``per_step``: :func:`traffic_by_step`); ``predicted`` (bytes per
    rank by axis, :func:`dtlab.estimate.layout_traffic`) as a marker on each step."""
    steps = sorted(per_step)
    keys = sorted({k for row in per_step.values() for k in row}, key=_axis_order)
    traces = []
    for axis, op in keys:
        traces.append(
            dict(
                type="bar",
                name=f"{axis} · {op}",
                x=steps,
                y=[per_step[s].get((axis, op), 0.0) / world_size / 1e3 for s in steps],
                marker=dict(
                    color=OP_COLORS.get(op, AXIS_COLORS.get(axis)),
                    line=dict(color=AXIS_COLORS.get(axis, "#7f7f7f"), width=2),
                ),
                hovertemplate=f"{axis} · {op}: "
                + "%{y:,.1f} kB<extra>step %{x}</extra>",
            )
        )
    if predicted is not None:
        total = sum(predicted.values())
        parts = ", ".join(f"{a} {v / 1e3:,.1f}" for a, v in predicted.items() if v)
        traces.append(
            dict(
                type="scatter",
                name="layout_traffic",
                x=steps,
                y=[total / 1e3] * len(steps),
                mode="markers",
                marker=dict(symbol="diamond", size=9, color=PREDICTED_COLOR),
                hovertemplate=f"predicted kB: {parts}<extra></extra>",
            )
        )
    layout = dict(
        barmode="stack",
        title=dict(text="Traffic per step by group and op (per rank)"),
        xaxis=dict(title=dict(text="step")),
        yaxis=dict(title=dict(text="kB sent per rank")),
        height=320,
        margin=_MARGIN,
    )
    return {"data": traces, "layout": layout}


def traffic_matrix_figure(
    matrix: Sequence[Sequence[float]], labels: Sequence[str]
) -> dict:
    """Rank × rank heatmap of the bytes sent, as a figure dict (row: sender,
    column: receiver; ``matrix``: :func:`traffic_matrix`)."""
    trace = dict(
        type="heatmap",
        name="bytes",
        z=[[v / 1e3 for v in row] for row in matrix],
        x=list(labels),
        y=list(labels),
        colorscale="Blues",
        colorbar=dict(title=dict(text="kB")),
        hovertemplate="%{y} → %{x}: %{z:,.1f} kB<extra></extra>",
    )
    layout = dict(
        title=dict(text="Bytes sent, rank → rank (whole run)"),
        xaxis=dict(title=dict(text="to")),
        yaxis=dict(title=dict(text="from"), autorange="reversed"),
        height=320,
        margin=dict(t=50, b=40, l=60, r=10),
    )
    return {"data": [trace], "layout": layout}

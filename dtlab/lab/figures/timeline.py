"""Timelines: compute spans and comm calls per rank, on one clock.

Taught in chapter 01 (a few data-parallel steps, then an all-reduce of the
gradients) and used again in chapter 03 (one ZeRO-3 step).
"""

from __future__ import annotations

import statistics

import plotly.graph_objects as go

from dtlab import telemetry
from dtlab.events import Kind
from dtlab.lab.figures.base import OP_COLORS, SPAN_COLORS, add_trace, cell, color_of

_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")


def align_clocks(events) -> list[dict]:
    """Events with every rank's times shifted onto the lowest rank's clock.

    Each rank's recorder counts from its own start, and ``cluster.run`` reaches the
    engines one after another, so the clocks differ by milliseconds. A collective
    over the whole world ends at (nearly) the same instant on every rank: the k-th
    world collective of each rank is matched with the reference rank's k-th, and
    the median of their end-time differences is that rank's offset. Ranks with no
    world collective in common are left as they are.
    """
    ends: dict[int, list[float]] = {}
    for e in telemetry.comm_events(events):
        if e["op"] in _COLLECTIVES and e.get("axis") == "world":
            ends.setdefault(e["rank"], []).append(e["t_end"])
    if not ends:
        return list(events)
    ref = ends[min(ends)]
    offset = {
        r: statistics.median(a - b for a, b in zip(mine, ref))
        for r, mine in ends.items()
        if mine and ref
    }
    out = []
    for e in events:
        d = offset.get(e.get("rank"), 0.0)
        if d and e.get("kind") in (Kind.COMM, Kind.SPAN):
            e = {**e, "t_start": e["t_start"] - d, "t_end": e["t_end"] - d}
        elif d and e.get("kind") == Kind.MEMORY and "t" in e:
            e = {**e, "t": e["t"] - d}
        out.append(e)
    return out


def timeline_figure(
    events,
    *,
    align: bool = True,
    title: str | None = "Timeline: compute spans and comm calls per rank",
    fig: go.Figure | None = None,
    row: int | None = None,
    col: int | None = None,
) -> go.Figure:
    """A Gantt chart: one lane per rank (two, compute and comm, when the events hold
    compute spans), a bar per span or comm call, coloured by its name or op.

    Times are in ms on rank 0's recorder clock: with ``align`` (the default) the
    other ranks' clocks are shifted so that world collectives end together
    (:func:`align_clocks`); a bar that *starts* earlier on one rank then shows that
    rank waiting for the others.
    """
    fig, where = cell(fig, row, col)
    if align:
        events = align_clocks(events)
    timed = [e for e in events if e.get("kind") in (Kind.COMM, Kind.SPAN)]
    has_spans = any(e["kind"] == Kind.SPAN for e in timed)

    def lane(e):
        r = f"rank {e['rank']}"
        if not has_spans:
            return r
        return f"{r} · {'compute' if e['kind'] == Kind.SPAN else 'comm'}"

    groups: dict[tuple[str, str], list[dict]] = {}
    for e in timed:
        name = e["op"] if e["kind"] == Kind.COMM else str(e["name"])
        groups.setdefault((e["kind"], name), []).append(e)
    lanes = sorted({lane(e) for e in timed}, key=lambda s: (int(s.split()[1]), s))
    for (kind, name), evs in sorted(groups.items()):
        if kind == Kind.COMM:
            custom = [
                [e.get("payload_bytes", 0), e.get("wire_bytes", 0), str(e.get("tag"))]
                for e in evs
            ]
            hover = (
                name + " %{customdata[0]:,.0f} B (sent %{customdata[1]:,.0f} B), "
                "tag %{customdata[2]}<br>%{base:.2f} ms + %{x:.3f} ms"
            )
        else:
            custom = [[e.get("stage"), str(e.get("microbatch"))] for e in evs]
            hover = (
                name + " stage %{customdata[0]}, microbatch %{customdata[1]}"
                "<br>%{base:.2f} ms + %{x:.3f} ms"
            )
        add_trace(
            fig,
            go.Bar(
                orientation="h",
                y=[lane(e) for e in evs],
                base=[e["t_start"] * 1e3 for e in evs],
                x=[max(e["t_end"] - e["t_start"], 0.0) * 1e3 for e in evs],
                customdata=custom,
                name=name,
                legendgroup=name,
                marker_color=color_of(
                    name, SPAN_COLORS if kind == Kind.SPAN else OP_COLORS
                ),
                hovertemplate=hover + "<extra>%{y}</extra>",
            ),
            **where,
        )
    fig.update_xaxes(title_text="time (ms)", **where)
    fig.update_yaxes(
        categoryorder="array", categoryarray=lanes[::-1], type="category", **where
    )
    if title and not where:
        fig.update_layout(title=title)
    return fig

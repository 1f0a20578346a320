"""Chapter 01's figures: what each collective sends and how long it takes, next to
what the ring formulas predict, and what each rank holds before and after.

Every figure takes the events that :mod:`dtlab.telemetry` records (a list of flat
dicts with a ``kind`` field, e.g. ``cluster.last_events``) and puts the prediction
of :mod:`dtlab.estimate` next to the measurement:

- :func:`traffic_figure`: bytes each rank sent, stacked by op, with the ring
  formula's prediction as a marker on every bar;
- :func:`collective_time_figure`: time against message size on log-log axes, with
  the α-β fit and its two terms drawn apart (latency floor, bandwidth slope);
- :func:`rank_tensors_figure`: each rank's tensor before and after a collective.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab import estimate, telemetry
from dtlab.lab.figures.base import (
    OP_COLORS,
    PREDICTED_COLOR,
    add_trace,
    cell,
    color_of,
)


# ---- summaries of events ------------------------------------------------------------
def ranks_of(events) -> list[int]:
    """The ranks that recorded any of ``events``, sorted."""
    return sorted({e["rank"] for e in events})


def predicted_wire_bytes(event: Mapping, group_sizes: Mapping[str, int]) -> float:
    """What the ring formula (:func:`dtlab.estimate.wire_bytes`) says one recorded
    comm event sends from its rank, given the size of its group.

    ``group_sizes`` maps the event's axis (``"world"``, ``"dp"``, ``"tp"``, ...) to
    the number of ranks in that group. Point-to-point ops need no size.
    """
    op = event["op"]
    if op in ("send", "recv", "barrier"):
        n = 2
    else:
        axis = event.get("axis")
        if axis not in group_sizes:
            raise ValueError(
                f"no group size for axis {axis!r} of a {op} event: pass "
                f"group_sizes={{{axis!r}: n}} (ranks in that group)"
            )
        n = group_sizes[axis]
    return estimate.wire_bytes(op, event["payload_bytes"], n)


def traffic_by_rank(events, key: str = "op") -> dict[int, dict[str, float]]:
    """``{rank: {key value: wire bytes sent}}`` summed over comm events (``key`` is
    an event field: ``"op"``, ``"tag"``, ``"axis"``)."""
    out: dict[int, dict[str, float]] = {}
    for e in telemetry.comm_events(events):
        row = out.setdefault(e["rank"], {})
        k = str(e.get(key))
        row[k] = row.get(k, 0.0) + e["wire_bytes"]
    return out


def collective_times(
    events, op: str = "all_reduce", *, tag: str | None = None
) -> tuple[list[int], list[list[float]]]:
    """Durations of one op by message size: ``(sizes, times)``, ``sizes`` sorted
    payload bytes and ``times[i]`` the seconds of each repetition at ``sizes[i]``.

    The k-th call at a size on every rank is the same collective; it is finished
    when its slowest rank is, so each repetition counts the *maximum* over ranks.
    :func:`summarize_times` reduces the repetitions to one number per size.
    """
    calls: dict[int, list[list[float]]] = {}  # size -> k-th call -> per-rank s
    seen: dict[tuple[int, int], int] = {}  # (rank, size) -> calls so far
    for e in telemetry.comm_events(events, op=op, tag=tag):
        size = e["payload_bytes"]
        k = seen.get((e["rank"], size), 0)
        seen[(e["rank"], size)] = k + 1
        per_call = calls.setdefault(size, [])
        if k == len(per_call):
            per_call.append([])
        per_call[k].append(e["t_end"] - e["t_start"])
    sizes = sorted(calls)
    return sizes, [[max(ranks) for ranks in calls[s]] for s in sizes]


def summarize_times(times, stat: Callable = statistics.median) -> list[float]:
    """One number per size from repetitions (median by default: robust to the
    occasional scheduler hiccup of a busy machine)."""
    return [stat(t) if isinstance(t, Iterable) else float(t) for t in times]


# ---- traffic ----------------------------------------------------------------------
def traffic_figure(
    events,
    *,
    predicted: float | Sequence[float] | Mapping[int, float] | None = None,
    group_sizes: Mapping[str, int] | None = None,
    key: str = "op",
    title: str | None = "Bytes sent per rank: measured (bars) vs predicted (◆)",
    fig: go.Figure | None = None,
    row: int | None = None,
    col: int | None = None,
) -> go.Figure:
    """Wire bytes each rank sent, one stacked bar per rank split by ``key`` (op by
    default), with the prediction as a diamond on top of each bar.

    The bars are the ``wire_bytes`` the ranks recorded. For point-to-point traffic
    (send/recv, and so :func:`dtlab.comm.ring_all_reduce`) these are the bytes of
    every tensor actually sent; for a library collective (gloo's own all-reduce)
    they are the ring formula applied to the real tensor, as the algorithm inside
    the library is not observable from Python.

    ``predicted``: a number (the same for every rank, e.g. ``2(N-1)/N·S``), one per
    rank, or ``None`` to apply :func:`dtlab.estimate.wire_bytes` to every recorded
    event (``group_sizes`` gives the size of each axis' group; ``"world"`` defaults
    to the number of ranks in ``events``).
    """
    fig, where = cell(fig, row, col)
    ranks = ranks_of(events)
    by_rank = traffic_by_rank(events, key)
    keys = sorted({k for row_ in by_rank.values() for k in row_})
    x = [f"rank {r}" for r in ranks]
    for k in keys:
        add_trace(
            fig,
            go.Bar(
                x=x,
                y=[by_rank.get(r, {}).get(k, 0.0) for r in ranks],
                name=k,
                legendgroup=k,
                marker_color=color_of(k, OP_COLORS),
                hovertemplate="%{x}<br>" + k + ": %{y:,.0f} B<extra></extra>",
            ),
            **where,
        )
    if predicted is None:
        sizes = {"world": len(ranks), **(group_sizes or {})}
        pred = {r: 0.0 for r in ranks}
        for e in telemetry.comm_events(events):
            pred[e["rank"]] += predicted_wire_bytes(e, sizes)
    elif isinstance(predicted, Mapping):
        pred = {r: float(predicted[r]) for r in ranks}
    elif isinstance(predicted, int | float):
        pred = {r: float(predicted) for r in ranks}
    else:
        values = list(predicted)
        if len(values) != len(ranks):
            raise ValueError(
                f"predicted has {len(values)} values but events come from "
                f"{len(ranks)} ranks: give one number per rank, or a single number"
            )
        pred = dict(zip(ranks, map(float, values)))
    if ranks:
        add_trace(
            fig,
            go.Scatter(
                x=x,
                y=[pred[r] for r in ranks],
                mode="markers",
                name="predicted",
                legendgroup="predicted",
                marker=dict(symbol="diamond", size=11, color=PREDICTED_COLOR),
                hovertemplate="%{x}<br>predicted: %{y:,.0f} B<extra></extra>",
            ),
            **where,
        )
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="bytes sent", ticksuffix="B", **where)
    if title and not where:
        fig.update_layout(title=title)
    return fig


# ---- time against message size ------------------------------------------------------
def collective_time_figure(
    sizes: Sequence[float],
    times: Sequence[float] | Sequence[Sequence[float]],
    fit: estimate.AlphaBeta | None = None,
    *,
    op: str | None = None,
    n: int | None = None,
    name: str = "measured",
    title: str | None = "Time against message size",
    fig: go.Figure | None = None,
    row: int | None = None,
    col: int | None = None,
) -> go.Figure:
    """Time against message size on log-log axes, with the α-β fit.

    ``sizes`` are payload bytes S; ``times`` one number per size, or the
    repetitions at each size (then every repetition is a faint dot and the median a
    marker). With ``op`` and ``n`` given, ``fit`` is taken to be fitted against
    *wire bytes* (:func:`dtlab.estimate.fit_alpha_beta` recommends it) and the hover
    shows the bus bandwidth (nccl-tests); otherwise against ``sizes`` as given.

    The fit is drawn with its two terms apart: the flat α line (latency, paid per
    call whatever its size) and the β·bytes line (bandwidth). Where they cross is
    the size at which a message stops being latency-bound.
    """
    if len(sizes) != len(times):
        raise ValueError(f"{len(sizes)} sizes but {len(times)} entries in times")
    if any(s <= 0 for s in sizes):
        raise ValueError("sizes must be positive for log axes")
    fig, where = cell(fig, row, col)
    to_wire = (
        (lambda s: estimate.wire_bytes(op, s, n))
        if op is not None and n is not None
        else (lambda s: s)
    )
    reps = [list(t) if isinstance(t, Iterable) else [float(t)] for t in times]
    mid = summarize_times(reps)
    if any(len(r) > 1 for r in reps):
        add_trace(
            fig,
            go.Scatter(
                x=[s for s, r in zip(sizes, reps) for _ in r],
                y=[t for r in reps for t in r],
                mode="markers",
                name="repetitions",
                legendgroup="repetitions",
                marker=dict(size=5, color="rgba(76,120,168,0.3)"),
                hovertemplate="%{x:,.0f} B: %{y:.3s}s<extra>repetition</extra>",
            ),
            **where,
        )
    custom = None
    hover = "S = %{x:,.0f} B<br>t = %{y:.3s}s"
    if op is not None and n is not None:
        custom = [
            estimate.bus_bandwidth(op, s, n, t) / 1e9 if t > 0 else 0.0
            for s, t in zip(sizes, mid)
        ]
        hover += "<br>bus bw %{customdata:.3f} GB/s"
    add_trace(
        fig,
        go.Scatter(
            x=list(sizes),
            y=mid,
            customdata=custom,
            mode="markers+lines",
            name=name,
            legendgroup=name,
            marker=dict(size=9, color=OP_COLORS.get(op or "", "#4c78a8")),
            line=dict(width=1),
            hovertemplate=hover + "<extra></extra>",
        ),
        **where,
    )
    if fit is not None and len(sizes):
        grid = numpy.geomspace(min(sizes), max(sizes), 50).tolist()
        add_trace(
            fig,
            go.Scatter(
                x=grid,
                y=[fit.predict(to_wire(s)) for s in grid],
                mode="lines",
                name=(
                    f"α-β fit: α={fit.alpha_s * 1e6:,.0f} µs, "
                    f"1/β={fit.bandwidth_Bps / 1e9:.2f} GB/s"
                ),
                legendgroup="fit",
                line=dict(color=PREDICTED_COLOR, width=2),
            ),
            **where,
        )
        if fit.alpha_s > 0:
            add_trace(
                fig,
                go.Scatter(
                    x=[grid[0], grid[-1]],
                    y=[fit.alpha_s, fit.alpha_s],
                    mode="lines",
                    name="α (latency term)",
                    legendgroup="alpha",
                    line=dict(color=PREDICTED_COLOR, width=1, dash="dot"),
                ),
                **where,
            )
        floor = 0.05 * min((t for t in mid if t > 0), default=0.0)
        # the bandwidth term, drawn only where it is within 20x of the data (it
        # would otherwise stretch the y axis by decades at small sizes)
        slope = [
            (s, fit.beta_s_per_byte * to_wire(s))
            for s in grid
            if fit.beta_s_per_byte * to_wire(s) >= floor
        ]
        if fit.beta_s_per_byte > 0 and len(slope) > 1:
            add_trace(
                fig,
                go.Scatter(
                    x=[s for s, _ in slope],
                    y=[t for _, t in slope],
                    mode="lines",
                    name="β·bytes (bandwidth term)",
                    legendgroup="beta",
                    line=dict(color=PREDICTED_COLOR, width=1, dash="dash"),
                ),
                **where,
            )
    fig.update_xaxes(type="log", title_text="message size S (bytes)", **where)
    fig.update_yaxes(type="log", title_text="time (s)", **where)
    if title and not where:
        fig.update_layout(title=title)
    return fig


# ---- tensors on each rank -----------------------------------------------------------
def _as_rows(tensors) -> list[list[float]]:
    rows = []
    for t in tensors:
        if hasattr(t, "detach"):  # a torch tensor
            t = t.detach().cpu().reshape(-1).tolist()
        elif hasattr(t, "tolist"):  # numpy
            t = t.reshape(-1).tolist()
        rows.append([float(v) for v in t])
    return rows


def rank_tensors_figure(
    before,
    after=None,
    *,
    titles: tuple[str, str] = ("before", "after"),
    text: bool | None = None,
    title: str | None = None,
) -> go.Figure:
    """Each rank's tensor (flattened) as one row of a heatmap, before and after a
    collective, side by side. ``before``/``after`` hold one tensor per rank (torch,
    numpy or lists); rows may differ in length (a reduce-scatter leaves each rank
    a shard). Values are written in the cells when there are few (``text``)."""
    panels = [_as_rows(before)] + ([_as_rows(after)] if after is not None else [])
    if after is not None and len(panels[0]) != len(panels[1]):
        raise ValueError(
            f"before has {len(panels[0])} ranks but after has {len(panels[1])}"
        )
    fig = make_subplots(
        rows=1,
        cols=len(panels),
        subplot_titles=list(titles[: len(panels)]),
        horizontal_spacing=0.08,
    )
    for i, rows in enumerate(panels, start=1):
        width = max((len(r) for r in rows), default=0)
        z = [r + [None] * (width - len(r)) for r in rows]  # ragged -> padded
        show_text = text if text is not None else width * len(rows) <= 96
        fig.add_trace(
            go.Heatmap(
                z=z,
                x=list(range(width)),
                y=[f"rank {r}" for r in range(len(rows))],
                colorscale="Blues",
                showscale=False,
                texttemplate="%{z:.4~g}" if show_text else None,
                hovertemplate="%{y}, element %{x}: %{z}<extra></extra>",
                xgap=2,
                ygap=2,
            ),
            row=1,
            col=i,
        )
        fig.update_yaxes(autorange="reversed", row=1, col=i)  # rank 0 on top
        fig.update_xaxes(title_text="element", dtick=1 if width <= 16 else None)
    fig.update_layout(
        height=120 + 45 * len(panels[0]), title=title, margin=dict(t=70, b=40)
    )
    return fig

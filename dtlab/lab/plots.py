"""Plotly figures built from dtlab telemetry events, and live figures that update
while a run goes on.

Taught in chapter 01 (traffic, time against message size, timelines) and used by
every later chapter.

Every figure takes the events that :mod:`dtlab.telemetry` records (a list of flat
dicts with a ``kind`` field, e.g. ``cluster.last_events``) and puts the prediction of
:mod:`dtlab.estimate` next to the measurement:

- :func:`traffic_figure`: bytes each rank sent, stacked by op, with the ring
  formula's prediction as a marker on every bar;
- :func:`collective_time_figure`: time against message size on log-log axes, with
  the α-β fit and its two terms drawn apart (latency floor, bandwidth slope);
- :func:`rank_tensors_figure`: each rank's tensor before and after a collective;
- :func:`timeline_figure`: a Gantt chart of compute spans and comm calls per rank;
- :class:`LiveFigure`: any of the above as a ``FigureWidget`` redrawn in place,
  throttled, over a bounded window of events: pass it as
  ``cluster.run(fn, on_events=live)``;
- :func:`save_png`: a static PNG through kaleido (needs a Chromium on the machine).

Figures accept ``fig=, row=, col=`` to draw into one cell of a
``plotly.subplots.make_subplots`` grid, so a dashboard is a few calls
(see :mod:`dtlab.lab.snapshot`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import plotly.graph_objects as go

from dtlab import estimate, telemetry

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
SPAN_COLORS = {  # compute spans in colours no op uses
    "F": "#8cd17d",
    "B": "#f1ce63",
    "W": "#ffbe7d",
    "opt": "#79706e",
    "idle": "#d0d0d0",
}
_FALLBACK = ("#8c564b", "#bcbd22", "#17becf", "#7f7f7f", "#e377c2")
PREDICTED_COLOR = "#222222"


def _color(name: str, table: Mapping[str, str]) -> str:
    if name in table:
        return table[name]
    return _FALLBACK[sum(map(ord, name)) % len(_FALLBACK)]  # stable per name


def _target(fig, row, col):
    """A new figure, or the given one; plus the row/col keywords for add_trace."""
    if (row is None) != (col is None):
        raise ValueError("pass both row and col (a cell of a subplot grid), or neither")
    if fig is None:
        if row is not None:
            raise ValueError("row/col need fig=: a figure made by make_subplots")
        fig = go.Figure()
    cell = {} if row is None else {"row": row, "col": col}
    return fig, cell


def _add(fig, trace, **cell) -> None:
    """``fig.add_trace``, showing each legend group once (a dashboard draws the same
    op in several cells)."""
    group = trace.legendgroup
    if group and any(
        t.legendgroup == group and t.showlegend is not False for t in fig.data
    ):
        trace.showlegend = False
    fig.add_trace(trace, **cell)


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
    fig, cell = _target(fig, row, col)
    ranks = ranks_of(events)
    by_rank = traffic_by_rank(events, key)
    keys = sorted({k for row_ in by_rank.values() for k in row_})
    x = [f"rank {r}" for r in ranks]
    for k in keys:
        _add(
            fig,
            go.Bar(
                x=x,
                y=[by_rank.get(r, {}).get(k, 0.0) for r in ranks],
                name=k,
                legendgroup=k,
                marker_color=_color(k, OP_COLORS),
                hovertemplate="%{x}<br>" + k + ": %{y:,.0f} B<extra></extra>",
            ),
            **cell,
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
        _add(
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
            **cell,
        )
    fig.update_layout(barmode="stack")
    fig.update_yaxes(title_text="bytes sent", ticksuffix="B", **cell)
    if title and not cell:
        fig.update_layout(title=title)
    return fig


# ---- time against message size ------------------------------------------------------
def _logspace(lo: float, hi: float, n: int = 50) -> list[float]:
    a, b = math.log10(lo), math.log10(hi)
    return [10 ** (a + (b - a) * i / (n - 1)) for i in range(n)]


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
    fig, cell = _target(fig, row, col)
    to_wire = (
        (lambda s: estimate.wire_bytes(op, s, n))
        if op is not None and n is not None
        else (lambda s: s)
    )
    reps = [list(t) if isinstance(t, Iterable) else [float(t)] for t in times]
    mid = summarize_times(reps)
    if any(len(r) > 1 for r in reps):
        _add(
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
            **cell,
        )
    custom = None
    hover = "S = %{x:,.0f} B<br>t = %{y:.3s}s"
    if op is not None and n is not None:
        custom = [
            estimate.bus_bandwidth(op, s, n, t) / 1e9 if t > 0 else 0.0
            for s, t in zip(sizes, mid)
        ]
        hover += "<br>bus bw %{customdata:.3f} GB/s"
    _add(
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
        **cell,
    )
    if fit is not None and len(sizes):
        grid = _logspace(min(sizes), max(sizes))
        _add(
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
            **cell,
        )
        if fit.alpha_s > 0:
            _add(
                fig,
                go.Scatter(
                    x=[grid[0], grid[-1]],
                    y=[fit.alpha_s, fit.alpha_s],
                    mode="lines",
                    name="α (latency term)",
                    legendgroup="alpha",
                    line=dict(color=PREDICTED_COLOR, width=1, dash="dot"),
                ),
                **cell,
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
            _add(
                fig,
                go.Scatter(
                    x=[s for s, _ in slope],
                    y=[t for _, t in slope],
                    mode="lines",
                    name="β·bytes (bandwidth term)",
                    legendgroup="beta",
                    line=dict(color=PREDICTED_COLOR, width=1, dash="dash"),
                ),
                **cell,
            )
    fig.update_xaxes(type="log", title_text="message size S (bytes)", **cell)
    fig.update_yaxes(type="log", title_text="time (s)", **cell)
    if title and not cell:
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
    from plotly.subplots import make_subplots

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


# ---- timeline ---------------------------------------------------------------------
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
        if d and e.get("kind") in ("comm", "span"):
            e = {**e, "t_start": e["t_start"] - d, "t_end": e["t_end"] - d}
        elif d and e.get("kind") == "memory" and "t" in e:
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
    fig, cell = _target(fig, row, col)
    if align:
        events = align_clocks(events)
    timed = [e for e in events if e.get("kind") in ("comm", "span")]
    has_spans = any(e["kind"] == "span" for e in timed)

    def lane(e):
        r = f"rank {e['rank']}"
        if not has_spans:
            return r
        return f"{r} · {'compute' if e['kind'] == 'span' else 'comm'}"

    groups: dict[tuple[str, str], list[dict]] = {}
    for e in timed:
        name = e["op"] if e["kind"] == "comm" else str(e["name"])
        groups.setdefault((e["kind"], name), []).append(e)
    lanes = sorted({lane(e) for e in timed}, key=lambda s: (int(s.split()[1]), s))
    for (kind, name), evs in sorted(groups.items()):
        if kind == "comm":
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
        _add(
            fig,
            go.Bar(
                orientation="h",
                y=[lane(e) for e in evs],
                base=[e["t_start"] * 1e3 for e in evs],
                x=[max(e["t_end"] - e["t_start"], 0.0) * 1e3 for e in evs],
                customdata=custom,
                name=name,
                legendgroup=name,
                marker_color=_color(name, SPAN_COLORS if kind == "span" else OP_COLORS),
                hovertemplate=hover + "<extra>%{y}</extra>",
            ),
            **cell,
        )
    fig.update_xaxes(title_text="time (ms)", **cell)
    fig.update_yaxes(
        categoryorder="array", categoryarray=lanes[::-1], type="category", **cell
    )
    if title and not cell:
        fig.update_layout(title=title)
    return fig


# ---- live figures -------------------------------------------------------------------
class LiveFigure:
    """A ``FigureWidget`` redrawn from telemetry events as they arrive.

    ``build`` is any function ``events -> go.Figure`` (the figures above, with
    keyword arguments bound in ``**build_kwargs``). The widget is built once;
    :meth:`update` adds a batch of events to a bounded window (the newest
    ``window`` events) and redraws inside ``batch_update()`` (one message to the
    browser) at most every ``min_interval`` seconds, so a fast stream of batches
    costs the notebook ~5-10 redraws a second. Call :meth:`flush` after the run to
    draw what the throttle held back. ``cluster.run(fn, on_events=live)`` feeds it
    live: the object is callable.
    """

    def __init__(
        self,
        build: Callable[..., go.Figure] = timeline_figure,
        *,
        window: int = 2000,
        min_interval: float = 0.15,
        clock: Callable[[], float] = time.monotonic,
        **build_kwargs,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1 events, got {window}")
        if min_interval < 0:
            raise ValueError(f"min_interval must be >= 0 seconds, got {min_interval}")
        self.build = build
        self.build_kwargs = build_kwargs
        self.min_interval = min_interval
        self.clock = clock
        self._events: deque = deque(maxlen=window)
        self._last_draw = -math.inf
        self._pending = False
        self.received = 0  # events ever received (the window keeps the newest)
        self.redraws = 0
        self.widget = go.FigureWidget(build([], **build_kwargs))

    @property
    def events(self) -> list[dict]:
        return list(self._events)

    @property
    def window(self) -> int:
        return self._events.maxlen

    def update(self, events) -> bool:
        """Add a batch of events; redraw if the throttle allows. Returns whether it
        redrew."""
        batch = list(events)
        self._events.extend(batch)
        self.received += len(batch)
        self._pending = True
        if self.clock() - self._last_draw < self.min_interval:
            return False
        self.redraw()
        return True

    __call__ = update  # usable as cluster.run(..., on_events=live)

    def clear(self) -> None:
        """Forget every event (a new run starts from an empty window)."""
        self._events.clear()

    def flush(self) -> bool:
        """Draw events held back by the throttle (call once the run returned)."""
        if not self._pending:
            return False
        self.redraw()
        return True

    def redraw(self) -> None:
        new = self.build(list(self._events), **self.build_kwargs)
        w = self.widget
        same_shape = len(w.data) == len(new.data) and all(
            a.type == b.type and a.name == b.name for a, b in zip(w.data, new.data)
        )
        with w.batch_update():
            if same_shape:  # restyle in place: no trace is re-created
                for old, trace in zip(w.data, new.data):
                    old.update(trace.to_plotly_json())
            else:
                w.data = ()
                w.add_traces(list(new.data))
            layout = new.layout.to_plotly_json()
            layout.pop("template", None)  # unchanged, and by far the largest part
            w.layout.update(layout)
        self._last_draw = self.clock()
        self._pending = False
        self.redraws += 1

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


# ---- static export ------------------------------------------------------------------
def find_chromium() -> str | None:
    """The Chromium/Chrome kaleido would use, or ``None``."""
    try:
        from choreographer.browsers.chromium import Chromium

        return Chromium.find_browser(skip_local=False)
    except Exception:  # noqa: BLE001 - choreographer's layout changed: look ourselves
        import shutil

        for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
            if path := shutil.which(name):
                return path
        return None


def save_png(
    fig: go.Figure,
    path,
    *,
    width: int | None = None,
    height: int | None = None,
    scale: float = 1.0,
) -> str:
    """Write ``fig`` as a PNG with kaleido (headless Chromium, offline).

    kaleido 1.x finds Debian's ``/usr/bin/chromium`` by itself; without a Chromium
    this raises ``RuntimeError`` saying how to install one.
    """
    if find_chromium() is None:
        raise RuntimeError(
            "save_png needs Chromium for kaleido: install it (Debian/Ubuntu: "
            "`apt-get install -y chromium`) or run `plotly_get_chrome`"
        )
    if isinstance(fig, go.FigureWidget):
        fig = go.Figure(fig)
    fig.write_image(str(path), format="png", width=width, height=height, scale=scale)
    return str(path)


# ---- tensor parallelism (chapter 04) ------------------------------------------------
TP_RANK_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756",
                  "#72b7b2", "#b279a2", "#ff9da6", "#9d755d"]  # fmt: skip


def tp_split_figure(tp: int, d_in: int = 8, d_out: int = 8) -> go.Figure:
    """Who holds which entries of ``A`` (``d_in × d_out``, ``Y = X·A``) under
    Megatron's column split (left: rank i owns columns i·out/t…) and row split
    (right: rank i owns rows i·in/t…). Each cell is coloured by its owner."""
    from plotly.subplots import make_subplots

    if tp < 1 or d_in % tp or d_out % tp:
        raise ValueError(f"tp={tp} must divide d_in={d_in} and d_out={d_out}")
    scale = []  # a discrete colour scale: one flat band per rank
    for i in range(tp):
        color = TP_RANK_COLORS[i % len(TP_RANK_COLORS)]
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
                marker_color=_color(op, OP_COLORS),
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
        barmode="stack", height=380, yaxis_title="ms per micro-batch", title=title
    )
    return fig


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
    diamonds (same key, same colour), e.g. bytes per rank against tp."""
    fig = go.Figure()
    xs = [str(v) for v in x]
    for i, (name, values) in enumerate(measured.items()):
        color = TP_RANK_COLORS[i % len(TP_RANK_COLORS)]
        fig.add_bar(x=xs, y=list(values), name=f"{name} (measured)",
                    marker_color=color, offsetgroup=str(i))  # fmt: skip
        if name in predicted:
            fig.add_scatter(
                x=xs, y=list(predicted[name]), mode="markers",
                name=f"{name} (predicted)", offsetgroup=str(i),
                marker=dict(symbol="diamond", size=11, color=PREDICTED_COLOR,
                            line=dict(color=color, width=2)),
            )  # fmt: skip
    fig.update_layout(
        barmode="group", scattermode="group", height=360, title=title,
        xaxis_title=xaxis_title, yaxis_title=yaxis_title,
    )  # fmt: skip
    return fig


# ---- data parallelism: loss curves, DDP overlap, buckets, DP memory (chapter 02) -----
DP_MEMORY_COLORS = {
    "params": "#4c78a8",
    "grads": "#f58518",
    "optimizer": "#54a24b",
    "activations": "#b279a2",
    "outputs": "#e45756",
    "buffers": "#9d755d",
}


def step_records(events) -> list[dict]:
    """The per-step records (events of kind ``"step"`` that :mod:`dtlab.train`
    emits), sorted by rank and step."""
    out = [e for e in events if e.get("kind") == "step"]
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
    records themselves). ``key="local_loss"`` shows each rank's own micro-batches
    instead of the global-batch loss. ``reference``: the single-process losses of
    :func:`dtlab.reference.train_reference`, dashed. Usable with
    :class:`LiveFigure` (``LiveFigure(loss_figure)``)."""
    fig, cell = _target(fig, row, col)
    records = step_records(events)
    for rank in ranks_of(records) if records else []:
        mine = [e for e in records if e["rank"] == rank]
        _add(
            fig,
            go.Scatter(
                x=[e["step"] for e in mine],
                y=[e[key] for e in mine],
                mode="lines+markers",
                marker_size=4,
                name=f"rank {rank}",
                legendgroup=f"rank {rank}",
            ),
            **cell,
        )
    if reference is not None:
        _add(
            fig,
            go.Scatter(
                x=list(range(len(reference))),
                y=list(reference),
                mode="lines",
                line={"dash": "dash", "color": PREDICTED_COLOR},
                name="reference (1 process)",
                legendgroup="reference",
            ),
            **cell,
        )
    fig.update_xaxes(title_text="step", **cell)
    fig.update_yaxes(title_text=key.replace("_", " "), **cell)
    if title and not cell:
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
    fig, cell = _target(fig, row, col)
    buckets = [e for e in events if e.get("kind") == "ddp_bucket"]
    if step is None and buckets:
        step = max(e["step"] for e in buckets)
    chosen = [
        e
        for e in events
        if e.get("step") == step
        and (e.get("kind") == "ddp_bucket" or e.get("kind") == "span")
    ]
    starts: dict[int, float] = {}
    for e in chosen:
        starts[e["rank"]] = min(starts.get(e["rank"], math.inf), e["t_start"])
    lanes = []
    for rank in sorted(starts):
        lanes += [f"rank {rank} · compute", f"rank {rank} · buckets"]
    groups: dict[str, list[dict]] = {}
    for e in chosen:
        name = "all_reduce" if e["kind"] == "ddp_bucket" else str(e["name"])
        groups.setdefault(name, []).append(e)
    for name, evs in groups.items():
        is_bucket = name == "all_reduce"
        lane = "buckets" if is_bucket else "compute"
        _add(
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
                marker_color=_color(name, OP_COLORS if is_bucket else SPAN_COLORS),
                marker_line_width=1 if is_bucket else 0,
                marker_line_color="white",
                hovertemplate=(
                    ("bucket %{customdata[0]}: %{customdata[1]:,.0f} B<br>"
                     if is_bucket else name + "<br>")
                    + "%{base:.2f} ms + %{x:.2f} ms<extra>%{y}</extra>"
                ),
            ),
            **cell,
        )  # fmt: skip
    fig.update_xaxes(title_text="ms from the start of the step", **cell)
    fig.update_yaxes(
        categoryorder="array", categoryarray=lanes[::-1], type="category", **cell
    )
    if not cell:
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
    from plotly.subplots import make_subplots

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
        _add(
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
            _add(
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
    cats = [k for k in DP_MEMORY_COLORS if any(k in r for r in report)]
    for cat in cats:
        fig.add_bar(
            x=[f"{label} {r[label]}" for r in report],
            y=[r.get(cat, 0) / 1e6 for r in report],
            name=cat,
            marker_color=DP_MEMORY_COLORS[cat],
        )
    fig.update_layout(
        barmode="stack",
        yaxis_title="MB (1e6 bytes)",
        title=title or "Memory per device",
        height=360,
    )
    return fig


# ---- pipeline parallelism: schedules, bubble, activations in flight (chapter 05) ---
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
    fig, cell = _target(fig, row, col)
    spans = [e for e in spans if e.get("name") in ("F", "B", "W", "idle")]
    stages = sorted({e["stage"] for e in spans})
    chunked = any(e.get("chunk") for e in spans)
    for name in ("F", "B", "W", "idle"):
        evs = [e for e in spans if e["name"] == name]
        if not evs:
            continue
        labels = [
            ""
            if name == "idle"
            else f"{e['microbatch']}" + (f".{e['chunk']}" if chunked else "")
            for e in evs
        ]
        _add(
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
                marker_color=_color(name, SPAN_COLORS),
                marker_line_width=0.5,
                marker_line_color="white",
                hovertemplate=name
                + " microbatch %{text}<br>%{base:.2f} + %{x:.2f} "
                + unit
                + "<extra>%{y}</extra>",
            ),
            **cell,
        )
    fig.update_xaxes(title_text=f"time ({unit})", **cell)
    order = [f"stage {s}" for s in stages][::-1]
    fig.update_yaxes(
        categoryorder="array", categoryarray=order, type="category", **cell
    )
    if not cell:
        fig.update_layout(barmode="overlay", title=title, height=120 + 45 * len(stages))
    return fig


def pipeline_ideal_vs_measured(
    ideal, measured, *, title: str | None = None, bubbles=None
) -> go.Figure:
    """Two Gantt charts on one time axis: the simulated ideal above, the measured
    step below. ``bubbles``: optional ``(ideal, measured)`` fractions for the
    subplot titles."""
    from plotly.subplots import make_subplots

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
        if e.get("kind") == "span"
        and e.get("name") == "step"
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
        if e.get("kind") == "memory"
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


# ---- ZeRO: memory per rank and traffic per stage (chapter 03) -----------------------
ZERO_CATEGORIES = {  # device categories, then what CPU offload keeps on the host
    "params": "#4c78a8",
    "grads": "#f58518",
    "optimizer": "#54a24b",
    "activations": "#b279a2",
    "buffers": "#9d755d",
    "host_params": "#9ecae9",
    "host_grads": "#ffbf79",
    "host_optimizer": "#88d27a",
}


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
    for cat, color in ZERO_CATEGORIES.items():
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
            fig.add_bar(x=xs, y=y, name=cat, marker_color=ZERO_CATEGORIES[cat])
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

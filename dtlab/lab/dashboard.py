"""The live dashboard of a training run, and side-by-side comparisons of runs.

Taught in chapter 07 (3D parallelism); the control panel of :mod:`dtlab.lab.widgets`
feeds it.

    from dtlab.lab.dashboard import Dashboard
    board = Dashboard(config, world_size=4)
    display(board.widget)
    run = start_run(cluster, config, on_events=board)   # dtlab.lab.training
    ...
    compare(run_a, run_b).show()      # two layouts: loss, memory, bytes, step time

Five views, each a plotly ``FigureWidget`` redrawn in place (``batch_update``) while
the ranks train:

- **loss** against step, one line per rank (every rank reports the global-batch loss,
  so the lines lie on each other when the ranks agree);
- **memory per rank**, stacked by category (params, grads, optimizer, activations,
  buffers), the measured bar next to the prediction of
  :func:`dtlab.estimate.layout_memory` for that rank's pipeline stage;
- **the pipeline timeline**: the compute spans (F, B, W, opt, idle) of the newest
  step on every rank; grey ``idle`` bars are the bubble;
- **traffic per step** by group and op (``dp · all_reduce``, ``pp · send``, ...):
  the bytes one rank puts on the wire per step, averaged over ranks, with
  :func:`dtlab.estimate.layout_traffic`'s total as a marker;
- **rank × rank traffic**: who sent how many bytes to whom over the whole run. A
  ring collective sends only to the next rank of its group's ring; a pipeline send
  goes to the next stage (activations) or the previous one (gradients).

Every view keeps a bounded window (the newest steps), and all of them together are
redrawn at most ``1 / min_interval`` times a second however fast events arrive.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from dtlab.lab import plots
from dtlab.topology import Layout

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
SPAN_NAMES = ("F", "B", "W", "opt", "idle")
AXES = ("dp", "tp", "pp", "world")  # the groups of a 3D layout, then the whole world
AXIS_COLORS = {"dp": "#4c78a8", "tp": "#f58518", "pp": "#54a24b", "world": "#9d755d"}


# ---- predictions for a config (the same ones ``dtlab run`` prints) -------------------
def predicted_memory(config, world_size: int) -> dict[int, dict[str, float]]:
    """``{rank: bytes by category}`` from :func:`dtlab.run.predicted_memory`
    (:func:`dtlab.estimate.layout_memory`), each rank at its own pipeline stage."""
    from dtlab import run

    layout = config.resolve_layout(world_size)
    by_stage = {
        s: run.predicted_memory(config, layout, stage=s) for s in range(layout.pp)
    }
    return {r: by_stage[layout.coords(r)["pp"]] for r in range(world_size)}


def predicted_traffic(config, world_size: int) -> dict[str, float]:
    """Wire bytes one rank sends per step by axis (the busiest rank of each), from
    :func:`dtlab.run.predicted_traffic` (:func:`dtlab.estimate.layout_traffic`)."""
    from dtlab import run

    return dict(run.predicted_traffic(config, config.resolve_layout(world_size)))


# ---- who sends to whom -----------------------------------------------------------
def _group(axis: str, rank: int, layout: Layout) -> list[int]:
    if axis in ("dp", "tp", "pp"):
        return layout.group_of(axis, rank)
    return list(range(layout.world_size))  # "world", or a group we cannot name


def peer_of(event: Mapping, layout: Layout) -> int | None:
    """The rank that receives the wire bytes of one comm event of ``event['rank']``.

    A ring collective (all-reduce, reduce-scatter, all-gather, and broadcast as
    pipelined along the ring) sends only to the next rank of its group's ring. A
    send goes to ``event['peer']`` when recorded, else along the pipeline: the
    activations (tag ``act``) to the next stage, the gradients (``grad``) to the
    previous one. Receives and barriers put no payload on the wire: ``None``.
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


def traffic_matrix(events, layout: Layout) -> list[list[float]]:
    """``m[src][dst]``: wire bytes ``src`` sent to ``dst`` (:func:`peer_of`)."""
    n = layout.world_size
    m = [[0.0] * n for _ in range(n)]
    for e in events:
        if e.get("kind") == "comm":
            dst = peer_of(e, layout)
            if dst is not None:
                m[e["rank"]][dst] += e["wire_bytes"]
    return m


def traffic_by_step(events) -> dict[int, dict[tuple[str, str], float]]:
    """``{step: {(axis, op): wire bytes}}`` summed over ranks."""
    out: dict[int, dict[tuple[str, str], float]] = {}
    for e in events:
        if e.get("kind") == "comm" and e.get("wire_bytes"):
            row = out.setdefault(e["step"], {})
            key = (str(e.get("axis")), e["op"])
            row[key] = row.get(key, 0.0) + e["wire_bytes"]
    return out


def _axis_order(key: tuple[str, str]) -> tuple:
    axis, op = key
    return (AXES.index(axis) if axis in AXES else len(AXES), axis, op)


# ---- the five figures, from plain data -------------------------------------------
# Each view is a *spec*: plain dicts of traces and layout. A static figure is built
# from it once (``*_view``); the live dashboard applies a new spec to its widget's
# existing traces in place, which costs far less than building a plotly Figure per
# redraw (measured: ~5x on a loaded 2-core machine).
Spec = tuple[list[dict], dict]
_MARGIN = dict(t=50, b=40, l=50, r=10)


def _figure(spec: Spec) -> go.Figure:
    traces, layout = spec
    return go.Figure(data=[dict(t) for t in traces], layout=layout)


def loss_spec(steps: Mapping[int, Sequence[tuple[int, float]]]) -> Spec:
    """Loss against step, one line per rank: ``steps[rank] = [(step, loss), ...]``."""
    traces = [
        dict(
            type="scatter",
            name=f"rank {rank}",
            x=[s for s, _ in steps[rank]],
            y=[v for _, v in steps[rank]],
            mode="lines+markers",
            marker=dict(size=4),
        )
        for rank in sorted(steps)
    ]
    layout = dict(
        title=dict(text="Loss (global batch) per rank"),
        xaxis=dict(title=dict(text="step")),
        yaxis=dict(title=dict(text="loss")),
        height=320,
        margin=_MARGIN,
    )
    return traces, layout


def memory_spec(
    measured: Mapping[int, Mapping], predicted: Mapping[int, Mapping] | None = None
) -> Spec:
    """Per-rank stacked memory bars: each rank's latest ``memory`` event next to the
    prediction for its stage (``predicted[rank]``), in kB."""
    ranks = sorted(set(measured) | set(predicted or {}))
    x: list[list[str]] = [[], []]
    rows = []
    for r in ranks:
        for what, source in (("measured", measured), ("predicted", predicted or {})):
            if what == "measured" or predicted is not None:
                x[0].append(f"rank {r}")
                x[1].append(what)
                rows.append(source.get(r, {}))
    traces = [
        dict(
            type="bar",
            name=cat,
            x=x,
            y=[row.get(cat, 0) / 1e3 for row in rows],
            marker=dict(
                color=plots.DP_MEMORY_COLORS[cat],
                opacity=[0.55 if w == "predicted" else 1 for w in x[1]],
            ),
            hovertemplate="%{x}<br>" + cat + ": %{y:,.1f} kB<extra></extra>",
        )
        for cat in MEMORY_CATEGORIES
    ]
    layout = dict(
        barmode="stack",
        title=dict(text="Memory per rank: measured vs estimate.layout_memory"),
        yaxis=dict(title=dict(text="kB (1e3 bytes)")),
        height=320,
        margin=_MARGIN,
    )
    return traces, layout


def timeline_spec(spans: Sequence[Mapping], lanes: Sequence[str]) -> Spec:
    """Compute spans per rank as a Gantt chart (ms from the first span shown);
    ``lanes``: one label per rank, in rank order. Always the same five traces (one
    per span name), so live redraws restyle them in place."""
    t0 = min((e["t_start"] for e in spans), default=0.0)
    traces = []
    for name in SPAN_NAMES:
        evs = [e for e in spans if e.get("name") == name]
        traces.append(
            dict(
                type="bar",
                orientation="h",
                name=name,
                y=[lanes[e["rank"]] for e in evs],
                base=[(e["t_start"] - t0) * 1e3 for e in evs],
                x=[max(e["t_end"] - e["t_start"], 0.0) * 1e3 for e in evs],
                text=[
                    "" if e.get("microbatch") is None else str(e["microbatch"])
                    for e in evs
                ],
                textposition="inside",
                marker=dict(
                    color=plots.SPAN_COLORS[name], line=dict(width=0.5, color="white")
                ),
                hovertemplate=name + " microbatch %{text}<br>%{base:.1f} ms + "
                "%{x:.1f} ms<extra>%{y}</extra>",
            )
        )
    steps = sorted({e["step"] for e in spans})
    if not steps:
        what = "no step yet"
    elif len(steps) == 1:
        what = f"step {steps[0]}"
    else:
        what = f"steps {steps[0]}-{steps[-1]}"
    layout = dict(
        barmode="overlay",
        title=dict(text=f"Compute per rank, {what} (idle = bubble)"),
        xaxis=dict(title=dict(text="ms")),
        yaxis=dict(
            type="category", categoryorder="array", categoryarray=list(lanes)[::-1]
        ),
        height=140 + 26 * len(lanes),
        margin=dict(t=50, b=40, l=150, r=10),
    )
    return traces, layout


def traffic_spec(
    per_step: Mapping[int, Mapping[tuple[str, str], float]],
    world_size: int,
    predicted: Mapping[str, float] | None = None,
) -> Spec:
    """Bytes one rank sends per step (the ranks' sum / world size), stacked by
    ``group · op``; ``predicted`` (bytes per rank by axis) as a marker on each
    step."""
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
                    color=plots.OP_COLORS.get(op, AXIS_COLORS.get(axis)),
                    line=dict(color=AXIS_COLORS.get(axis, "#7f7f7f"), width=2),
                ),
                hovertemplate=f"{axis} · {op}: "
                + "%{y:,.1f} kB<extra>step %{x}</extra>",
            )
        )
    if predicted is not None:
        total = sum(predicted.get(a, 0.0) for a in ("dp", "tp", "pp"))
        parts = ", ".join(f"{a} {predicted.get(a, 0) / 1e3:,.1f}" for a in AXES[:3])
        traces.append(
            dict(
                type="scatter",
                name="layout_traffic",
                x=steps,
                y=[total / 1e3] * len(steps),
                mode="markers",
                marker=dict(symbol="diamond", size=9, color=plots.PREDICTED_COLOR),
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
    return traces, layout


def matrix_spec(matrix: Sequence[Sequence[float]], labels: Sequence[str]) -> Spec:
    """Rank × rank heatmap of the bytes sent (row: sender, column: receiver)."""
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
    return [trace], layout


def loss_view(steps) -> go.Figure:
    """:func:`loss_spec` as a figure."""
    return _figure(loss_spec(steps))


def memory_view(measured, predicted=None) -> go.Figure:
    """:func:`memory_spec` as a figure."""
    return _figure(memory_spec(measured, predicted))


def timeline_view(spans, lanes) -> go.Figure:
    """:func:`timeline_spec` as a figure."""
    return _figure(timeline_spec(spans, lanes))


def traffic_view(per_step, world_size, predicted=None) -> go.Figure:
    """:func:`traffic_spec` as a figure."""
    return _figure(traffic_spec(per_step, world_size, predicted))


def matrix_view(matrix, labels) -> go.Figure:
    """:func:`matrix_spec` as a figure."""
    return _figure(matrix_spec(matrix, labels))


class LiveView:
    """One ``FigureWidget`` kept in step with a spec function: :meth:`redraw` calls
    ``spec()`` and writes into the existing traces, inside one ``batch_update()``
    (one message to the browser), only the properties that changed since the last
    redraw: mostly the data arrays. Plotly validates every property it is given,
    and that, not drawing, is what a redraw costs. Only when the traces themselves
    change (a new op, a new rank) are they replaced."""

    def __init__(self, spec):
        self.spec = spec
        self._last: Spec = spec()
        self.widget = go.FigureWidget(_figure(self._last))
        self.redraws = 0

    def redraw(self) -> None:
        traces, layout = self.spec()
        old_traces, old_layout = self._last
        w = self.widget
        with w.batch_update():
            if [(t["type"], t["name"]) for t in traces] != [
                (t["type"], t["name"]) for t in old_traces
            ]:
                w.data = ()
                w.add_traces([dict(t) for t in traces])
            else:
                for widget_trace, old, new in zip(w.data, old_traces, traces):
                    changed = {k: v for k, v in new.items() if old.get(k) != v}
                    if changed:
                        widget_trace.update(changed)
            changed = {k: v for k, v in layout.items() if old_layout.get(k) != v}
            if changed:
                w.layout.update(changed)
        self._last = (traces, layout)
        self.redraws += 1


def _lanes(layout: Layout) -> list[str]:
    out = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        out.append(f"rank {r} (pp{c['pp']} dp{c['dp']} tp{c['tp']})")
    return out


# ---- the live dashboard ----------------------------------------------------------
class Dashboard:
    """Five live views of one run, fed with telemetry events.

    Pass it as ``on_events`` (it is callable) to :func:`dtlab.lab.training.start_run`
    or ``cluster.run``. :meth:`update` folds a batch into bounded state (the newest
    ``loss_window`` steps per rank, ``traffic_steps`` steps of traffic, the spans of
    the newest ``timeline_steps`` steps, the latest memory sample per rank, an N×N
    matrix) and redraws every view at most every ``min_interval`` seconds.
    :attr:`updates` logs each redraw: wall-clock time, newest step, events so far,
    and why (``update``: a batch the throttle let through; ``flush``, ``reset``).
    """

    def __init__(
        self,
        config=None,
        world_size: int | None = None,
        *,
        min_interval: float = 0.2,
        loss_window: int = 500,
        traffic_steps: int = 30,
        timeline_steps: int = 1,
        span_window: int = 5000,
        clock=time.monotonic,
    ):
        if min_interval < 0:
            raise ValueError(f"min_interval must be >= 0 seconds, got {min_interval}")
        for name, value in (
            ("loss_window", loss_window),
            ("traffic_steps", traffic_steps),
            ("timeline_steps", timeline_steps),
            ("span_window", span_window),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.min_interval = min_interval
        self.loss_window = loss_window
        self.traffic_steps = traffic_steps
        self.timeline_steps = timeline_steps
        self.span_window = span_window
        self.clock = clock
        self._lock = threading.RLock()
        self.updates: deque = deque(maxlen=10_000)
        self.views: dict[str, LiveView] = {}  # made after the state
        self.reset(config, world_size)
        self.views = {
            "loss": LiveView(lambda: loss_spec(self._steps)),
            "memory": LiveView(lambda: memory_spec(self._memory, self._pred_memory)),
            "timeline": LiveView(lambda: timeline_spec(self._timeline(), self._lanes)),
            "traffic": LiveView(
                lambda: traffic_spec(
                    self._traffic, self.layout.world_size, self._pred_traffic
                )
            ),
            "matrix": LiveView(lambda: matrix_spec(self._matrix, self._labels)),
        }
        self._widget = None

    # ---- state ------------------------------------------------------------------
    def reset(self, config=None, world_size: int | None = None) -> None:
        """Forget the previous run; set up for ``config`` on ``world_size`` ranks
        (predictions are computed here, once)."""
        with self._lock:
            self.config = config
            self.world_size = world_size
            self.layout = (
                config.resolve_layout(world_size)
                if config is not None and world_size
                else Layout(dp=world_size or 1)
            )
            n = self.layout.world_size
            self._steps: dict[int, deque] = {}
            self._memory: dict[int, dict] = {}
            self._spans: deque = deque(maxlen=self.span_window)
            self._traffic: OrderedDict = OrderedDict()
            self._matrix = [[0.0] * n for _ in range(n)]
            self._lanes = _lanes(self.layout)
            self._labels = [f"r{r}" for r in range(n)]
            self._pred_memory = self._pred_traffic = None
            if config is not None and world_size:
                self._pred_memory = predicted_memory(config, world_size)
                self._pred_traffic = predicted_traffic(config, world_size)
            self.received = 0
            self.newest_step = -1
            self._last_draw = -math.inf
            self._pending = False
            self.updates.clear()
        if getattr(self, "views", None):
            self.redraw("reset")

    def update(self, events) -> bool:
        """Fold a batch of events in; redraw if the throttle allows. Returns whether
        it redrew."""
        with self._lock:
            for e in events:
                self._fold(e)
            self._pending = True
            if self.clock() - self._last_draw < self.min_interval:
                return False
            self.redraw("update")
            return True

    __call__ = update

    def _fold(self, e: Mapping) -> None:
        self.received += 1
        kind, rank = e.get("kind"), e.get("rank")
        if kind == "step":
            window = self._steps.setdefault(rank, deque(maxlen=self.loss_window))
            window.append((e["step"], e["loss"]))
            self.newest_step = max(self.newest_step, e["step"])
        elif kind == "memory":
            self._memory[rank] = dict(e)
        elif kind == "span" and e.get("name") in SPAN_NAMES:
            self._spans.append(e)
        elif kind == "comm" and e.get("wire_bytes"):
            row = self._traffic.setdefault(e["step"], {})
            key = (str(e.get("axis")), e["op"])
            row[key] = row.get(key, 0.0) + e["wire_bytes"]
            while len(self._traffic) > self.traffic_steps:
                self._traffic.popitem(last=False)  # the oldest step first
            if rank is not None and rank < len(self._matrix):
                dst = peer_of(e, self.layout)
                if dst is not None and dst < len(self._matrix):
                    self._matrix[rank][dst] += e["wire_bytes"]

    def _timeline(self) -> list[dict]:
        steps = sorted({e["step"] for e in self._spans})[-self.timeline_steps :]
        keep = set(steps)
        return [e for e in self._spans if e["step"] in keep]

    # ---- drawing ----------------------------------------------------------------
    def redraw(self, why: str = "redraw") -> None:
        """Redraw every view now, in place (``why`` is logged in :attr:`updates`)."""
        with self._lock:
            for view in self.views.values():
                view.redraw()
            self._last_draw = self.clock()
            self._pending = False
            self.updates.append(
                {
                    "t": time.time(),
                    "step": self.newest_step,
                    "received": self.received,
                    "why": why,
                }
            )

    def flush(self) -> bool:
        """Draw what the throttle held back (call once the run has ended)."""
        with self._lock:
            if not self._pending:
                return False
            self.redraw("flush")
            return True

    @property
    def figures(self) -> dict[str, go.FigureWidget]:
        return {name: view.widget for name, view in self.views.items()}

    @property
    def widget(self):
        """The five views in one ipywidgets box (built once)."""
        if self._widget is None:
            import ipywidgets as W

            f = self.figures
            self._widget = W.VBox(
                [
                    W.HBox([f["loss"], f["memory"]]),
                    f["timeline"],
                    W.HBox([f["traffic"], f["matrix"]]),
                ]
            )
        return self._widget

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def figure(self) -> go.Figure:
        """The dashboard as one static figure (a 3 x 2 grid; for PNGs and reports)."""
        return dashboard_figure(
            self._steps,
            self._memory,
            self._pred_memory,
            self._timeline(),
            self._lanes,
            self._traffic,
            self._pred_traffic,
            self._matrix,
            self._labels,
            self.layout,
        )


def dashboard_figure(
    steps, memory, pred_memory, spans, lanes, traffic, pred_traffic, matrix, labels,
    layout: Layout, *, title: str | None = None,
) -> go.Figure:  # fmt: skip
    """The five views in one ``make_subplots`` grid."""
    from plotly.subplots import make_subplots

    views = {
        (1, 1): loss_view(steps),
        (1, 2): memory_view(memory, pred_memory),
        (2, 1): timeline_view(spans, lanes),
        (3, 1): traffic_view(traffic, layout.world_size, pred_traffic),
        (3, 2): matrix_view(matrix, labels),
    }
    fig = make_subplots(
        rows=3,
        cols=2,
        specs=[[{}, {}], [{"colspan": 2}, None], [{}, {}]],
        subplot_titles=[views[k].layout.title.text for k in sorted(views)],
        vertical_spacing=0.09,
        horizontal_spacing=0.08,
    )
    for (row, col), view in sorted(views.items()):
        for trace in view.data:
            if trace.type == "heatmap":
                trace.colorbar.update(len=0.28, y=0.13)
            plots._add(fig, trace, row=row, col=col)
        fig.update_xaxes(title_text=view.layout.xaxis.title.text, row=row, col=col)
        fig.update_yaxes(title_text=view.layout.yaxis.title.text, row=row, col=col)
    fig.update_yaxes(
        type="category", categoryorder="array", categoryarray=lanes[::-1], row=2, col=1
    )
    fig.update_yaxes(autorange="reversed", row=3, col=2)
    fig.update_layout(
        barmode="stack",
        height=1100,
        width=1500,
        title=title or f"dtlab: live dashboard of a {layout} run",
    )
    return fig


# ---- comparing runs --------------------------------------------------------------
def _world(run) -> int:
    return len(run.records)


def run_summary(run, name: str | None = None) -> dict:
    """One row of numbers for a finished :class:`dtlab.lab.training.TrainRun`:
    final loss, memory of the most loaded rank (bytes by category and in total),
    wire bytes one rank sends per step by axis (mean over ranks and over steps
    after the first, which also holds the start-up broadcasts), and the median step
    time (the slowest rank's, per step)."""
    n = _world(run)
    layout = run.config.resolve_layout(n)
    events = run.events
    memory = plots.latest_memory(events)
    totals = {r: sum(m.get(c, 0) for c in MEMORY_CATEGORIES) for r, m in memory.items()}
    top = max(totals, key=totals.get) if totals else None
    per_step = traffic_by_step(events)
    steady = [s for s in per_step if s > 0] or list(per_step)
    by_axis = {a: 0.0 for a in AXES}
    for s in steady:
        for (axis, _op), b in per_step[s].items():
            by_axis[axis if axis in by_axis else "world"] += b
    by_axis = {a: b / max(len(steady), 1) / n for a, b in by_axis.items()}
    times = [
        max(recs[i]["time_s"] for recs in run.records)
        for i in range(min(len(r) for r in run.records))
    ]
    step_s = statistics.median(times[1:] or times) if times else float("nan")
    return {
        "name": name or str(layout),
        "layout": str(layout),
        "strategy": run.config.strategy,
        "steps": len(run.records[0]),
        "final_loss": run.losses()[-1] if run.records[0] else float("nan"),
        "memory": dict(memory.get(top, {})) if top is not None else {},
        "memory_bytes": totals.get(top, 0),
        "bytes_per_step": by_axis,
        "wire_bytes": sum(by_axis.values()),
        "step_ms": step_s * 1e3,
    }


def compare_table(runs: Sequence, names: Sequence[str] | None = None) -> list[dict]:
    """:func:`run_summary` of each run."""
    names = list(names) if names is not None else [None] * len(runs)
    if len(names) != len(runs):
        raise ValueError(f"{len(runs)} runs but {len(names)} names: give one each")
    return [run_summary(r, n) for r, n in zip(runs, names)]


def table_figure(rows: Sequence[Mapping], *, title: str | None = None) -> go.Figure:
    """The rows of :func:`compare_table` as a plotly table."""
    header = ["run", "strategy", "final loss", "memory kB (max rank)", "dp kB/step",
              "tp kB/step", "pp kB/step", "other kB/step", "ms/step"]  # fmt: skip
    cells = [
        [r["name"] for r in rows],
        [r["strategy"] for r in rows],
        [f"{r['final_loss']:.4f}" for r in rows],
        [f"{r['memory_bytes'] / 1e3:,.1f}" for r in rows],
        *[
            [f"{r['bytes_per_step'][a] / 1e3:,.1f}" for r in rows]
            for a in ("dp", "tp", "pp", "world")
        ],
        [f"{r['step_ms']:.1f}" for r in rows],
    ]
    fig = go.Figure(go.Table(header=dict(values=header), cells=dict(values=cells)))
    fig.update_layout(
        height=80 + 30 * len(rows),
        margin=dict(t=40, b=10, l=10, r=10),
        title=title or "Runs side by side",
    )
    return fig


def compare(run_a, run_b, names: Sequence[str] | None = None) -> go.Figure:
    """Two runs side by side: loss per step, memory of the most loaded rank by
    category, bytes per step by axis, median step time, and the table of
    :func:`compare_table` under them."""
    from plotly.subplots import make_subplots

    runs = [run_a, run_b]
    rows = compare_table(runs, names)
    labels = [r["name"] for r in rows]
    if labels[0] == labels[1]:
        labels = [f"{labels[0]} (a)", f"{labels[1]} (b)"]
        for row, label in zip(rows, labels):
            row["name"] = label
    fig = make_subplots(
        rows=3,
        cols=2,
        specs=[[{}, {}], [{}, {}], [{"type": "table", "colspan": 2}, None]],
        row_heights=[0.38, 0.38, 0.24],
        subplot_titles=[
            "loss per step",
            "memory of the most loaded rank (kB)",
            "kB one rank sends per step, by axis",
            "step time (ms, median)",
        ],
        vertical_spacing=0.1,
    )
    for run, label in zip(runs, labels):
        fig.add_scatter(
            x=list(range(len(run.losses()))),
            y=run.losses(),
            mode="lines+markers",
            name=label,
            legendgroup=label,
            row=1,
            col=1,
        )
    for cat in MEMORY_CATEGORIES:
        plots._add(
            fig,
            go.Bar(
                x=labels,
                y=[r["memory"].get(cat, 0) / 1e3 for r in rows],
                name=cat,
                legendgroup=cat,
                marker_color=plots.DP_MEMORY_COLORS[cat],
            ),
            row=1,
            col=2,
        )
    for axis in AXES:
        plots._add(
            fig,
            go.Bar(
                x=labels,
                y=[r["bytes_per_step"][axis] / 1e3 for r in rows],
                name=f"{axis} traffic",
                legendgroup=f"axis {axis}",
                marker_color=AXIS_COLORS[axis],
            ),
            row=2,
            col=1,
        )
    fig.add_bar(
        x=labels,
        y=[r["step_ms"] for r in rows],
        name="ms/step",
        marker_color=plots.PREDICTED_COLOR,
        row=2,
        col=2,
    )
    table = table_figure(rows)
    fig.add_trace(table.data[0], row=3, col=1)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_layout(
        barmode="stack",
        height=900,
        title=f"{labels[0]} vs {labels[1]}",
    )
    return fig


# ---- where the ranks sit -----------------------------------------------------------
def placement_figure(
    layout: Layout, gpus_per_node: int, *, title: str | None = None
) -> go.Figure:
    """Ranks on a node × GPU grid, Megatron's way (rank ``r`` on GPU ``r % g`` of
    node ``r // g``; tp fastest, then dp, then pp): each cell coloured by pipeline
    stage and labelled with the rank and its coordinates. A tensor-parallel group
    stays inside one node exactly when ``tp`` divides ``gpus_per_node``."""
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int):
        raise ValueError(f"gpus_per_node must be a positive integer: {gpus_per_node!r}")
    if gpus_per_node < 1 or layout.world_size % gpus_per_node:
        raise ValueError(
            f"{layout.world_size} ranks do not fill nodes of {gpus_per_node} GPUs: "
            "use a gpus_per_node that divides the world size"
        )
    nodes = layout.world_size // gpus_per_node
    z, text = [], []
    for node in range(nodes):
        zrow, trow = [], []
        for gpu in range(gpus_per_node):
            rank = node * gpus_per_node + gpu
            c = layout.coords(rank)
            zrow.append(c["pp"])
            trow.append(f"r{rank}<br>pp{c['pp']} dp{c['dp']} tp{c['tp']}")
        z.append(zrow)
        text.append(trow)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"GPU {g}" for g in range(gpus_per_node)],
            y=[f"node {n}" for n in range(nodes)],
            text=text,
            texttemplate="%{text}",
            textfont=dict(size=10 if gpus_per_node <= 8 else 8),
            colorscale="Tealgrn",
            colorbar=dict(title="pp stage"),
            xgap=3,
            ygap=3,
            hovertemplate="%{y}, %{x}<br>%{text}<extra></extra>",
        )
    )
    inside = gpus_per_node % layout.tp == 0
    fig.update_layout(
        title=title
        or f"{layout} on {nodes} node(s) × {gpus_per_node} GPUs: tp groups "
        + ("inside a node" if inside else "CROSS nodes"),
        yaxis=dict(autorange="reversed"),
        height=110 + 60 * nodes,
        margin=dict(t=50, b=30, l=70, r=10),
    )
    return fig

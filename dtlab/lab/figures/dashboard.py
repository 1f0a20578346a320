"""The live dashboard of a training run (chapter 07, 3D parallelism); the control
panel of :mod:`dtlab.lab.widgets` feeds it.

    from dtlab.lab.figures.dashboard import Dashboard
    board = Dashboard(config, world_size=4)
    display(board.widget)
    run = start_run(cluster, config, on_events=board)   # dtlab.lab.kernel.training

Five views (six for a mixture of experts), each a
:class:`~dtlab.lab.figures.live.LiveFigure` redrawn in place while the ranks train:

- **loss** against step, one line per rank (every rank reports the global-batch loss,
  so the lines lie on each other when the ranks agree:
  :func:`dtlab.lab.figures.data_parallel.loss_figure`);
- **memory per rank**, stacked by category, the measured bar next to the prediction
  of :func:`dtlab.estimate.layout_memory` for that rank's pipeline stage;
- **the pipeline timeline**: the compute spans (F, B, W, opt, idle) of the newest
  step on every rank; grey ``idle`` bars are the bubble;
- **traffic per step** by group and op (``dp · all_reduce``, ``pp · send``, ...)
  next to :func:`dtlab.estimate.layout_traffic`'s total, and
- **rank × rank traffic**: who sent how many bytes to whom over the whole run
  (both from :mod:`dtlab.lab.figures.traffic`): the rings of dp and tp, the
  pipeline's hand-offs, ring attention's cp ring and the all-to-all blocks of
  Ulysses and expert parallelism (chapter 11), and
- for a mixture of experts, **tokens per expert** on each rank in the newest step,
  with the assignments the capacity dropped (from the ``moe`` events).

The dashboard folds every event into bounded state (the newest steps of each view)
and redraws all the views together at most ``1 / min_interval`` times a second,
however fast events arrive. Its own four views are built as plotly figure dicts
(``{"data": [...], "layout": {...}}``; ``go.Figure(d)`` is the figure): building a
``go.Figure`` validates every property, which is most of what a redraw costs
(measured on a 2-core machine: 13 ms per redraw of the five views with
``go.Figure`` builders, 6 ms with dicts).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab.events import MEMORY_CATEGORIES, Kind
from dtlab.lab.figures.base import COMPUTE_SPANS, MEMORY_COLORS, SPAN_COLORS, add_trace
from dtlab.lab.figures.data_parallel import loss_figure
from dtlab.lab.figures.live import LiveFigure
from dtlab.lab.figures.moe import add_routing, experts_figure
from dtlab.lab.figures.throttle import Throttle
from dtlab.lab.figures.traffic import (
    step_traffic_figure,
    traffic_by_step,
    traffic_matrix,
    traffic_matrix_figure,
)
from dtlab.topology import Layout

LOSS_TITLE = "Loss (global batch) per rank"


# ---- predictions for a config (the same ones ``dtlab run`` prints) -------------------
def predicted_memory(config, world_size: int) -> dict[int, dict[str, float]]:
    """``{rank: bytes by category}`` from :func:`dtlab.measure.predicted_memory`
    (:func:`dtlab.estimate.layout_memory`), each rank at its own pipeline stage."""
    from dtlab import measure

    layout = config.resolve_layout(world_size)
    by_stage = {
        s: measure.predicted_memory(config, layout, stage=s) for s in range(layout.pp)
    }
    return {r: by_stage[layout.coords(r)["pp"]] for r in range(world_size)}


def predicted_traffic(config, world_size: int) -> dict[str, float]:
    """Wire bytes one rank sends per step by axis (the busiest rank of each), from
    :func:`dtlab.measure.predicted_traffic` (:func:`dtlab.estimate.layout_traffic`)."""
    from dtlab import measure

    return dict(measure.predicted_traffic(config, config.resolve_layout(world_size)))


# ---- the two views of this chapter's own --------------------------------------------
def rank_memory_figure(
    measured: Mapping[int, Mapping], predicted: Mapping[int, Mapping] | None = None
) -> dict:
    """Per-rank stacked memory bars, as a figure dict: each rank's latest ``memory``
    event next to the prediction for its stage (``predicted[rank]``), in kB."""
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
                color=MEMORY_COLORS[cat],
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
        margin=dict(t=50, b=40, l=50, r=10),
    )
    return {"data": traces, "layout": layout}


def step_timeline_figure(spans: Sequence[Mapping], lanes: Sequence[str]) -> dict:
    """Compute spans per rank as a Gantt chart, a figure dict (ms from the first
    span shown);
    ``lanes``: one label per rank, in rank order. Always the same five traces (one
    per span name), so live redraws restyle them in place."""
    t0 = min((e["t_start"] for e in spans), default=0.0)
    traces = []
    for name in COMPUTE_SPANS:
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
                    color=SPAN_COLORS[name], line=dict(width=0.5, color="white")
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
    return {"data": traces, "layout": layout}


def _lanes(layout: Layout) -> list[str]:
    axes = ["pp", "dp", "tp"] + (["cp"] if layout.cp > 1 else [])
    out = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        where = " ".join(f"{a}{c[a]}" for a in axes)
        if layout.ep > 1:  # ep is folded into dp·cp: the rank's place in its group
            where += f" ep{layout.group_of('ep', r).index(r)}"
        out.append(f"rank {r} ({where})")
    return out


# ---- the live dashboard ----------------------------------------------------------
class Dashboard:
    """The live views of one run, fed with telemetry events.

    Pass it as ``on_events`` (it is callable) to
    :func:`dtlab.lab.kernel.training.start_run` or ``cluster.run``. :meth:`update`
    folds a batch into bounded state (the newest
    ``loss_window`` steps per rank, ``traffic_steps`` steps of traffic, the spans of
    the newest ``timeline_steps`` steps, the latest memory sample per rank, an N×N
    matrix) and redraws every view at most every ``min_interval`` seconds
    (:class:`~dtlab.lab.figures.throttle.Throttle`). :attr:`updates` logs each
    redraw: wall-clock time, newest step, events so far, and why (``update``,
    ``trailing``: what the throttle held back; ``flush``, ``reset``).
    """

    def __init__(
        self,
        config=None,
        world_size: int | None = None,
        *,
        min_interval: float = 0.2,
        trailing: bool = True,
        loss_window: int = 500,
        traffic_steps: int = 30,
        timeline_steps: int = 1,
        span_window: int = 5000,
        clock=time.monotonic,
    ):
        for name, value in (
            ("loss_window", loss_window),
            ("traffic_steps", traffic_steps),
            ("timeline_steps", timeline_steps),
            ("span_window", span_window),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.min_interval = min_interval
        self._throttle = Throttle(self._redraw_held_back, min_interval, clock, trailing)
        self.loss_window = loss_window
        self.traffic_steps = traffic_steps
        self.timeline_steps = timeline_steps
        self.span_window = span_window
        self.clock = clock
        self._lock = threading.RLock()
        self.updates: deque = deque(maxlen=10_000)
        self.views: dict[str, LiveFigure] = {}  # made after the state
        self._widget = None
        self.reset(config, world_size)
        self.views = {
            name: LiveFigure(figure=fig) for name, fig in self._figures().items()
        }

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
            self._routing: dict[int, dict] = {}
            self._lanes = _lanes(self.layout)
            self._labels = [f"r{r}" for r in range(n)]
            self._pred_memory = self._pred_traffic = None
            if config is not None and world_size:
                self._pred_memory = predicted_memory(config, world_size)
                self._pred_traffic = predicted_traffic(config, world_size)
            self.received = 0
            self.newest_step = -1
            self._throttle.cancel()  # what the previous run held back
            self.updates.clear()
        if self.views:
            self.redraw("reset")
        if self._widget is not None:
            self._widget.children = self._rows()

    @property
    def memory(self) -> dict[int, dict]:
        """The latest memory sample of each rank."""
        return dict(self._memory)

    @property
    def traffic(self) -> dict[int, dict[tuple[str, str], float]]:
        """``{step: {(axis, op): wire bytes}}`` summed over ranks, for the newest
        ``traffic_steps`` steps (:func:`dtlab.lab.figures.traffic.traffic_by_step`)."""
        return dict(self._traffic)

    @property
    def matrix(self) -> list[list[float]]:
        """Wire bytes rank ``src`` sent to rank ``dst`` over the whole run
        (:func:`~dtlab.lab.figures.traffic.traffic_matrix`)."""
        return [list(row) for row in self._matrix]

    def update(self, events) -> bool:
        """Fold a batch of events in; redraw if the throttle allows. Returns whether
        it redrew."""
        with self._lock:
            for e in events:
                self._fold(e)
            if not self._throttle.offer():
                return False
            self.redraw("update")
            return True

    def _redraw_held_back(self) -> None:  # the throttle's trailing edge
        with self._lock:
            if self._throttle.pending:
                self.redraw("trailing")

    __call__ = update

    def _fold(self, e: Mapping) -> None:
        self.received += 1
        kind, rank = e.get("kind"), e.get("rank")
        if kind == Kind.STEP:
            window = self._steps.setdefault(rank, deque(maxlen=self.loss_window))
            window.append(e)
            self.newest_step = max(self.newest_step, e["step"])
        elif kind == Kind.MEMORY:
            self._memory[rank] = dict(e)
        elif kind == Kind.SPAN and e.get("name") in COMPUTE_SPANS:
            self._spans.append(e)
        elif kind == Kind.MOE:
            add_routing(self._routing, e)
        elif kind == Kind.COMM and e.get("wire_bytes"):
            traffic_by_step([e], into=self._traffic)
            while len(self._traffic) > self.traffic_steps:
                self._traffic.popitem(last=False)  # the oldest step first
            traffic_matrix([e], self.layout, into=self._matrix)

    def _timeline(self) -> list[dict]:
        steps = sorted({e["step"] for e in self._spans})[-self.timeline_steps :]
        keep = set(steps)
        return [e for e in self._spans if e["step"] in keep]

    # ---- drawing ----------------------------------------------------------------
    def _figures(self) -> dict:
        """The views as they stand (figures and figure dicts)."""
        steps = [e for window in self._steps.values() for e in window]
        return {
            "loss": loss_figure(steps, title=LOSS_TITLE),
            "memory": rank_memory_figure(self._memory, self._pred_memory),
            "timeline": step_timeline_figure(self._timeline(), self._lanes),
            "traffic": step_traffic_figure(
                self._traffic, self.layout.world_size, self._pred_traffic
            ),
            "matrix": traffic_matrix_figure(self._matrix, self._labels),
            "experts": experts_figure(self._routing),
        }

    def redraw(self, why: str = "redraw") -> None:
        """Redraw every view now, in place (``why`` is logged in :attr:`updates`)."""
        with self._lock:
            for name, fig in self._figures().items():
                self.views[name].draw(fig)
            self._throttle.drawn()
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
            if not self._throttle.pending:
                return False
            self.redraw("flush")
            return True

    @property
    def figures(self) -> dict[str, go.FigureWidget]:
        return {name: view.widget for name, view in self.views.items()}

    @property
    def moe(self) -> bool:
        """Whether this run's model is a mixture of experts (the experts view is
        shown then)."""
        return self.config is not None and self.config.model.n_experts > 1

    def _rows(self) -> list:
        from ipywidgets import HBox

        f = self.figures
        rows = [
            HBox([f["loss"], f["memory"]]),
            f["timeline"],
            HBox([f["traffic"], f["matrix"]]),
        ]
        return rows + [f["experts"]] if self.moe else rows

    @property
    def widget(self):
        """The views in one ipywidgets box (built once; the experts view only for a
        mixture of experts)."""
        if self._widget is None:
            from ipywidgets import VBox

            self._widget = VBox(self._rows())
        return self._widget

    def _ipython_display_(self):  # a Dashboard at the end of a cell shows its widget
        from IPython.display import display

        display(self.widget)

    def figure(self, *, title: str | None = None) -> go.Figure:
        """The dashboard as one static figure (a 3 x 2 grid; for PNGs and reports)."""
        with self._lock:
            return dashboard_figure(
                self._figures(), self._lanes, self.layout, title=title
            )


def dashboard_figure(
    views: Mapping,
    lanes: Sequence[str],
    layout: Layout,
    *,
    title: str | None = None,
) -> go.Figure:
    """The five views of :meth:`Dashboard.figure` (figures or figure dicts; the
    experts view is left out) in one
    ``make_subplots`` grid."""
    cells = {
        (1, 1): go.Figure(views["loss"]),
        (1, 2): go.Figure(views["memory"]),
        (2, 1): go.Figure(views["timeline"]),
        (3, 1): go.Figure(views["traffic"]),
        (3, 2): go.Figure(views["matrix"]),
    }
    fig = make_subplots(
        rows=3,
        cols=2,
        specs=[[{}, {}], [{"colspan": 2}, None], [{}, {}]],
        subplot_titles=[cells[k].layout.title.text for k in sorted(cells)],
        vertical_spacing=0.09,
        horizontal_spacing=0.08,
    )
    for (row, col), view in sorted(cells.items()):
        for trace in view.data:
            if trace.type == "heatmap":
                trace.colorbar.update(len=0.28, y=0.13)
            add_trace(fig, trace, row=row, col=col)
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

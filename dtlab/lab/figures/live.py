"""Live figures: a plotly ``FigureWidget`` redrawn in place while a run goes on.

Taught in chapter 01 (telemetry arrives while ``fn`` still runs) and used by every
chapter that watches a run.

    live = LiveFigure(timeline_figure, window=300)   # any events -> figure builder
    display(live.widget)
    cluster.run(fn, on_events=live)                  # redrawn as batches arrive
    live.flush()                                     # what the throttle held back

Plotly's FigureWidget is built once and changed inside ``batch_update()`` (one
message to the browser). What a redraw costs is plotly validating every property
it is given, not drawing, so a redraw hands the widget only the properties that
differ from what it shows, mostly the data arrays; traces are replaced only when
they themselves change (a new op, a new rank).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import plotly.graph_objects as go


class LiveFigure:
    """A ``FigureWidget`` kept in step with a figure that changes as a run goes on.

    Two ways to drive it:

    - from events: ``LiveFigure(build, **build_kwargs)`` with ``build(events,
      **build_kwargs) -> go.Figure`` (any figure of :mod:`dtlab.lab.figures` that
      takes events). :meth:`update` adds a batch to a bounded window (the newest
      ``window`` events) and redraws at most every ``min_interval`` seconds, so a
      fast stream of batches costs ~5-10 redraws a second. It is callable:
      ``cluster.run(fn, on_events=live)``. Call :meth:`flush` after the run.
    - from anything else: ``LiveFigure(figure=fig)``, then :meth:`draw` with each
      new figure (:class:`dtlab.lab.figures.dashboard.Dashboard` folds events into
      bounded state of its own and draws its five views together).
    """

    def __init__(
        self,
        build: Callable[..., go.Figure] | None = None,
        *,
        figure: go.Figure | None = None,
        window: int = 2000,
        min_interval: float = 0.15,
        clock: Callable[[], float] = time.monotonic,
        **build_kwargs,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1 events, got {window}")
        if min_interval < 0:
            raise ValueError(f"min_interval must be >= 0 seconds, got {min_interval}")
        if (build is None) == (figure is None):
            raise ValueError(
                "give a builder (LiveFigure(build), redrawn from events) or a "
                "figure (LiveFigure(figure=fig), redrawn by draw()), not both"
            )
        self.build = build
        self.build_kwargs = build_kwargs
        self.min_interval = min_interval
        self.clock = clock
        self._events: deque = deque(maxlen=window)
        self._last_draw = -math.inf
        self._pending = False
        self.received = 0  # events ever received (the window keeps the newest)
        self.redraws = 0
        first = figure if figure is not None else build([], **build_kwargs)
        self._shown = _plain(first)
        self.widget = go.FigureWidget(first)

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
        """Rebuild the figure from the window's events and draw it now."""
        if self.build is None:
            raise ValueError("this LiveFigure has no builder: call draw(figure)")
        self.draw(self.build(list(self._events), **self.build_kwargs))

    def draw(self, figure: go.Figure) -> None:
        """Make the widget show ``figure``, changing only what differs."""
        new = _plain(figure)
        old = self._shown
        w = self.widget
        with w.batch_update():
            if _identity(new["data"]) != _identity(old["data"]):
                w.data = ()
                w.add_traces(new["data"])
            else:
                for trace, before, after in zip(w.data, old["data"], new["data"]):
                    changed = _changed(before, after)
                    if changed:
                        trace.update(changed)
            changed = _changed(old["layout"], new["layout"])
            if changed:
                w.layout.update(changed)
        self._shown = new
        self._last_draw = self.clock()
        self._pending = False
        self.redraws += 1

    def _ipython_display_(self):  # a LiveFigure at the end of a cell shows its widget
        from IPython.display import display

        display(self.widget)


def _plain(figure) -> dict:
    """``{"data": [trace dicts], "layout": dict}``, without the template (the
    same every time, and by far the largest part)."""
    fig = figure.to_plotly_json() if hasattr(figure, "to_plotly_json") else figure
    layout = dict(fig.get("layout", {}))
    layout.pop("template", None)
    return {"data": [dict(t) for t in fig.get("data", [])], "layout": layout}


def _identity(traces) -> list[tuple]:
    return [(t.get("type"), t.get("name")) for t in traces]


def _changed(before: dict, after: dict) -> dict:
    """The top-level properties of ``after`` that differ from ``before``; one that
    is gone is reset (``None``)."""
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    changed.update({k: None for k in before if k not in after})
    return changed

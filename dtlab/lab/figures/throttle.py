"""A redraw throttle with a trailing edge, for figures fed by a stream of batches
(chapter 07's live dashboard: :class:`~dtlab.lab.figures.dashboard.Dashboard`).

At most one redraw every ``min_interval`` seconds, however fast batches arrive;
and what the throttle held back is drawn once the interval is over *without
waiting for the next batch*: a rank that goes quiet after an event (building its
optimizer, say) would otherwise leave that event undrawn for seconds (measured
on the dashboard before this edge: events drawn 8.5 s after they happened).

    throttle = Throttle(redraw_held_back, min_interval=0.2)
    if throttle.offer():   # a batch came in: may it be drawn now?
        redraw()
        throttle.drawn()   # (redraw_held_back calls it too)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class Throttle:
    """``offer()`` says whether a redraw is due now; when it is not, the trailing
    ``redraw_held_back()`` is called (on a timer thread, once) when it will be.
    ``trailing=False``: no timer (a fake ``clock``, whose seconds a timer cannot
    wait out); what was held back is then drawn at the next due batch or flush."""

    def __init__(
        self,
        redraw_held_back: Callable[[], None],
        min_interval: float,
        clock: Callable[[], float] = time.monotonic,
        trailing: bool = True,
    ):
        if min_interval < 0:
            raise ValueError(f"min_interval must be >= 0 seconds, got {min_interval}")
        self.redraw_held_back = redraw_held_back
        self.min_interval = min_interval
        self.clock = clock
        self.trailing = trailing
        self.pending = False  # a batch came in since the last redraw
        self._last_draw = -math.inf
        self._timer: threading.Timer | None = None

    def offer(self) -> bool:
        """A batch came in: True if a redraw is due now (the caller draws and calls
        :meth:`drawn`); otherwise the trailing redraw is scheduled."""
        self.pending = True
        wait = self.min_interval - (self.clock() - self._last_draw)
        if wait <= 0:
            return True
        if self.trailing and self._timer is None:
            self._timer = threading.Timer(wait, self._trailing_edge)
            self._timer.daemon = True  # a kernel that exits does not wait for it
            self._timer.start()
        return False

    def drawn(self) -> None:
        """The figure was just redrawn (whatever the reason)."""
        self._last_draw = self.clock()
        self.pending = False

    def cancel(self) -> None:
        """Forget what was held back (a new run starts)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._last_draw = -math.inf
        self.pending = False

    def _trailing_edge(self) -> None:
        self._timer = None
        if self.pending:
            self.redraw_held_back()

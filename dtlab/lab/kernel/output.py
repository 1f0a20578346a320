"""What the ranks print, under the cell that ran them: one area per rank, filled
while they run, never interleaved.

Taught in chapter 01 (``print`` on four ranks at once).

``%%px`` interleaves the ranks' lines (``[stdout:0] ...``, ``[stdout:1] ...``) in
the order they arrive. :class:`RankOutput` gives each rank an output area of its
own (an IPython display, updated in place), labelled with the rank, not the engine
id: :meth:`LabCluster.run <dtlab.lab.kernel.cluster.LabCluster.run>` and the ``%%rank``
magic (:mod:`dtlab.lab.kernel.magics`) fill them from ipyparallel's ``AsyncResult``
(``stdout``, ``stderr``; for a cell also its result) as the text streams in,
at most ten times a second. Outside a notebook the areas are printed at the end,
grouped by rank.
"""

from __future__ import annotations

import sys
import time

INTERVAL = 0.1  # seconds between redraws of a streaming area


class RankText:
    """A rank's area as a display object (plain text, labelled)."""

    def __init__(self, rank: int, text: str):
        self.rank, self.text = rank, text

    def __repr__(self) -> str:
        return f"[rank {self.rank}]\n{self.text.rstrip()}"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


class RankOutput:
    """Per-rank output areas for ``pending`` (``{rank: AsyncResult}``);
    ``results=True`` adds each rank's cell result (``Out``) at the end."""

    def __init__(self, pending: dict, *, results: bool = False):
        self.pending = pending
        self.results = results
        self.shown: dict[int, str] = {}
        self.handles: dict = {}
        self.last = 0.0
        self.display = _display_function()

    def text(self, rank: int, final: bool) -> str:
        ar = self.pending[rank]
        out = _field(ar, "stdout") + _field(ar, "stderr")
        if final and self.results and ar.ready():
            result = _field(ar, "execute_result", None)
            if result:
                out += result.get("data", {}).get("text/plain", "") + "\n"
        return out

    def update(self, final: bool = False) -> None:
        """Redraw the areas whose text changed (throttled unless ``final``)."""
        now = time.monotonic()
        if not final and now - self.last < INTERVAL:
            return
        self.last = now
        if final:  # a result can arrive before the last of its output
            for ar in self.pending.values():
                if ar.ready():
                    ar.wait_for_output(2.0)
        for rank in sorted(self.pending):
            text = self.text(rank, final)
            if text == self.shown.get(rank, ""):
                continue
            self.shown[rank] = text
            if self.display is None:
                continue
            area = RankText(rank, text)
            if rank in self.handles:
                self.handles[rank].update(area)
            else:
                self.handles[rank] = self.display(area, display_id=True)
        if final and self.display is None:
            for rank in sorted(self.shown):
                print(repr(RankText(rank, self.shown[rank])), file=sys.stdout)


def per_rank(pending: list, show: bool | None = None) -> RankOutput | None:
    """Output areas for ``pending`` (one ``AsyncResult`` per rank, in rank order),
    or ``None`` when not shown; ``show=None``: shown from the main thread only (a
    run in a background thread would write into whichever cell runs then)."""
    import threading

    if show is None:
        show = threading.current_thread() is threading.main_thread()
    return RankOutput(dict(enumerate(pending))) if show else None


def _field(ar, name: str, default=""):
    try:
        value = getattr(ar, name)
    except Exception:  # noqa: BLE001 - not there (yet)
        return default
    return value if value is not None else default


def _display_function():
    """IPython's ``display`` inside a kernel, ``None`` elsewhere (print at the end)."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover
        return None
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return None
    return display

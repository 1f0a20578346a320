"""What one rank's code really did: the evidence a checker judges *how* an answer
was computed from.

Used by every chapter's live exercises. Inside ``with Watch(...) as seen:`` a probe
runs the learner's function, and afterwards ``seen`` holds:

- ``seen.events``: the comm events :mod:`dtlab.comm` recorded (every collective and
  p2p in dtlab goes through it: ``{op, axis, peer, payload_bytes, wire_bytes,
  t_start, t_end, tag}``), on the wall clock (``time.time()``);
- ``seen.launches``: every dtlab.comm call in launch order (``{op, numel, bytes,
  tag, axis, async, t_launch, t_waited}``: whether it was asynchronous, and when
  it was waited, ``None`` for never), from :func:`dtlab.comm.watch`. Any wait
  counts: the handle's ``wait()``, or its future's (``handle.get_future()``)
  ``wait()``, ``torch.futures.wait_all`` over it, or the wait of a
  future chained on it with ``then`` (the way DDP's comm hooks are written). An
  event is recorded when its op *completes* (a dropped handle's op may never be),
  a launch when it starts;
- ``seen.forbidden``: the forbidden functions the learner's code called itself
  (by default every ``torch.distributed`` collective and p2p call that did not go
  through dtlab.comm; a checker adds the library's own versions of the mechanism,
  e.g. ``dtlab.comm.ring_all_reduce`` or ``dtlab.ddp.DistributedDataParallel``).

Calls are seen with :func:`sys.setprofile` (whatever name the learner imported a
function under, its code object is the same), in this thread: on CPU, autograd runs
backward hooks on the thread that called ``backward()``.
"""

from __future__ import annotations

import inspect
import sys
import time

import torch
import torch.distributed as dist

from dtlab import comm, opwatch, telemetry

__all__ = ["Watch", "TORCH_COLLECTIVES", "code_of"]

TORCH_COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "scatter",
    "gather",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
"""``torch.distributed`` calls a learner must not make directly in an exercise."""

# the dtlab.comm calls whose ``async_op`` a launch records (p2p is always async)
_COMM_CALLS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
_P2P_CALLS = ("isend", "irecv")

# A future's ways of being waited on and chained, all in Python (their calls and
# returns are seen): dtlab.comm hands out futures whose ``then`` returns another
# Python future, so a chained future's wait is seen too
_FUTURE_WAITS = {
    torch.futures.Future.wait.__code__: "self",
    torch.futures.wait_all.__code__: "futures",
}
_FUTURE_CHAINS = {
    opwatch.WatchedFuture.then.__code__: "self",
    torch.futures.collect_all.__code__: "futures",
}


def code_of(fn) -> object:
    """The code object that runs when ``fn`` is called (a class: its ``__init__``;
    decorators unwrapped)."""
    if isinstance(fn, type):
        fn = fn.__init__
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    return fn.__code__


def _torch_collectives() -> dict:
    out = {}
    for name in TORCH_COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            out[code_of(fn)] = f"torch.distributed.{name}"
    return out


def _called_by_library(frame) -> bool:
    """Whether the call in ``frame`` was made from dtlab's library code (so it is
    not the learner calling it): the nearest caller outside torch decides."""
    f = frame.f_back
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if f.f_globals.get("RECORDS_ONLY"):  # the live lab's recording wrapper
            f = f.f_back
            continue
        if not module.startswith("torch"):
            return module.startswith("dtlab") and not module.startswith(
                "dtlab.exercises"
            )
        f = f.f_back
    return False


class Watch:
    """Record what the code run inside the ``with`` block does on this rank.

    ``forbidden``: ``{function or class: label}`` the learner must not call (added
    to the torch.distributed collectives). ``on_call``: ``{function: fn(frame)}``,
    called when the function starts (a checker reads its arguments, e.g. the output
    tensor of every ``dtlab.comm.all_gather``).
    """

    def __init__(self, forbidden: dict | None = None, on_call: dict | None = None):
        self.recorder = telemetry.Recorder(
            dist.get_rank() if dist.is_initialized() else 0, epoch=0.0
        )
        self.forbidden: list[str] = []
        self.launches: list[dict] = []
        self._labels = _torch_collectives()
        for fn, label in (forbidden or {}).items():
            self._labels[code_of(fn)] = label
        self._hooks: dict = {code_of(f): h for f, h in (on_call or {}).items()}
        for name in _COMM_CALLS + _P2P_CALLS:
            self._hooks.setdefault(code_of(getattr(comm, name)), self._note_async)
        self._pending_async = False
        self._by_entry: dict[int, dict] = {}
        self._entries: list = []  # keeps entries alive, so their ids stay unique
        # futures handed out for async ops, and those chained on them: id ->
        # (future, the launches it stands for); the futures are kept alive so
        # their ids stay unique
        self._futures: dict[int, tuple] = {}
        self._waiting: dict[int, list] = {}  # frame or C future -> launches
        self._chaining: dict[int, list] = {}  # frame -> launches
        self._use = None
        self._previous = None

    # ---- the with block ------------------------------------------------------------
    def __enter__(self) -> Watch:
        self._use = telemetry.use(self.recorder)
        self._use.__enter__()
        comm.watch(self._on_op)
        opwatch.watch_futures(self._on_future)
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)
        opwatch.unwatch_futures(self._on_future)
        comm.unwatch(self._on_op)
        self._use.__exit__(*exc)

    @property
    def events(self) -> list[dict]:
        """The comm events recorded inside the block."""
        return telemetry.comm_events(self.recorder.events)

    def calls_of(self, op: str) -> list[dict]:
        return [e for e in self.events if e["op"] == op]

    # ---- what the profiler and dtlab.comm tell us ----------------------------------
    def _profile(self, frame, event, arg):
        if self._futures and event != "call":
            self._future_event(frame, event, arg)
            return
        if event != "call":
            return
        code = frame.f_code
        if self._futures and (code in _FUTURE_WAITS or code in _FUTURE_CHAINS):
            self._future_call(frame, code)
        hook = self._hooks.get(code)
        if hook is not None:
            hook(frame)
        label = self._labels.get(code)
        if label is not None and label not in self.forbidden:
            if not self._nested(frame) and not _called_by_library(frame):
                self.forbidden.append(label)

    # ---- waits through futures -----------------------------------------------------
    def _on_future(self, entry, future) -> None:
        launch = self._by_entry.get(id(entry))
        if launch is not None:
            self._futures[id(future)] = (future, [launch])

    def _launches_of(self, futures) -> list:
        found = []
        for f in futures:
            tracked = self._futures.get(id(f))
            if tracked is not None and tracked[0] is f:
                found += tracked[1]
        return found

    def _future_call(self, frame, code) -> None:
        name = _FUTURE_WAITS.get(code) or _FUTURE_CHAINS[code]
        given = frame.f_locals.get(name)
        futures = given if name == "futures" else [given]
        launches = self._launches_of(futures or [])
        if launches:
            table = self._waiting if code in _FUTURE_WAITS else self._chaining
            table[id(frame)] = launches

    def _future_event(self, frame, event, arg) -> None:
        if event == "return":
            launches = self._waiting.pop(id(frame), None)
            if launches is not None:
                self._mark_waited(launches)
            launches = self._chaining.pop(id(frame), None)
            if launches is not None and arg is not None:  # the chained future
                self._futures[id(arg)] = (arg, launches)

    @staticmethod
    def _mark_waited(launches) -> None:
        now = time.time()
        for launch in launches:
            if launch["t_waited"] is None:
                launch["t_waited"] = now

    def _nested(self, frame) -> bool:
        """Whether a watched function called this one (torch's deprecated
        ``reduce_scatter_tensor`` calls ``reduce_scatter_single``: one call)."""
        f = frame.f_back
        while f is not None and f.f_globals.get("__name__", "").startswith("torch"):
            if f.f_code in self._labels:
                return True
            f = f.f_back
        return False

    def _note_async(self, frame) -> None:
        name = frame.f_code.co_name
        self._pending_async = name in _P2P_CALLS or bool(
            frame.f_locals.get("async_op", False)
        )

    def _on_op(self, entry, active: bool) -> None:
        # dtlab.comm marks an op active while it is launched and, for an async op,
        # again while its handle's wait() runs: the second leave is the wait's end
        now = time.time()
        launch = self._by_entry.get(id(entry))
        if launch is None:  # a new op: its launch
            op, numel, dtype, axis, tag, _ = entry
            launch = {
                "op": op,
                "numel": numel,
                "bytes": numel * dtype.itemsize if dtype is not None else 0,
                "tag": tag,
                "axis": axis,
                "async": self._pending_async,
                "t_launch": now,
                "t_waited": None,
                "leaves": 0,
            }
            self._pending_async = False
            self._by_entry[id(entry)] = launch
            self._entries.append(entry)
            self.launches.append(launch)
        if not active:
            launch["leaves"] += 1
            if launch["leaves"] == 2:
                launch["t_waited"] = now

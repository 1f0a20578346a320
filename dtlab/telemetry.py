"""Per-rank telemetry: what each rank communicated, computed and held in memory.

Taught in chapter 01 (traffic of each collective) and used by every later chapter's
live plots.

Each rank has a :class:`Recorder`. Library code never holds one; it asks
:func:`current` for the recorder that is active in this process (a do-nothing
:data:`OFF` recorder unless someone called :func:`use`), so a run nobody watches pays
one attribute check per event.

Three kinds of event, each a flat dict with a ``kind`` field:

- ``comm``: ``{rank, op, axis, dtype, numel, payload_bytes, wire_bytes, t_start,
  t_end, step, tag}`` — written by :mod:`dtlab.comm`.
- ``span``: ``{rank, stage, microbatch, name: F|B|W|opt|idle|..., t_start, t_end,
  step}`` — a stretch of compute.
- ``memory``: ``{rank, step, phase, params, grads, optimizer, activations, buffers,
  peak}`` — bytes by category.

Sinks receive every event: :class:`MemorySink` (a list), :class:`JsonlSink` (one file
per rank, for headless runs), :class:`CallbackSink` (a function); the live lab gives
its engines' recorders a sink of its own that streams to the notebook
(``dtlab.lab.engine.publish``). :func:`chrome_trace` turns events into the Chrome
trace format that Perfetto (ui.perfetto.dev) and chrome://tracing open.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from dtlab.current import Current

clock = time.perf_counter  # for throttling; event times use the wall clock below


class Recorder:
    """Collects events of one rank and forwards them to its sinks."""

    def __init__(self, rank: int = 0, sinks=None, *, enabled: bool = True, epoch=None):
        self.rank = rank
        self.sinks = list(sinks) if sinks is not None else [MemorySink()]
        self.enabled = enabled
        self.step = 0
        # Event times are seconds since ``epoch`` (a wall-clock time). Ranks that are
        # given the same epoch share one time axis: on one host their clocks agree,
        # so timelines of different ranks line up without guessing.
        self.epoch = time.time() if epoch is None else float(epoch)
        self._lock = threading.Lock()

    # ---- writing events ---------------------------------------------------------
    def emit(self, kind: str, **fields) -> None:
        if not self.enabled:
            return
        event = {"kind": kind, "rank": self.rank, "step": self.step, **fields}
        with self._lock:
            for sink in self.sinks:
                sink.write(event)

    def now(self) -> float:
        """Seconds since the recorder's epoch (the time axis of its events)."""
        return time.time() - self.epoch

    @contextlib.contextmanager
    def span(self, name: str, *, stage: int = 0, microbatch: int | None = None, **kw):
        """Record a compute span around the ``with`` body."""
        if not self.enabled:
            yield
            return
        t_start = self.now()
        try:
            yield
        finally:
            self.emit(
                "span",
                name=name,
                stage=stage,
                microbatch=microbatch,
                t_start=t_start,
                t_end=self.now(),
                **kw,
            )

    def memory(self, phase: str, **categories) -> None:
        """Record a memory sample: bytes by category (params, grads, optimizer,
        activations, buffers, peak, ...)."""
        self.emit("memory", phase=phase, t=self.now(), **categories)

    def flush(self) -> None:
        with self._lock:
            for sink in self.sinks:
                sink.flush()

    def close(self) -> None:
        with self._lock:
            for sink in self.sinks:
                sink.flush()
                sink.close()

    # ---- reading back -----------------------------------------------------------
    @property
    def events(self) -> list[dict]:
        """Events held by this recorder's in-memory sinks."""
        out = []
        for sink in self.sinks:
            if isinstance(sink, MemorySink):
                out.extend(sink.events)
        return out

    def clear(self) -> None:
        for sink in self.sinks:
            if isinstance(sink, MemorySink):
                sink.events.clear()


class _Off(Recorder):
    """The recorder in force when nobody listens: drops everything."""

    def __init__(self):
        super().__init__(rank=-1, sinks=[], enabled=False)

    def emit(self, kind, **fields):  # noqa: D102 - the cheap path
        return None


OFF = _Off()
_in_force: Current[Recorder] = Current(OFF)  # see dtlab.current: process-wide


def current() -> Recorder:
    """The recorder in force in this process (:data:`OFF` unless one is in use)."""
    return _in_force.get()


def use(recorder: Recorder):
    """``with use(recorder):`` makes ``recorder`` current for the body."""
    return _in_force.use(recorder)


def install(recorder: Recorder) -> Recorder:
    """Make ``recorder`` current until replaced (for long-lived engine processes)."""
    return _in_force.set(recorder)


# ---- sinks ------------------------------------------------------------------------
class Sink:
    def write(self, event: dict) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class MemorySink(Sink):
    """Keeps events in a list (bounded by ``maxlen`` if given: oldest dropped)."""

    def __init__(self, maxlen: int | None = None):
        self.events: list[dict] = []
        self.maxlen = maxlen

    def write(self, event):
        self.events.append(event)
        if self.maxlen is not None and len(self.events) > self.maxlen:
            del self.events[: len(self.events) - self.maxlen]


class JsonlSink(Sink):
    """One JSON object per line, in ``directory/rank{r}.jsonl`` (headless runs)."""

    def __init__(self, directory: str | os.PathLike, rank: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, event):
        self._file.write(json.dumps(event) + "\n")

    def flush(self):
        if not self._file.closed:
            self._file.flush()

    def close(self):
        self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class CallbackSink(Sink):
    """Hands each event to a function (handy in tests and for custom live views)."""

    def __init__(self, fn):
        self.fn = fn

    def write(self, event):
        self.fn(event)


# ---- summaries and export ---------------------------------------------------------
def comm_events(events, *, op=None, axis=None, tag=None) -> list[dict]:
    out = [e for e in events if e.get("kind") == "comm"]
    if op is not None:
        out = [e for e in out if e["op"] == op]
    if axis is not None:
        out = [e for e in out if e["axis"] == axis]
    if tag is not None:
        out = [e for e in out if e.get("tag") == tag]
    return out


def traffic(events, by=("op",)) -> dict[tuple, dict[str, float]]:
    """Sum payload and wire bytes (and calls) of comm events grouped by fields."""
    table: dict[tuple, dict[str, float]] = {}
    for e in comm_events(events):
        key = tuple(e.get(k) for k in by)
        row = table.setdefault(key, {"calls": 0, "payload_bytes": 0, "wire_bytes": 0})
        row["calls"] += 1
        row["payload_bytes"] += e["payload_bytes"]
        row["wire_bytes"] += e["wire_bytes"]
    return table


def chrome_trace(events) -> dict:
    """Events -> Chrome trace JSON (one process per rank; threads for compute and
    communication). Open the written file in Perfetto or chrome://tracing."""
    trace = []
    for rank in sorted({e["rank"] for e in events}):
        trace.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
        for tid, name in ((0, "compute"), (1, "comm")):
            trace.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": name},
                }
            )
    for e in events:
        if e["kind"] == "span":
            trace.append(
                {
                    "ph": "X",
                    "pid": e["rank"],
                    "tid": 0,
                    "name": e["name"],
                    "ts": e["t_start"] * 1e6,
                    "dur": (e["t_end"] - e["t_start"]) * 1e6,
                    "args": {k: e.get(k) for k in ("step", "stage", "microbatch")},
                }
            )
        elif e["kind"] == "comm":
            trace.append(
                {
                    "ph": "X",
                    "pid": e["rank"],
                    "tid": 1,
                    "name": e["op"],
                    "ts": e["t_start"] * 1e6,
                    "dur": (e["t_end"] - e["t_start"]) * 1e6,
                    "args": {
                        k: e.get(k)
                        for k in (
                            "axis",
                            "dtype",
                            "numel",
                            "payload_bytes",
                            "wire_bytes",
                            "step",
                            "tag",
                        )
                    },
                }
            )
        elif e["kind"] == "memory":
            cats = {
                k: v
                for k, v in e.items()
                if k not in ("kind", "rank", "step", "phase", "t")
                and isinstance(v, int | float)
            }
            trace.append(
                {
                    "ph": "C",
                    "pid": e["rank"],
                    "name": "memory (bytes)",
                    "ts": e["t"] * 1e6,
                    "args": cats,
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike, events) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(events), f)
    return str(path)

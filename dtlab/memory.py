"""Bytes per rank by category: parameters, gradients, optimizer state, activations,
communication buffers; current and peak for each phase of a step.

Taught in chapter 03 (ZeRO), where the bars of every rank are put next to the ZeRO
paper's formula (:func:`dtlab.estimate.zero_memory_per_device`).

The accounting is dtlab's own, not the allocator's, so it works the same on CPU ranks
and on GPUs, and it can say *what* the bytes are:

- model states come from the model and the optimizer: a model that knows its
  layout (:class:`dtlab.zero.FullyShardedDataParallel`) lists its tensors by
  category through ``memory_tensors(optimizer)``; any other ``nn.Module`` gives its
  parameters, their ``.grad`` and the optimizer's state. Tensors are counted by
  *storage*, once: a view of a flat buffer costs nothing extra, and a storage that
  ZeRO-3 freed (resized to 0) costs 0.
- activations are the tensors autograd saves for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` while a phase runs; each storage
  counts while autograd still holds it (parameters that autograd saves are not
  activations).
- categories named ``host_...`` are what CPU offload keeps off the device: shown
  apart, so the saving is visible even when the "device" is a CPU process.

:class:`MemoryTracker` samples these at every event the strategies report (a gather,
a free, a reduction, a saved tensor) and, at the end of each ``with
tracker.phase("forward"):``, records a telemetry ``memory`` event: the current bytes
by category at the end of the phase, and the peak during it (``peak`` for the device
total, ``peak_<category>`` for each). On a GPU the event also carries the
allocator's ``cuda_allocated`` and ``cuda_peak``.
"""

from __future__ import annotations

import contextlib

import torch

from dtlab import telemetry
from dtlab.current import Current
from dtlab.events import HOST_CATEGORIES, MEMORY_CATEGORIES, STATE_CATEGORIES, Kind

__all__ = [
    "CATEGORIES",
    "HOST_CATEGORIES",
    "MemoryTracker",
    "SavedBytes",
    "model_state_tensors",
    "count_bytes",
    "nbytes",
    "current",
    "use",
    "memory_events",
]

CATEGORIES = MEMORY_CATEGORIES  # the names of dtlab.events, kept here for callers


def model_state_tensors(model=None, optimizer=None):
    """``(category, tensor)`` pairs of the model states a rank holds."""
    if model is not None and hasattr(model, "memory_tensors"):
        yield from model.memory_tensors(optimizer)
        return
    if model is not None:
        for p in model.parameters():
            yield "params", p
            if p.grad is not None:
                yield "grads", p.grad
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    yield "optimizer", v


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of a tensor's elements (0 for ``None``); a view counts its own size."""
    return 0 if t is None else t.numel() * t.element_size()


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def count_bytes(pairs) -> dict[str, int]:
    """Bytes per category, each storage counted once (under the first category
    that names it)."""
    out = dict.fromkeys(STATE_CATEGORIES, 0)
    seen = set()
    for category, t in pairs:
        if category not in out:
            raise ValueError(
                f"unknown memory category {category!r}: use one of {STATE_CATEGORIES}"
            )
        ptr, nbytes = _storage(t)
        if nbytes == 0 or ptr in seen:
            continue
        seen.add(ptr)
        out[category] += nbytes
    return out


class _Held:
    """What autograd keeps instead of a saved tensor while a live counter runs: its
    ``__del__`` tells the counter when autograd drops it (after its backward)."""

    __slots__ = ("tensor", "key", "counter")

    def __init__(self, tensor, key, counter):
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self):
        self.counter.release(self.key)


class SavedBytes:
    """The bytes autograd saves for backward (the *activations*), seen through
    ``torch.autograd.graph.saved_tensors_hooks`` while the counter is entered.

    Each storage counts once, however many saved tensors view it; weights are not
    activations and are left out:

    - ``weights``: tensors whose storages are weights, or a callable returning them.
      A callable is asked again for every storage not seen yet, because weights can
      move (ZeRO-3 gathers a unit's weights into fresh memory before its forward).
    - ``skip_params=True`` also leaves out every leaf tensor that requires grad
      (a parameter, whichever module owns it).

    ``live=False`` (the default) counts what one forward saves: :attr:`bytes` starts
    from 0 at each ``with`` and :attr:`peak` is the largest forward seen.
    ``live=True`` counts what autograd *still* holds: a storage stops counting when
    autograd drops its last saved tensor (after its backward ran), and the count
    carries across ``with`` blocks. ``on_new(nbytes)`` is called for every storage
    newly counted (to attribute it to a block, or to sample a peak).

    Saved-tensor hooks are per thread: enter the counter in the thread that runs the
    forward.
    """

    def __init__(self, weights=(), *, skip_params=False, live=False, on_new=None):
        self._weights = weights if callable(weights) else list(weights)
        self.skip_params = skip_params
        self.live = live
        self.on_new = on_new
        self.bytes = 0
        self.peak = 0
        self.held: dict[int, list[int]] = {}  # storage ptr -> [bytes, references]
        self._ctx = None

    def _weight_ptrs(self) -> set[int]:
        weights = self._weights() if callable(self._weights) else self._weights
        return {w.untyped_storage().data_ptr() for w in weights}

    def _pack(self, t):
        if self.skip_params:
            base = t._base if t._base is not None else t
            if base.is_leaf and base.requires_grad:  # a parameter, counted as such
                return t
        ptr, nbytes = _storage(t)
        entry = self.held.get(ptr)
        if entry is None:
            if ptr in self._weight_ptrs():
                return t
            self.held[ptr] = entry = [nbytes, 0]
            self.bytes += nbytes
            if self.on_new is not None:
                self.on_new(nbytes)
        if not self.live:
            return t
        entry[1] += 1
        return _Held(t, ptr, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Held) else saved

    def release(self, ptr: int) -> None:
        """Autograd dropped one saved tensor of storage ``ptr`` (live counting)."""
        entry = self.held.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.held[ptr]

    @property
    def ptrs(self) -> set[int]:
        """The storages counted (and, when live, still held)."""
        return set(self.held)

    def __enter__(self):
        if not self.live:
            self.bytes, self.held = 0, {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None
        self.peak = max(self.peak, self.bytes)


class MemoryTracker:
    """Byte accounting of one rank. ``model`` and ``optimizer`` say where the model
    states are; ``recorder`` (default: the telemetry recorder in force) receives a
    ``memory`` event at the end of each phase.

    ::

        tracker = MemoryTracker(model, optimizer)
        with tracker.phase("forward"):
            loss = model(x, y)[1]
        with tracker.phase("backward"):
            loss.backward()
        with tracker.phase("step"):
            optimizer.step()

    :attr:`records` keeps every phase's figures (the same as the events).
    """

    def __init__(self, model=None, optimizer=None, *, recorder=None, cuda=None):
        self.model = model
        self.optimizer = optimizer
        self.recorder = recorder
        self.cuda = (
            torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
            if cuda is None and model is not None
            else bool(cuda)
        )
        self.activations = SavedBytes(
            skip_params=True, live=True, on_new=lambda _: self.update()
        )
        self.records: list[dict] = []
        self._peak: dict[str, int] = {}
        self.enabled = True

    def measure(self) -> dict[str, int]:
        """Current bytes by category; ``total`` is the device, ``host`` the host."""
        out = count_bytes(model_state_tensors(self.model, self.optimizer))
        out["activations"] = self.activations.bytes
        out["total"] = sum(out[c] for c in CATEGORIES)
        out["host"] = sum(out[c] for c in HOST_CATEGORIES)
        return out

    def update(self) -> dict[str, int]:
        """Measure now and raise the phase's peaks (strategies call this through
        :func:`current` at every gather, free and reduction)."""
        m = self.measure()
        for k, v in m.items():
            if v > self._peak.get(k, -1):
                self._peak[k] = v
        return m

    @contextlib.contextmanager
    def phase(self, name: str):
        """Track the ``with`` body as one phase; record its end state and peaks."""
        self._peak = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.update()
        with use(self), self.activations:
            yield self
        end = self.update()
        record = {"phase": name, **end, "peak": self._peak["total"]}
        record.update({f"peak_{c}": self._peak[c] for c in CATEGORIES})
        if self.cuda:
            record["cuda_allocated"] = torch.cuda.memory_allocated()
            record["cuda_peak"] = torch.cuda.max_memory_allocated()
        self.records.append(record)
        rec = self.recorder if self.recorder is not None else telemetry.current()
        rec.memory(name, **{k: v for k, v in record.items() if k != "phase"})

    def peak(self, category: str = "total") -> int:
        """The largest value of ``category`` over all recorded phases."""
        key = "peak" if category == "total" else f"peak_{category}"
        return max((r.get(key, r.get(category, 0)) for r in self.records), default=0)


class _Off:
    """The tracker in force when nobody measures: every call is a no-op."""

    enabled = False

    def update(self):
        return None


OFF = _Off()
_in_force: Current = Current(OFF)  # see dtlab.current: process-wide


def current():
    """The tracker whose phase is running (:data:`OFF` outside any phase)."""
    return _in_force.get()


def use(tracker):
    """``with use(tracker):`` makes ``tracker`` current for the body."""
    return _in_force.use(tracker)


def memory_events(events, *, phase=None, step=None, rank=None) -> list[dict]:
    """The ``memory`` events among telemetry ``events``, optionally filtered."""
    out = [e for e in events if e.get("kind") == Kind.MEMORY]
    for key, value in (("phase", phase), ("step", step), ("rank", rank)):
        if value is not None:
            out = [e for e in out if e.get(key) == value]
    return out

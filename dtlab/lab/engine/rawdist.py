"""Raw ``torch.distributed`` calls, recorded like dtlab's own: what a rank blocked in
``dist.all_reduce`` is doing, on its status board and in error messages.

Taught in chapter 01, whose first cells call ``torch.distributed`` directly.

:mod:`dtlab.comm` records the collectives that go through it (its
:func:`~dtlab.comm.watch` hook feeds the board, :mod:`~dtlab.lab.engine.board`).
A cell that calls ``dist.all_reduce`` itself bypasses that, and a rank stuck there
showed as "not in a collective". :func:`install` (called once per engine, when it
joins its first world) wraps the module's collectives and point-to-point calls on
this engine so that each call outside ``dtlab.comm`` is written on the board as
``in all_reduce(numel=8, float32, group world, tag 'torch.distributed')`` while it
blocks, and :func:`current_op` names it when the call fails. Calls made from
inside ``dtlab.comm`` (which calls these same functions) are passed straight
through: they are recorded once, by comm. An ``async_op=True`` call is marked while
its handle's ``wait()`` blocks.
"""

from __future__ import annotations

import functools
import threading
import time

import torch
import torch.distributed as dist

from dtlab import comm
from dtlab.lab.engine.state import state

TAG = "torch.distributed"
RECORDS_ONLY = True
"""This module's frames only record a call: a checker that asks who called a
``torch.distributed`` function looks past them (:mod:`dtlab.exercises.watch`)."""
# isend and irecv stay torch's own: dist.P2POp (and so batch_isend_irecv and torch's
# pipelining) accepts only those two very functions
NAMES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)

_local = threading.local()  # per thread: inside a comm call, or a raw one
_last: list = [None]  # the raw call in progress or failed, else None


def _depth(name: str) -> int:
    return getattr(_local, name, 0)


def _inside_comm(entry, active: bool) -> None:  # a dtlab.comm watcher
    _local.comm = max(0, _depth("comm") + (1 if active else -1))


def _first_tensor(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value:
            if isinstance(value[0], torch.Tensor):
                return value[0]
    return None


def _entry(name, args, kwargs):
    """The op in :func:`dtlab.comm.describe_op`'s terms."""
    tensor = _first_tensor(args, kwargs)
    group = kwargs.get("group")
    axis = "world" if group is None else "group"
    numel = tensor.numel() if tensor is not None else 0
    dtype = tensor.dtype if tensor is not None else None
    return (name, numel, dtype, axis, TAG, time.time())


def _post(entry, active: bool) -> None:
    if state.board is not None:
        state.board(entry, active)


class _Waiting:
    """An async handle whose ``wait()`` is marked on the board."""

    __slots__ = ("_work", "_entry")

    def __init__(self, work, entry):
        self._work, self._entry = work, entry

    def wait(self, *args, **kwargs):
        _last[0] = self._entry
        _post(self._entry, True)
        done = self._work.wait(*args, **kwargs)
        _post(self._entry, False)
        _last[0] = None
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap(name: str, real):
    @functools.wraps(real)
    def recorded(*args, **kwargs):
        if _depth("comm") or _depth("raw"):  # comm records it, or a raw call does
            try:
                return real(*args, **kwargs)
            except BaseException:
                _local.comm = 0  # comm's op failed: it does not say it left
                raise
        entry = _entry(name, args, kwargs)
        _last[0] = entry
        _post(entry, True)
        _local.raw = 1
        try:
            out = real(*args, **kwargs)  # an exception leaves the op as current
        finally:
            _local.raw = 0
        _post(entry, False)
        _last[0] = None
        if kwargs.get("async_op"):
            return _Waiting(out, entry) if out is not None else out
        return out

    recorded.dtlab_real = real
    return recorded


def install() -> None:
    """Wrap ``torch.distributed``'s calls on this engine (once)."""
    if getattr(dist, "dtlab_recorded", False):
        return
    comm.watch(_inside_comm)
    for name in NAMES:
        real = getattr(dist, name, None)
        if callable(real) and not hasattr(real, "dtlab_real"):
            setattr(dist, name, _wrap(name, real))
    dist.dtlab_recorded = True


def forget() -> None:
    """A new call starts with no raw op in progress (like ``comm.forget_ops``)."""
    _last[0] = None
    _local.comm = _local.raw = 0


def current_op() -> str | None:
    """``in all_reduce(...) for 2.0s`` while a raw call blocks or after it failed;
    ``None`` otherwise."""
    entry = _last[0]
    if entry is None:
        return None
    return f"in {comm.describe_op(entry)} for {time.time() - entry[5]:.1f}s"

"""What this rank is doing: the collective it is blocked in (or failed in), else the
last one it finished, for the error messages that name what every rank was doing.

Taught in chapter 01 (debugging a hang). :mod:`dtlab.comm` marks every call here
before it blocks and after it returns; :func:`watch` mirrors each change to a
callback (the lab writes it where the notebook can read it while the rank is stuck;
the exercises read the launches and waits). A watcher receives ``(entry, active)``
with ``entry = (op, numel, dtype, axis, tag, t_wall)``; an async op's ``wait()``
marks its entry active a second time, then inactive. A watcher of futures
(:func:`watch_futures`) receives ``(entry, future)`` each time code asks an async
op's handle for its future (``handle.get_future()``), so a wait through the future
(``wait()``, ``then``, ``torch.futures.wait_all``) can be told apart
from no wait at all.
"""

from __future__ import annotations

import time

import torch

__all__ = [
    "enter",
    "leave",
    "entry",
    "describe_op",
    "current_op",
    "forget_ops",
    "watch",
    "unwatch",
    "WatchedFuture",
    "watched_future",
    "watch_futures",
    "unwatch_futures",
]

# A rank that hangs or fails is reported with the collective it was in. Each call
# sets ``_NOW[0]`` before it blocks and clears it after (an exception leaves it set:
# the failed op is the one to report); ``_LAST[0]`` keeps the last one finished.
# ``watch(fn)`` mirrors every change to ``fn`` (the lab writes it where the notebook
# can read it while the rank is stuck). Cost with nobody watching: two assignments.
_NOW: list = [None]  # (op, numel, dtype, axis, tag, t_wall) or None
_LAST: list = [None]
_WATCHERS: list = []
_FUTURE_WATCHERS: list = []


def enter(entry) -> None:
    _NOW[0] = entry
    for w in _WATCHERS:
        w(entry, True)


def leave(entry) -> None:
    _NOW[0] = None
    _LAST[0] = entry
    for w in _WATCHERS:
        w(entry, False)


def entry(op, tensor, axis, tag):
    if tensor is None:
        return (op, 0, None, axis, tag, time.time())
    return (op, tensor.numel(), tensor.dtype, axis, tag, time.time())


def describe_op(entry) -> str:
    """``all_reduce(numel=1024, float32, group dp, tag 'ddp/bucket0')``."""
    op, numel, dtype, axis, tag, _ = entry
    dtype = str(dtype).replace("torch.", "") if dtype is not None else None
    parts = [f"numel={numel}"] + ([dtype] if dtype else []) + [f"group {axis}"]
    if tag is not None:
        parts.append(f"tag {tag!r}")
    return f"{op}({', '.join(parts)})"


def current_op() -> str:
    """What this rank is doing, in words: the collective it is blocked in (or
    failed in), else the last one it finished."""
    now, last = _NOW[0], _LAST[0]
    if now is not None:
        return f"in {describe_op(now)} for {time.time() - now[5]:.1f}s"
    if last is not None:
        return f"not in a collective (the last one: {describe_op(last)})"
    return "not in a collective (none yet)"


def forget_ops() -> None:
    """Start a new call with a clean slate (the lab does this per ``cluster.run``)."""
    _NOW[0] = _LAST[0] = None


def watch(fn) -> None:
    """``fn(entry, active)`` on every collective start (True) and end (False)."""
    if fn not in _WATCHERS:
        _WATCHERS.append(fn)


def unwatch(fn) -> None:
    if fn in _WATCHERS:
        _WATCHERS.remove(fn)


class WatchedFuture(torch.futures.Future):
    """A future whose ``then`` returns another such future: torch's returns its
    C future, whose ``wait()`` Python's profiler cannot attribute to it."""

    def then(self, callback):
        return _mirror(super().then(callback))


def _mirror(fut) -> WatchedFuture:
    seen = WatchedFuture()

    def done(f):
        try:
            seen.set_result(f.value())
        except Exception as e:  # the op failed: so does whoever waits on it
            seen.set_exception(e)

    fut.add_done_callback(done)
    return seen


def watched_future(future, entry) -> WatchedFuture:
    """The future of the async op ``entry`` (dtlab.comm's handles' ``get_future``),
    as a Python future completed with its result or error, handed to every future
    watcher: whoever waits on it, chains ``then`` on it or passes it to
    ``torch.futures.wait_all`` can be seen doing so (an exercise's checker counts
    that as a wait, as DDP waits on its comm hooks' futures)."""
    mirror = _mirror(future)
    if entry is not None:
        for w in _FUTURE_WATCHERS:
            w(entry, mirror)
    return mirror


def watch_futures(fn) -> None:
    """``fn(entry, future)`` whenever an async op's future is handed out."""
    if fn not in _FUTURE_WATCHERS:
        _FUTURE_WATCHERS.append(fn)


def unwatch_futures(fn) -> None:
    if fn in _FUTURE_WATCHERS:
        _FUTURE_WATCHERS.remove(fn)

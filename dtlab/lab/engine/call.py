"""Running the user's function on this rank: what ``cluster.run(fn)`` does on each
engine.

Before ``fn`` runs, a barrier checks that every rank is still in the world (a
failed ``%%px`` cell may have taken it down); then ``fn`` runs with telemetry on if
the notebook asked. When ``fn`` raises, the rank tears its world down *before* the
exception leaves (:func:`~dtlab.lab.engine.failfast.fail_fast`), so its peers do not
wait out the collective timeout, and the error goes back as a :class:`Failure`
whose message starts with the wall-clock time and what the rank was doing
(:func:`encode_failure`): the notebook side tells the cause from its consequences
by those (:mod:`dtlab.lab.kernel.failures`).
"""

from __future__ import annotations

import re
import time
import traceback

import torch.distributed as dist

from dtlab import comm, telemetry
from dtlab.lab.engine import board, rawdist
from dtlab.lab.engine.failfast import fail_fast
from dtlab.lab.engine.publish import PublishSink
from dtlab.lab.engine.state import state

NO_GROUP = "[no process group]"
"""Starts the message of a rank that found its world gone before ``fn`` ran: the
notebook side resets the world and runs ``fn`` again."""

_FAILURE = re.compile(r"@(\d+\.\d+)\t([^\t\n]*)\t(.*)", re.S)


class Failure(Exception):
    """Carried back to the notebook when the user's function raised on this rank."""


def encode_failure(t_wall: float, doing: str, error: str, tb: str) -> str:
    """``@time<TAB>what the rank was doing<TAB>error`` and the traceback."""
    return f"@{t_wall:.6f}\t{doing}\t{error}\n{tb}"


def decode_failure(text: str) -> tuple[float, str, str]:
    """``(t_wall, doing, error and traceback)`` from :func:`encode_failure`'s text;
    ``(inf, "", text)`` for any other error text."""
    m = _FAILURE.match(text)
    if m is None:
        return float("inf"), "", text
    return float(m.group(1)), m.group(2), m.group(3)


def call(fn, args, kwargs, record: bool, publish_interval: float, epoch: float):
    """Run the user's ``fn(*args, **kwargs)`` on this rank; return ``(value,
    events)`` (``events``: the telemetry recorded, if ``record``).

    ``publish_interval > 0`` streams the events live as well (:class:`PublishSink`).
    ``epoch``: the wall-clock time every rank's event times count from, so that the
    timelines of different ranks line up. On error the process group is destroyed
    *before* the exception leaves, and the error is re-raised with the rank, the
    time it happened and the traceback.
    """
    if state.broken is not None or not dist.is_initialized():
        raise Failure(
            f"{NO_GROUP} rank {state.rank}: no process group "
            f"({state.broken or 'not set up'}); call cluster.reset()"
        )
    try:
        # Pre-flight: is every rank still in the world? A rank whose group went down
        # (a failed %%px cell) makes this barrier fail on every rank at once, before
        # any of fn runs, so the notebook can reset and run fn again.
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - reported as NO_GROUP
        state.broken = "a peer's process group is gone"
        message = f"{NO_GROUP} rank {state.rank}: {type(exc).__name__}: {exc}"
    else:
        message = None
    if message is not None:
        fail_fast()
        raise Failure(message)
    comm.forget_ops()
    rawdist.forget()
    board.post("running")
    if record:
        sinks = [telemetry.MemorySink()]
        if publish_interval > 0:
            sinks.append(PublishSink(interval=publish_interval))
        rec = telemetry.Recorder(state.rank, sinks, epoch=epoch)
    else:
        rec = telemetry.OFF
    failure = None
    try:
        with telemetry.use(rec):
            value = fn(*args, **kwargs)
    except BaseException as exc:
        doing, error = rawdist.current_op() or comm.current_op(), type(exc).__name__
        failure = encode_failure(
            time.time(), doing, f"{error}: {exc}", traceback.format_exc()
        )
        state.broken = f"{error} on rank {state.rank}"
    if record:
        rec.close()  # the last events sent, the publishing thread ended
    if failure is not None:
        # outside the except block, so the traceback's frames (and any group they
        # reference) are already released when the groups are torn down
        fail_fast()
        board.post("failed", f"{doing} ({error})")
        raise Failure(failure)
    unsendable = _unsendable(value)
    if unsendable:
        board.post("idle")
        tb = "(the function returned; pickling its value for the notebook failed)"
        raise Failure(encode_failure(time.time(), comm.current_op(), unsendable, tb))
    board.post("idle")
    return value, (rec.events if record else None)


def _unsendable(value) -> str | None:
    """Why ``value`` cannot travel back to the notebook (pickled, as ipyparallel
    sends it), or ``None``. Checked here because ipyparallel's own error ("cannot
    pickle '_thread.lock' object") does not say it was the return value."""
    import cloudpickle

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return None
    try:
        cloudpickle.dumps(value)
    except Exception as exc:  # noqa: BLE001 - any reason is reported
        return (
            f"ReturnValueError: the return value on rank {state.rank}, a "
            f"{type(value).__module__}.{type(value).__qualname__}, cannot be sent "
            f"to the notebook ({type(exc).__name__}: {exc}): return plain data "
            "(numbers, lists, dicts, tensors) instead"
        )
    return None

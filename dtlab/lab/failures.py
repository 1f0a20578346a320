"""How failures on the live cluster reach the notebook: the error types, and what
each rank was doing when it happened.

Taught in chapter 01 (what happens when one rank fails).

- an exception on one rank comes back as a :class:`dtlab.launch.RankError` naming
  the rank and carrying its traceback (:func:`remote_rank_error`); the failing rank
  destroyed its process group, so its peers did not wait out the collective
  timeout, and the next ``run`` resets the group by itself;
- a rank that never arrives at a collective makes the others fail after the
  process group's timeout;
- an engine that dies is reported as :class:`EngineDied`, with how it ended (a
  signal, an exit code: :func:`exit_reason`); ``restart()`` brings up new engines;
- ranks that call mismatched collectives: another op hangs until the group's
  timeout (the status of each rank shows the two ops); another *size* makes gloo
  abort the receiving engine (``EngineDied``, SIGABRT). Torch's collective checker
  (``LabCluster(check_collectives=True)``) turns both into a clean error on every
  rank; it is off by default because it costs ~4 ms per collective on CPU ranks
  (measured: 0.6 ms -> 4.3 ms for a 256-float all-reduce on 2 engines).

Every message says what each rank was doing: ``rank 2 was in all_reduce(numel=
1072, float32, group dp, tag 'ddp') for 0.3s``. Each engine keeps its current
collective in a small status file (:mod:`dtlab.lab.engine.board`, fed by
:func:`dtlab.comm.watch`) that :func:`read_board` reads here, even while the rank
is stuck or after it died.
"""

from __future__ import annotations

import re
import signal
import time

from dtlab.lab import processes
from dtlab.lab.engine import board
from dtlab.lab.engine.call import decode_failure
from dtlab.launch import RankError, rank_error

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of IPython's tracebacks


class EngineDied(RuntimeError):
    """An engine process exited while the cluster was using it."""


class WorldDown(RuntimeError):
    """Ranks found their process group gone before running anything (a failed
    ``%%px`` cell took it down): the caller resets the world and tries again."""


def remote_rank_error(errors, what: str) -> RankError:
    """One :class:`~dtlab.launch.RankError` from ``(rank, ipyparallel RemoteError)``
    pairs, naming the rank that failed first (:func:`dtlab.launch.rank_error`)."""
    failures = []
    for rank, exc in errors:
        t_fail, doing, body = decode_failure(_ANSI.sub("", f"{exc.evalue}"))
        message, _, tb = body.partition("\n")
        if not tb:
            tb = exc.traceback or ""
            tb = _ANSI.sub("", tb if isinstance(tb, str) else "\n".join(tb))
        failures.append((rank, message, tb, t_fail, doing))
    return rank_error(failures, what)


# ---- what each rank is doing ---------------------------------------------------------
def read_board(path: str | None) -> tuple[str, float, str] | None:
    """``(state, t_wall, text)`` from a rank's status file, or None."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return board.decode(f.read(board.BOARD_BYTES))
    except (OSError, ValueError):
        return None


def describe_board(entry, now: float | None = None) -> str:
    """A board entry in words: ``in all_reduce(numel=8, ...) for 3.1s``."""
    if entry is None:
        return "unknown (no status board)"
    state, t, text = entry
    ago = (time.time() if now is None else now) - t
    if state == "in":
        return f"in {text} for {ago:.1f}s"
    if state == "after":
        return f"running Python after {text} (finished {ago:.1f}s ago)"
    if state == "running":
        return f"running Python, no collective yet ({ago:.1f}s into the call)"
    if state == "failed":
        return f"failed {ago:.1f}s ago, {text}"
    return "idle"


def doing_lines(doing: dict[int, str], ranks=None) -> str:
    """``\\n  rank 1 was in all_reduce(...)`` for each rank whose state is known."""
    lines = [
        f"  rank {r} was {d}"
        for r, d in doing.items()
        if (ranks is None or r in ranks) and not d.startswith("unknown")
    ]
    return ("\n" + "\n".join(lines)) if lines else ""


def after_interrupt(dead: list[int], still: list[int], timeout: float) -> str:
    """What to do after the ranks were interrupted: ``dead`` engines are gone,
    ``still`` ranks are busy."""
    if dead:
        return f"the engines of ranks {dead} are gone: call cluster.restart()"
    if still:
        return (
            f"ranks {still} are still busy (code inside a collective or another "
            "C call does not stop on an interrupt; a collective ends at the "
            f"group's timeout, {timeout:.0f}s): wait and run again, or call "
            "cluster.restart()"
        )
    return "every rank is free again: the next run resets the process group"


# ---- how an engine ended --------------------------------------------------------
_SIGNAL_HINTS = {
    "SIGABRT": " (gloo aborts a process whose collective got a different size from "
    "a peer: ranks called mismatched collectives; LabCluster(check_collectives=True) "
    "turns that into a clean error)",
    "SIGKILL": " (killed: out of memory, or by hand)",
}


def exit_reason(ipp_cluster, pid: int, wait: float = 1.0) -> str:
    """How a local engine ended, in words (waiting up to ``wait`` seconds for its
    launcher to reap it)."""
    deadline = time.monotonic() + wait
    code = processes.exit_code(ipp_cluster, pid)
    while code is None and time.monotonic() < deadline:
        time.sleep(0.05)
        code = processes.exit_code(ipp_cluster, pid)
    if code is None:
        return "ended"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}{_SIGNAL_HINTS.get(name, '')}"
    return f"exited with code {code}"


def remote_end(host: str | None) -> str:
    """How an engine on another host ended, as far as this machine can tell."""
    return (
        f"it ran on {host or 'another host'} and stopped answering ipyparallel's "
        "heartbeat (its engine log there says why)"
    )

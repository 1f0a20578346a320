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
  signal, an exit code: :func:`exit_reason`; a kill by the kernel's OOM killer is
  said as "out of memory"); ``restart()`` brings up new engines;
- an engine that is alive but does not answer (stopped by SIGSTOP, or dropped by
  the controller after missing its heartbeat) is :class:`EngineUnresponsive`,
  which says how to recover: ``reset()`` once it runs again, or ``restart()``;
- ranks still running a few seconds after their peers failed, or the group's
  timeout after their peers finished, are interrupted and named
  (:class:`RankHung`) with what each was doing, its traceback at the interrupt
  showing the line it was stuck on;
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

from dtlab.lab.engine import board
from dtlab.lab.engine.call import decode_failure
from dtlab.lab.kernel import processes
from dtlab.launch import RankError, rank_error

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of IPython's tracebacks


class EngineDied(RuntimeError):
    """An engine process exited while the cluster was using it."""


class EngineUnresponsive(RuntimeError):
    """An engine process is alive but does not answer (it is stopped, or the
    controller dropped it after missed heartbeats)."""


class RankHung(RankError):
    """Ranks that did not finish while their peers had failed or finished: named,
    with what each was doing, and interrupted."""


class WorldDown(RuntimeError):
    """Ranks found their process group gone before running anything (a failed
    ``%%px`` cell took it down): the caller resets the world and tries again."""


# how an allocation that does not fit fails inside a rank
_OUT_OF_MEMORY = (
    "MemoryError",
    "OutOfMemoryError",
    "can't allocate memory",
    "CUDA out of memory",
)


def remote_rank_error(errors, what: str, note: str = "") -> RankError:
    """One :class:`~dtlab.launch.RankError` from ``(rank, ipyparallel RemoteError)``
    pairs, naming the rank that failed first (:func:`dtlab.launch.rank_error`);
    ``note``: lines to add under its first line."""
    failures = []
    for rank, exc in errors:
        t_fail, doing, body = decode_failure(_ANSI.sub("", f"{exc.evalue}"))
        ename = getattr(exc, "ename", "")
        if t_fail == float("inf") and ename and ename != "Failure":
            body = f"{ename}: {body}"  # a cell's error: ipyparallel splits the two
        message, _, tb = body.partition("\n")
        if not tb:
            tb = exc.traceback or ""
            tb = _ANSI.sub("", tb if isinstance(tb, str) else "\n".join(tb))
        if any(x in message for x in _OUT_OF_MEMORY):
            message = (
                f"out of memory: {message} (a smaller batch, model or world fits; "
                "cluster.restart() frees everything)"
            )
        failures.append((rank, message, tb, t_fail, doing))
    err = rank_error(failures, what)
    if note:
        head, _, rest = str(err).partition("\n")
        err.args = (f"{head}\n{note}" + (f"\n{rest}" if rest else ""),)
    return err


# The errors a rank sees because *another* rank failed or never came: its
# collective timed out, or its connections were closed by a peer that failed.
_CONSEQUENCES = (
    "timed out",
    "timeout",
    "DistBackendError",
    "DistNetworkError",
    "Connection closed",
    "Connection reset",
    "no process group",
    "KeyboardInterrupt",
)


def is_consequence(text: str) -> bool:
    """Whether a rank's error text is the consequence of a peer (see above)."""
    low = text.lower()
    return any(c.lower() in low for c in _CONSEQUENCES)


def hung_error(hung, errors, what, *, since, finished, doing, timeout, still):
    """The error for ranks ``hung`` that were still running ``since`` seconds after
    their peers had failed (``errors``: ``(rank, RemoteError)``, including the hung
    ranks' own errors once interrupted) or ``finished`` (ranks).

    If a peer failed for a reason of its own (not a timeout), that failure is the
    cause: its :class:`RankError`, with the hung ranks named. Otherwise the hung
    ranks are the cause (their peers waited for them until the group's timeout):
    :class:`RankHung` naming the first, with its traceback at the interrupt."""
    failed = [r for r, _ in errors if r not in hung]
    first = hung[0]
    after = (
        f"after rank{'s' if len(failed) > 1 else ''} {_listed(failed)} failed"
        if failed
        else f"after rank{'s' if len(finished) > 1 else ''} {_listed(finished)} "
        f"finished (the group's timeout is {timeout:.0f}s)"
    )
    note = (
        f"rank{'s' if len(hung) > 1 else ''} {_listed(hung)} still running "
        f"{since:.1f}s {after}, interrupted; " + after_interrupt([], still, timeout)
    )
    own = [(r, e) for r, e in errors if r not in hung]
    causes = [(r, e) for r, e in own if not is_consequence(f"{e.evalue}")]
    if causes:
        lines = "".join(f"\n  rank {r} was {doing[r]}" for r in hung if r in doing)
        return remote_rank_error(own, what, note=note + lines)
    tb = ""
    for r, exc in errors:
        if r == first:
            _, _, body = decode_failure(_ANSI.sub("", f"{exc.evalue}"))
            tb = body.partition("\n")[2]
    message = f"did not finish {what}: {note}"
    if failed:
        message += (
            "\nits peers' errors follow from it (they waited for it in a "
            "collective until the group's timeout)"
        )
    return RankHung(first, message, tb.strip(), {r: doing[r] for r in doing})


def _listed(ranks) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks)) if ranks else "none"


def unresponsive(
    rank: int, pid: int | None, why: str, doing: str = "", *, stopped: bool = False
) -> EngineUnresponsive:
    """Rank ``rank``'s engine is alive and not answering, for reason ``why``;
    ``doing``: what the ranks were doing (:func:`doing_lines`); ``stopped``: its
    process is stopped, and must be resumed first."""
    where = f" (pid {pid})" if pid is not None else ""
    resume = (
        f"resume it (os.kill({pid}, signal.SIGCONT), or kill -CONT {pid}), then "
        if stopped
        else ""
    )
    return EngineUnresponsive(
        f"rank {rank}'s engine{where} is alive but not answering: {why}. To "
        f"recover: {resume}call cluster.reset(), or cluster.restart() for new "
        f"engines{doing}"
    )


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
        return f"stopped by an error {ago:.1f}s ago, {text}"
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
    "SIGKILL": " (killed by hand, or by the machine: not its OOM killer, as far as "
    "its memory cgroup says)",
}


def exit_reason(ipp_cluster, pid: int, wait: float = 1.0, beat=None) -> str:
    """How a local engine ended, in words (waiting up to ``wait`` seconds for its
    launcher to reap it). ``beat``: its last heartbeat (:func:`read_heartbeat`),
    which tells a kill by the kernel's OOM killer from another SIGKILL."""
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
        if name == "SIGKILL" and out_of_memory(beat):
            return (
                "was killed by SIGKILL: out of memory (the kernel's OOM killer "
                f"ended it; {beat['rss'] / 2**20:.0f} MiB resident at its last "
                "heartbeat)"
            )
        return f"was killed by {name}{_SIGNAL_HINTS.get(name, '')}"
    return f"exited with code {code}"


def read_heartbeat(path: str | None) -> dict | None:
    """A rank's last heartbeat from its status file
    (:func:`dtlab.lab.engine.board.decode_heartbeat`), or ``None``."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return board.decode_heartbeat(f.read(board.BOARD_BYTES))
    except OSError:
        return None


def out_of_memory(beat: dict | None) -> bool:
    """Whether the OOM killer ended processes in the rank's memory cgroup after its
    last heartbeat (its count of OOM kills went up)."""
    if not beat or beat.get("oom_kills") is None:
        return False
    now = board.oom_kills(beat.get("cgroup"))
    return now is not None and now > beat["oom_kills"]


def remote_end(host: str | None) -> str:
    """How an engine on another host ended, as far as this machine can tell."""
    return (
        f"it ran on {host or 'another host'} and stopped answering ipyparallel's "
        "heartbeat (its engine log there says why)"
    )


def offer_restart(cluster) -> None:
    """In a notebook, show a button that restarts ``cluster`` (new engines), next
    to the error that says an engine died; elsewhere nothing."""
    import threading

    try:
        import ipywidgets
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    button = ipywidgets.Button(description="restart the cluster", icon="refresh")
    said = ipywidgets.Output()

    def restart(_):
        button.disabled = True
        with said:
            cluster.restart()
            print(f"restarted: new engines, pids {cluster.pids}")

    button.on_click(restart)
    display(ipywidgets.VBox([button, said]))

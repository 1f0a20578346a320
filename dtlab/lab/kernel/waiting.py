"""Waiting for the ranks of the live cluster, with failures turned into clear
errors: the loop behind ``cluster.run``, ``reset``, ``health`` and ``%%rank`` cells.

Taught in chapter 01 (what happens when one rank fails).

While the ranks work, :func:`wait_for_ranks` hands their live telemetry and their
output on, checks four times a second that every local engine process is alive
and running, and stops at the first of:

- every rank answered: the results, in rank order, or one
  :class:`dtlab.launch.RankError` naming the rank that failed first;
- an engine died: :class:`~dtlab.lab.kernel.failures.EngineDied`, with how it ended;
- an engine is stopped (SIGSTOP) or was dropped by the controller:
  :class:`~dtlab.lab.kernel.failures.EngineUnresponsive`, alive but not answering;
- some ranks are still running :data:`STRAGGLER_GRACE` seconds after others
  failed, or the group's timeout plus that after others finished: those ranks are
  interrupted and named (:func:`dtlab.lab.kernel.failures.hung_error`), instead of the
  call waiting out its own timeout (600 s by default);
- the deadline passed, or the notebook's Stop button was pressed
  (``KeyboardInterrupt``): the busy ranks are interrupted (SIGINT) and the error
  says what each rank was doing and whether all of them are free again.

A blocking ipyparallel call would swallow the notebook's interrupt (and nbval's
timeout), so the loop waits in short slices of 20 ms.
"""

from __future__ import annotations

import signal
import time

from dtlab.lab.engine import call
from dtlab.lab.kernel import failures, processes
from dtlab.lab.kernel.failures import EngineDied, EngineUnresponsive, WorldDown

STRAGGLER_GRACE = 3.0  # seconds a rank may run on after a peer failed
STOPPED_FOR = 0.5  # seconds a process must be seen stopped to count as stopped


def wait_for_ranks(
    cluster,
    pending,
    *,
    timeout: float,
    what: str,
    on_events=None,
    ranks=None,
    output=None,
):
    """The results of ``pending`` (one ipyparallel ``AsyncResult`` per rank, for
    ``ranks``, all of them in order by default) from ``cluster``'s engines, within
    ``timeout`` seconds. ``what`` names the call in messages; ``on_events(rank,
    batch)`` receives the telemetry batches the ranks publish meanwhile;
    ``output.update()`` is called every slice (the per-rank output areas of
    :mod:`dtlab.lab.kernel.output`)."""
    import ipyparallel as ipp

    ranks = list(range(len(pending)) if ranks is None else ranks)
    by_rank = dict(zip(ranks, pending))
    deadline = time.monotonic() + timeout
    seen = {r: set() for r in ranks}
    next_check, first_done, first_failed = 0.0, None, None
    try:
        while True:
            if on_events is not None:
                _drain(by_rank, seen, on_events)
            if output is not None:
                output.update()
            done = [r for r in ranks if by_rank[r].ready()]
            if len(done) == len(ranks):
                break
            now = time.monotonic()
            if now >= next_check:
                # a failed rank means the rest will fail fast; keep waiting
                try:
                    check_alive(cluster, ranks=ranks)
                except EngineUnresponsive:
                    # its peers wait for it: interrupt them (and it: the signal
                    # waits for it to resume), so nothing is left running
                    interrupt(cluster, [r for r in ranks if not by_rank[r].ready()])
                    raise
                next_check = now + 0.25
            if done:
                first_done = first_done or now
                if first_failed is None and any(_failed(by_rank[r]) for r in done):
                    first_failed = now
                limit = (
                    first_failed + STRAGGLER_GRACE
                    if first_failed is not None
                    else first_done + cluster.timeout + STRAGGLER_GRACE
                )
                if now > limit:
                    raise _stragglers(cluster, by_rank, done, what, now - first_done)
            if now > deadline:
                busy = [r for r in ranks if not by_rank[r].ready()]
                doing = failures.doing_lines(cluster.doing())  # before the interrupt
                interrupt(cluster, busy)
                still = _settle(cluster, by_rank)
                raise TimeoutError(
                    f"{what} did not finish within {timeout:.0f}s on ranks {busy}; "
                    f"they were interrupted.{doing}\n"
                    + _after_interrupt(cluster, still)
                )
            waiting = next((by_rank[r] for r in ranks if not by_rank[r].ready()), None)
            if waiting is not None:  # (all may have become ready meanwhile)
                waiting.wait(0.02)
    except KeyboardInterrupt:
        # the notebook's Stop button: stop the ranks too, and say where they were
        busy = [r for r in ranks if not by_rank[r].ready()]
        doing = failures.doing_lines(cluster.doing())
        interrupt(cluster, busy)
        still = _settle(cluster, by_rank)
        raise KeyboardInterrupt(
            f"{what} was interrupted; ranks {busy} were stopped.{doing}\n"
            + _after_interrupt(cluster, still)
        ) from None
    finally:
        if output is not None:
            output.update(final=True)
    if on_events is not None:
        _drain(by_rank, seen, on_events)
    errors = []
    results = []
    for rank in ranks:
        try:
            results.append(by_rank[rank].get(timeout=0))
        except ipp.error.RemoteError as exc:
            errors.append((rank, exc))
        except ipp.error.EngineError as exc:
            raise _engine_lost(cluster, rank, what, f": {exc}") from None
    if errors and any(getattr(exc, "ename", "") == "EngineError" for _, exc in errors):
        # ipyparallel noticed a dead engine before our liveness check did: name the
        # engine and how it ended (its signal) rather than the stranded task
        rank = next(r for r, exc in errors if exc.ename == "EngineError")
        raise _engine_lost(cluster, rank, what, "")
    if errors:
        if all(call.NO_GROUP in str(exc.evalue) for _, exc in errors):
            raise WorldDown(failures.remote_rank_error(errors, what))
        raise failures.remote_rank_error(errors, what)
    return results


def _failed(ar) -> bool:
    try:
        return not ar.successful()
    except Exception:  # noqa: BLE001 - not ready after all
        return False


def _engine_lost(cluster, rank: int, what: str, detail: str):
    """ipyparallel lost rank ``rank``'s engine: dead (how it ended), or alive and
    dropped after missed heartbeats (unresponsive)."""
    cluster.needs_reset = True
    pid = cluster.local_pids().get(rank)
    if pid is not None and processes.alive(pid):
        frozen = processes.stopped(pid)
        return failures.unresponsive(
            rank,
            pid,
            f"it missed ipyparallel's heartbeat during {what}"
            f"{' and is stopped' if frozen else ''}, and the controller dropped "
            "it (cluster.reset() replaces it, its variables are lost)",
            stopped=frozen,
        )
    check_alive(cluster, wait=2.0)  # names the signal, when it can
    failures.offer_restart(cluster)
    return EngineDied(
        f"rank {rank}'s engine died during {what}{detail}; "
        f"{_how_it_ended(cluster, rank)}; call cluster.restart()"
        f"{failures.doing_lines(cluster.doing())}"
    )


def _stragglers(cluster, by_rank, done, what, since):
    """Interrupt the ranks not in ``done`` and name them (after they unwound)."""
    import ipyparallel as ipp

    hung = [r for r in by_rank if r not in done]
    doing = cluster.doing()  # before the interrupt changes it
    interrupt(cluster, hung)
    still = _settle(cluster, by_rank, seconds=5.0)
    errors = []
    for r, ar in by_rank.items():
        if ar.ready():
            try:
                ar.get(timeout=0)
            except ipp.error.RemoteError as exc:
                errors.append((r, exc))
            except ipp.error.EngineError:
                pass
    finished = [r for r in done if not _failed(by_rank[r])]
    return failures.hung_error(
        hung,
        errors,
        what,
        since=since,
        finished=finished,
        doing=doing,
        timeout=cluster.timeout,
        still=still,
    )


def check_alive(
    cluster, wait: float = 0.0, ranks=None, stopped_for: float = STOPPED_FOR
) -> None:
    """Raise :class:`~dtlab.lab.kernel.failures.EngineDied` if a local engine process is
    gone (another host's engines are watched by ipyparallel's heartbeat), and
    :class:`~dtlab.lab.kernel.failures.EngineUnresponsive` if one is stopped; ``wait``
    seconds for a process that ipyparallel already reported dead to finish
    exiting. ``ranks``: only those (default: every rank). A process counts as
    stopped once seen so for ``stopped_for`` seconds (a debugger may pause one
    for a moment)."""
    deadline = time.monotonic() + wait
    local = cluster.local_pids()
    if ranks is not None:
        local = {r: p for r, p in local.items() if r in ranks}
    dead = [r for r, pid in local.items() if not processes.alive(pid)]
    while not dead and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = [r for r, pid in local.items() if not processes.alive(pid)]
    if dead:
        cluster.needs_reset = True
        failures.offer_restart(cluster)
        how = "".join(
            f"\n  rank {r} (pid {local[r]}) {_exit_reason(cluster, r, local[r])}"
            for r in dead
        )
        raise EngineDied(
            f"engine of rank{'s' if len(dead) > 1 else ''} "
            f"{', '.join(map(str, dead))} (pid "
            f"{', '.join(str(local[r]) for r in dead)}) is gone; "
            f"call cluster.restart() for new engines{how}"
            f"{failures.doing_lines(cluster.doing())}"
        )
    stopped = [r for r, pid in local.items() if processes.stopped(pid, stopped_for)]
    if stopped:
        cluster.needs_reset = True
        r = stopped[0]
        raise failures.unresponsive(
            r,
            local[r],
            "its process is stopped (SIGSTOP, or Ctrl-Z in its terminal); the "
            "other ranks wait for it in their collectives until the group's "
            f"timeout ({cluster.timeout:.0f}s)",
            failures.doing_lines(cluster.doing()),
            stopped=True,
        )


def interrupt(cluster, ranks) -> None:
    """SIGINT the engines of ``ranks``: Python code on them raises
    KeyboardInterrupt, their process group is torn down, peers fail fast."""
    cluster.signal(ranks, signal.SIGINT)
    cluster.needs_reset = True


def _settle(cluster, by_rank, seconds: float = 10.0) -> list[int]:
    """After interrupting: give the ranks a moment to unwind (one stuck in a
    collective gets out when its interrupted peers close their connections);
    return the ranks still busy."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if all(ar.ready() for ar in by_rank.values()):
                break
            if any(not processes.alive(pid) for pid in cluster.local_pids().values()):
                break
            waiting = next((ar for ar in by_rank.values() if not ar.ready()), None)
            if waiting is None:  # the last one finished since the check above
                break
            waiting.wait(0.05)
    except KeyboardInterrupt:  # pressed Stop again: stop waiting
        pass
    return [r for r, ar in by_rank.items() if not ar.ready()]


def _after_interrupt(cluster, still: list[int]) -> str:
    dead = [r for r, pid in cluster.local_pids().items() if not processes.alive(pid)]
    return failures.after_interrupt(dead, still, cluster.timeout)


def _how_it_ended(cluster, rank: int) -> str:
    local = cluster.local_pids()
    if rank in local:
        return _exit_reason(cluster, rank, local[rank])
    return failures.remote_end(cluster.placement.hosts.get(rank))


def _exit_reason(cluster, rank: int, pid: int) -> str:
    beat = failures.read_heartbeat(cluster.board_file(rank))
    return failures.exit_reason(cluster.ipp_cluster, pid, beat=beat)


def _drain(by_rank, seen, on_events) -> None:
    """Hand newly published telemetry batches to ``on_events(rank, batch)``: each
    batch is published under a key of its own (the client keeps only the latest
    value per key: :class:`dtlab.lab.engine.publish.PublishSink`)."""
    for rank, ar in by_rank.items():
        # a copy: ipyparallel's thread adds keys while this one reads (the copy
        # of a dict is made in one step, under the GIL)
        data = dict(ar.data or {})
        if not data:
            continue
        for key in sorted(k for k in data if k not in seen[rank]):
            seen[rank].add(key)
            on_events(rank, data[key])

"""Waiting for every rank of the live cluster, with failures turned into clear
errors: the loop behind ``cluster.run``, ``reset`` and ``health``.

Taught in chapter 01 (what happens when one rank fails).

While the ranks work, :func:`wait_for_ranks` hands their live telemetry on, checks
four times a second that every local engine process is alive, and stops at the
first of:

- every rank answered: the results, in rank order, or one
  :class:`dtlab.launch.RankError` naming the rank that failed first;
- an engine died: :class:`~dtlab.lab.failures.EngineDied`, with how it ended;
- the deadline passed, or the notebook's Stop button was pressed
  (``KeyboardInterrupt``): the busy ranks are interrupted (SIGINT) and the error
  says what each rank was doing and whether all of them are free again.

A blocking ipyparallel call would swallow the notebook's interrupt (and nbval's
timeout), so the loop waits in short slices of 20 ms.
"""

from __future__ import annotations

import signal
import time

from dtlab.lab import failures, processes
from dtlab.lab.engine import call
from dtlab.lab.failures import EngineDied, WorldDown


def wait_for_ranks(cluster, pending, *, timeout: float, what: str, on_events=None):
    """The results of ``pending`` (one ipyparallel ``AsyncResult`` per rank, in rank
    order) from ``cluster``'s engines, within ``timeout`` seconds. ``what`` names
    the call in messages; ``on_events(rank, batch)`` receives the telemetry batches
    the ranks publish meanwhile."""
    import ipyparallel as ipp

    deadline = time.monotonic() + timeout
    seen: list[set] = [set() for _ in pending]
    next_check = 0.0
    try:
        while True:
            if on_events is not None:
                _drain(pending, seen, on_events)
            if all(ar.ready() for ar in pending):
                break
            now = time.monotonic()
            if now >= next_check:
                # a failed rank means the rest will fail fast; keep waiting
                check_alive(cluster)
                next_check = now + 0.25
            if now > deadline:
                busy = [r for r, ar in enumerate(pending) if not ar.ready()]
                doing = failures.doing_lines(cluster.doing())  # before the interrupt
                interrupt(cluster, busy)
                still = _settle(cluster, pending)
                raise TimeoutError(
                    f"{what} did not finish within {timeout:.0f}s on ranks {busy}; "
                    f"they were interrupted.{doing}\n"
                    + _after_interrupt(cluster, still)
                )
            waiting = next((ar for ar in pending if not ar.ready()), None)
            if waiting is not None:
                waiting.wait(0.02)
    except KeyboardInterrupt:
        # the notebook's Stop button: stop the ranks too, and say where they were
        busy = [r for r, ar in enumerate(pending) if not ar.ready()]
        doing = failures.doing_lines(cluster.doing())
        interrupt(cluster, busy)
        still = _settle(cluster, pending)
        raise KeyboardInterrupt(
            f"{what} was interrupted; ranks {busy} were stopped.{doing}\n"
            + _after_interrupt(cluster, still)
        ) from None
    if on_events is not None:
        _drain(pending, seen, on_events)
    errors = []
    results = []
    for rank, ar in enumerate(pending):
        try:
            results.append(ar.get(timeout=0))
        except ipp.error.RemoteError as exc:
            errors.append((rank, exc))
        except ipp.error.EngineError as exc:
            check_alive(cluster, wait=2.0)  # names the signal, when it can
            cluster.needs_reset = True
            raise EngineDied(
                f"rank {rank}'s engine died during {what}: {exc}; "
                f"{_how_it_ended(cluster, rank)}; call cluster.restart()"
            ) from None
    if errors and any(getattr(exc, "ename", "") == "EngineError" for _, exc in errors):
        # ipyparallel noticed a dead engine before our liveness check did: name the
        # engine and how it ended (its signal) rather than the stranded task; ranks
        # whose process is still alive are reported too
        check_alive(cluster, wait=2.0)
        rank = next(r for r, exc in errors if exc.ename == "EngineError")
        cluster.needs_reset = True
        raise EngineDied(
            f"rank {rank}'s engine died during {what}: "
            f"{_how_it_ended(cluster, rank)}; call cluster.restart()"
            f"{failures.doing_lines(cluster.doing())}"
        )
    if errors:
        if all(call.NO_GROUP in str(exc.evalue) for _, exc in errors):
            raise WorldDown(failures.remote_rank_error(errors, what))
        raise failures.remote_rank_error(errors, what)
    return results


def check_alive(cluster, wait: float = 0.0) -> None:
    """Raise :class:`~dtlab.lab.failures.EngineDied` if a local engine process is
    gone (another host's engines are watched by ipyparallel's heartbeat); ``wait``
    seconds for a process that ipyparallel already reported dead to finish
    exiting."""
    deadline = time.monotonic() + wait
    local = cluster.local_pids()
    dead = [r for r, pid in local.items() if not processes.alive(pid)]
    while not dead and time.monotonic() < deadline:
        time.sleep(0.05)
        dead = [r for r, pid in local.items() if not processes.alive(pid)]
    if dead:
        cluster.needs_reset = True
        how = "".join(
            f"\n  rank {r} (pid {local[r]}) "
            f"{failures.exit_reason(cluster.ipp_cluster, local[r])}"
            for r in dead
        )
        raise EngineDied(
            f"engine of rank{'s' if len(dead) > 1 else ''} "
            f"{', '.join(map(str, dead))} (pid "
            f"{', '.join(str(local[r]) for r in dead)}) is gone; "
            f"call cluster.restart() for new engines{how}"
            f"{failures.doing_lines(cluster.doing())}"
        )


def interrupt(cluster, ranks) -> None:
    """SIGINT the engines of ``ranks``: Python code on them raises
    KeyboardInterrupt, their process group is torn down, peers fail fast."""
    cluster.signal(ranks, signal.SIGINT)
    cluster.needs_reset = True


def _settle(cluster, pending, seconds: float = 10.0) -> list[int]:
    """After interrupting: give the ranks a moment to unwind (one stuck in a
    collective gets out when its interrupted peers close their connections);
    return the ranks still busy."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if all(ar.ready() for ar in pending):
                break
            if any(not processes.alive(pid) for pid in cluster.local_pids().values()):
                break
            waiting = next((ar for ar in pending if not ar.ready()), None)
            if waiting is None:  # the last one finished since the check above
                break
            waiting.wait(0.05)
    except KeyboardInterrupt:  # pressed Stop again: stop waiting
        pass
    return [r for r, ar in enumerate(pending) if not ar.ready()]


def _after_interrupt(cluster, still: list[int]) -> str:
    dead = [r for r, pid in cluster.local_pids().items() if not processes.alive(pid)]
    return failures.after_interrupt(dead, still, cluster.timeout)


def _how_it_ended(cluster, rank: int) -> str:
    local = cluster.local_pids()
    if rank in local:
        return failures.exit_reason(cluster.ipp_cluster, local[rank])
    return failures.remote_end(cluster.placement.hosts.get(rank))


def _drain(pending, seen, on_events) -> None:
    """Hand newly published telemetry batches to ``on_events(rank, batch)``: each
    batch is published under a key of its own (the client keeps only the latest
    value per key: :class:`dtlab.lab.engine.publish.PublishSink`)."""
    for rank, ar in enumerate(pending):
        data = ar.data
        if not data:
            continue
        for key in sorted(k for k in data if k not in seen[rank]):
            seen[rank].add(key)
            on_events(rank, data[key])

"""The engines behind the ranks: whether each is still registered with the
controller, and replacing one with a new engine for the same rank.

Taught in chapter 01 (an engine can be lost) and chapter 08 (surviving a lost
replica: :mod:`dtlab.lab.kernel.replicas`).

ipyparallel's controller *drops* an engine that misses its heartbeat for a few
seconds (a dead process, but also a stopped or frozen one). A dropped engine has
no id any more, and asking for it raised a bare ``IndexError: No such engine``;
:func:`require_registered` names the rank instead, and says what to do.
:func:`replace` starts new engines for given ranks (the controller stays, the
other engines and their state stay), the same rank map kept: rank ``r`` is rank
``r`` again, on a fresh process that joins the next world.
"""

from __future__ import annotations

import time

from dtlab.lab.engine import world
from dtlab.lab.kernel import failures, processes


def dropped(cluster) -> list[int]:
    """The ranks whose engine the controller no longer knows."""
    ids = set(cluster.client.ids)
    return [r for r, eid in sorted(cluster.rank_to_engine.items()) if eid not in ids]


def require_registered(cluster, ranks=None) -> None:
    """Raise a clear error if an engine of ``ranks`` (default: all) was dropped:
    :class:`~dtlab.lab.kernel.failures.EngineUnresponsive` if its process is alive,
    :class:`~dtlab.lab.kernel.failures.EngineDied` if not."""
    gone = [r for r in dropped(cluster) if ranks is None or r in ranks]
    if not gone:
        return
    cluster.needs_reset = True
    rank = gone[0]
    pid = cluster.local_pids().get(rank)
    if pid is not None and not processes.alive(pid):
        raise failures.EngineDied(
            f"rank {rank}'s engine (pid {pid}) is gone; call cluster.restart() for "
            "new engines"
        )
    frozen = pid is not None and processes.stopped(pid)
    raise failures.unresponsive(
        rank,
        pid,
        "it missed ipyparallel's heartbeat"
        + (" (its process is stopped)" if frozen else "")
        + " and the controller dropped it; cluster.reset() replaces it with a new "
        "engine for the same rank (its variables are lost)",
        stopped=frozen,
    )


def replace(cluster, ranks, *, timeout: float | None = None) -> dict[int, int]:
    """New engines for ``ranks`` (their old processes, if any, are killed first);
    returns ``{rank: new pid}``. The caller forms the next world (``reset``)."""
    ranks = sorted(ranks)
    old = cluster.local_pids()
    processes.wait_gone(processes.kill([old[r] for r in ranks if r in old]))
    known = set(cluster.client.ids)
    processes.start_engines(cluster.ipp_cluster, len(ranks))
    deadline = time.monotonic() + (timeout or cluster.start_timeout)
    while True:
        fresh = sorted(set(cluster.client.ids) - known)
        if len(fresh) >= len(ranks):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"new engines for ranks {ranks} did not register within "
                f"{timeout or cluster.start_timeout:.0f}s"
            )
        time.sleep(0.05)
    for rank, eid in zip(ranks, fresh):
        cluster.rank_to_engine[rank] = eid
    cluster.connect_view()
    where = cluster.view.apply_async(world.whereami).get(timeout=cluster.start_timeout)
    cluster.place(where)
    cluster.needs_reset = True
    return {r: cluster.pids[r] for r in ranks}


def replace_dropped(cluster) -> list[int]:
    """Replace the engines the controller dropped whose process is alive (it
    missed heartbeats while stopped, and resumed): only a new engine can take the
    rank again. Says so, and returns those ranks."""
    lost = dropped(cluster)
    if lost:
        new = replace(cluster, lost)
        print(
            f"the controller had dropped the engines of ranks {lost} (they missed "
            f"its heartbeat): replaced by new engines, pids {new}; their variables "
            "are gone"
        )
    return lost

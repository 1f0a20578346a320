"""A training run that survives the loss of a replica: the engine is replaced, its
state copied from a healthy replica, and the loss curve goes on as if nothing had
happened (chapter 08, next to checkpoints; the idea of torchft).

    run = train(cluster, config, survive=True)      # dtlab.lab.training.train
    run.losses()                                    # the curve of an unbroken run
    run.lost                                        # what happened, and its cost

Under data parallelism (DDP: ``strategy="ddp"``, over the whole world or a dp × tp
/ dp × pp layout) each rank's state is held whole by every rank of its dp group. So
when an engine dies mid-run:

1. the run's call ends with :class:`~dtlab.lab.failures.EngineDied` (its peers'
   collectives fail within milliseconds: the dead process's sockets close);
2. a new engine takes the dead rank (:func:`dtlab.lab.engines.replace`) and the
   world is formed again (``reset``), every other engine and its memory kept;
3. the ranks resume after the newest step they all finished, the newcomer's state
   sent to it by a replica (:mod:`dtlab.lab.engine.replica`), and train to the end.

Nothing is asked of the learner. ZeRO shards the state, so a lost rank's shard
exists nowhere else: such runs are refused here (``dtlab.checkpoint`` keeps sharded
checkpoints for them). Each loss is recorded in :attr:`TrainRun.lost
<dtlab.lab.training.TrainRun>` with its timings: from the dead rank's last
heartbeat to the error (``detect_s``), a new engine (``replace_s``), the new world
(``reset_s``), the state copy (``restore_s``), and the steps done again.
"""

from __future__ import annotations

import statistics
import time

from dtlab.events import Kind
from dtlab.lab import engines, failures, processes
from dtlab.lab.engine import replica
from dtlab.lab.failures import EngineDied


def check(config, world_size: int) -> None:
    """``ValueError`` unless every rank's state has a replica to restore it from."""
    layout = config.resolve_layout(world_size)
    if config.strategy != "ddp":
        raise ValueError(
            f"survive=True copies a lost rank's state from a replica, but "
            f"strategy={config.strategy!r} shards it (no other rank holds it): use "
            "strategy='ddp', or dtlab.checkpoint's sharded checkpoints"
        )
    if layout.dp < 2:
        raise ValueError(
            f"survive=True needs dp >= 2 (a replica of every rank), got {layout}: "
            "give the layout a data-parallel degree of 2 or more"
        )


def train_surviving(
    cluster,
    config,
    *,
    on_events=None,
    timeout: float = 600.0,
    publish_interval: float = 0.1,
    pace: float = 0.0,
    max_losses: int = 3,
):
    """Train ``config`` on ``cluster`` through up to ``max_losses`` lost engines;
    returns ``(outputs per rank, losses, seconds)`` (see the module docstring).
    ``on_events`` gets the run's telemetry, each step once (the steps done again
    after a loss are not sent twice)."""
    check(config, cluster.world_size)
    newest = {}  # rank -> newest step handed on

    def once(batch):
        fresh = []
        for e in batch:
            if e.get("kind") == Kind.STEP:
                if e["step"] <= newest.get(e["rank"], -1):
                    continue
                newest[e["rank"]] = e["step"]
            fresh.append(e)
        if fresh and on_events is not None:
            on_events(fresh)

    lost, newcomers = [], ()
    t0 = time.perf_counter()
    while True:
        try:
            out = cluster.run(
                replica.train,
                config,
                newcomers,
                pace,
                timeout=timeout,
                record=True,
                on_events=once,
                publish_interval=publish_interval,
            )
            break
        except EngineDied as exc:
            if len(lost) >= max_losses:
                raise
            lost.append(_replace(cluster, exc, max(newest.values(), default=-1)))
            newcomers = tuple(lost[-1]["ranks"])
    seconds = time.perf_counter() - t0
    for loss in lost:
        loss["restore_s"] = max(o["restored"]["seconds"] for o in out)
        loss["restored_bytes"] = max(o["restored"]["bytes"] for o in out)
        loss["resumed_after"] = out[0]["resumed_after"]
    return out, lost, seconds


def _replace(cluster, error, newest_step: int) -> dict:
    """Replace the engines that died; how long each part took."""
    detected = time.time()
    local = cluster.local_pids()
    dead = sorted(r for r, pid in local.items() if not processes.alive(pid))
    dead += [r for r in engines.dropped(cluster) if r not in dead]
    if not dead:
        raise error
    beats = [failures.read_heartbeat(cluster.board_file(r)) for r in dead]
    last = max((b["t"] for b in beats if b), default=None)
    t = time.perf_counter()
    engines.replace(cluster, dead)
    replaced = time.perf_counter()
    cluster.reset()
    return {
        "ranks": dead,
        "error": str(error).split("\n", 1)[0],
        "newest_step": newest_step,
        # a beat every 0.5 s: the death was at most that long after the last one
        "detect_s": detected - last if last is not None else None,
        "replace_s": replaced - t,
        "reset_s": time.perf_counter() - replaced,
    }


def time_lost(records: list[dict], seconds: float, steps: int) -> float:
    """Seconds the run took beyond ``steps`` steps at its median step time."""
    times = [r["time_s"] for r in records if "time_s" in r]
    return seconds - steps * statistics.median(times) if times else 0.0

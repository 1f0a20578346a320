"""A training run that survives the loss of a replica: the engine is replaced, its
state copied from a healthy replica, and the loss curve goes on as if nothing had
happened (chapter 08, next to checkpoints; the idea of torchft).

    run = cluster.train(config, survive=True)  # kernel.training.train_on_cluster
    run.losses()                                    # the curve of an unbroken run
    run.lost                                        # what happened, and its cost

A rank's state exists on the ranks that hold the same shards
(:func:`dtlab.lab.engine.replica.holders`): under DDP its dp group (dp·cp with
context parallelism), narrowed for a mixture of experts to the ranks that hold the
same experts (the expert-data-parallel group); under HSDP its replicate group. Its
random state is its own, and the ranks hand it to each other after every step. So
when an engine dies mid-run:

1. the run's call ends with :class:`~dtlab.lab.kernel.failures.EngineDied` (its peers'
   collectives fail within milliseconds: the dead process's sockets close);
2. a new engine takes the dead rank (:func:`dtlab.lab.kernel.replacing.replace`) and the
   world is formed again (``reset``), every other engine and its memory kept;
3. the ranks resume after the newest step they all finished, the newcomer's state
   sent to it by one of its holders (:mod:`dtlab.lab.engine.replica`), and train to
   the end. A death loses the records in flight of every rank (the call that
   failed is not listened to any more), so the notebook tells the ranks which
   steps it has of each, and every rank sends again the ones it lacks (marked
   ``recovered``; the newcomer the lost rank's); the steps done again and the
   records sent twice are dropped here, so every step reaches ``on_events`` once.

Nothing is asked of the learner. Where a rank's state exists nowhere else, the run
is refused before any engine is touched (:func:`check`): ZeRO over every replica
(its shard is the only one: ``dtlab.checkpoint`` keeps sharded checkpoints for
it), a layout without data parallelism, and experts each held by one rank. Each
loss is recorded in :attr:`TrainRun.lost <dtlab.lab.kernel.training.TrainRun>` with its
own step and timings: when in the run it was seen (``at_s``), from the dead rank's
last heartbeat to the error (``detect_s``), a new engine (``replace_s``), the new
world (``reset_s``), the new engine's imports (``warm_s``), the trainers built
again (``build_s``: the new engine's, the slowest), the state copy (``restore_s``,
``restored_bytes``) and the step resumed after (``resumed_after``).
"""

from __future__ import annotations

import statistics
import time

from dtlab.events import Kind
from dtlab.lab.engine import replica
from dtlab.lab.engine.replica import holders
from dtlab.lab.kernel import failures, processes, replacing
from dtlab.lab.kernel.failures import EngineDied


def check(config, world_size: int) -> None:
    """``ValueError`` unless every rank's state is held by another rank too
    (:func:`~dtlab.lab.engine.replica.holders`), saying which and why."""
    layout = config.resolve_layout(world_size)
    alone = [r for r in range(world_size) if len(holders(config, layout, r)) < 2]
    if not alone:
        return
    if layout.dp * layout.cp < 2:
        raise ValueError(
            f"survive=True needs dp >= 2 (dp·cp >= 2 with context parallelism: a "
            f"replica of every rank), got {layout}: give the layout a "
            "data-parallel degree of 2 or more"
        )
    if config.zero_stage is not None and config.zero_shard_size is None:
        raise ValueError(
            f"survive=True copies a lost rank's state from a replica, but "
            f"strategy={config.strategy!r} shards it (no other rank holds it): use "
            "strategy='ddp', HSDP (zero_shard_size) or dtlab.checkpoint's sharded "
            "checkpoints"
        )
    if layout.ep > 1:
        raise ValueError(
            f"survive=True needs each expert on two ranks or more, but {layout} "
            f"spreads the experts over ep={layout.ep} of its dp·cp="
            f"{layout.dp * layout.cp} replicas: each is held by one rank only; use "
            f"ep <= {layout.dp * layout.cp // 2} (dp·cp / 2)"
        )
    raise ValueError(  # HSDP with one shard group: ZeRO over every replica
        f"survive=True needs a replica of every rank's state, but rank {alone[0]}'s "
        f"is held by no other rank under {config.strategy} with zero_shard_size="
        f"{config.zero_shard_size}: use a shard size below the dp·cp replicas"
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
    ``on_events`` gets the run's telemetry, each step of each rank once: the steps
    done again after a loss are not sent twice, and those lost in flight are sent
    again by their rank (by the newcomer for a lost rank; marked ``recovered``)."""
    check(config, cluster.world_size)
    handed: dict[int, set[int]] = {}  # rank -> the steps handed on
    lost, newcomers = [], []
    t0 = time.perf_counter()

    def once(batch):
        fresh = []
        for e in batch:
            kind = e.get("kind")
            if kind == Kind.STEP:
                steps = handed.setdefault(e["rank"], set())
                if e["step"] in steps:
                    continue
                steps.add(e["step"])
            elif kind == Kind.CONTROL and e.get("what") == "resumed" and lost:
                _resumed(lost[-1], e)
            fresh.append(e)
        if fresh and on_events is not None:
            on_events(fresh)

    while True:
        try:
            out = cluster.run(
                replica.train_resuming,
                config,
                newcomers,
                pace,
                {r: sorted(steps) for r, steps in handed.items()},
                timeout=timeout,
                record=True,
                on_events=once,
                publish_interval=publish_interval,
            )
            break
        except EngineDied as exc:
            if len(lost) >= max_losses:
                raise
            at = time.perf_counter() - t0
            newest = max((max(s) for s in handed.values() if s), default=-1)
            loss = _replace(cluster, exc, newest)
            # what the ranks report once they resumed (None: they never did)
            loss.update(at_s=at, resumed_after=None, build_s=None, restore_s=None)
            loss["restored_bytes"] = None
            lost.append(loss)
            newcomers = loss["ranks"]
    seconds = time.perf_counter() - t0
    if lost:  # the last recovery, as the ranks returned it (the same numbers)
        for o in out:
            _resumed(lost[-1], {"after": o["resumed_after"], **o["restored"]})
    return out, lost, seconds


def _resumed(loss: dict, event: dict) -> None:
    """Fold one rank's report of a recovery into the record of its loss: the step
    resumed after (the same on every rank), the slowest rank's seconds (building
    its trainer, copying the state) and the most bytes one rank received."""
    loss["resumed_after"] = event["after"]
    loss["build_s"] = max(loss["build_s"] or 0.0, event["build_s"])
    loss["restore_s"] = max(loss["restore_s"] or 0.0, event["seconds"])
    loss["restored_bytes"] = max(loss["restored_bytes"] or 0, event["bytes"])


def _replace(cluster, error, newest_step: int) -> dict:
    """Replace the engines that died; how long each part took."""
    detected = time.time()
    local = cluster.local_pids()
    dead = sorted(r for r, pid in local.items() if not processes.alive(pid))
    dead += [r for r in replacing.dropped(cluster) if r not in dead]
    if not dead:
        raise error
    beats = [failures.read_heartbeat(cluster.board_file(r)) for r in dead]
    last = max((b["t"] for b in beats if b), default=None)
    t = time.perf_counter()
    replacing.replace(cluster, dead)
    replaced = time.perf_counter()
    cluster.reset()
    reset = time.perf_counter()
    # the new engine imports the library now, not while its peers wait for it
    # inside the first collective of the resume (which has the group's timeout)
    cluster.run(replica.warm)
    return {
        "ranks": dead,
        "error": str(error).split("\n", 1)[0],
        "newest_step": newest_step,
        # a beat every 0.5 s: the death was at most that long after the last one
        "detect_s": detected - last if last is not None else None,
        "replace_s": replaced - t,
        "reset_s": reset - replaced,
        "warm_s": time.perf_counter() - reset,
    }


def time_lost(records: list[dict], seconds: float, steps: int) -> float:
    """Seconds the run took beyond ``steps`` steps at its median step time."""
    times = [r["time_s"] for r in records if "time_s" in r]
    return seconds - steps * statistics.median(times) if times else 0.0

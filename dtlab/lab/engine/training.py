"""The training loops that run on every engine: what the notebook's
:func:`dtlab.lab.kernel.training.train_on_cluster` and
:func:`dtlab.lab.kernel.training.start_run` ship.

Both run :class:`dtlab.train.Trainer` on the topology the engine made at start,
when the config's layout fits it. :func:`train_rank_stoppable` trains one step at
a time and, after each, agrees with the other ranks on whether Stop was pressed
(chapter 07):

1. a SIGUSR1 handler, installed on the engine's main thread, only sets a flag
   (:mod:`dtlab.lab.engine.stop`);
2. after every step the ranks all-reduce (MAX) their flags, tagged ``"control"``:
   a stop seen by any rank is seen by all, so every rank leaves the loop after the
   *same* step, with no collective left half done;
3. a rank announces (telemetry event ``kind="control", what="ready"``) once its
   handler is in place: until then the notebook holds the signal back, because a
   SIGUSR1 with no handler would end the engine process.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from dtlab import comm, telemetry
from dtlab.events import Kind
from dtlab.lab.engine.state import user_namespace
from dtlab.lab.engine.stop import (
    clear_stop_request,
    install_stop_handler,
    stop_requested,
)
from dtlab.train import TrainConfig, Trainer, default_device


def engine_topology(config: TrainConfig):
    """The topology the engine made at start (the one ``%%px`` cells see) when its
    layout fits, so that run after run does not pile up new process groups."""
    topo = user_namespace().get("topo")
    layout = config.resolve_layout(dist.get_world_size())
    if topo is None or getattr(topo, "released", False) or topo.layout != layout:
        return None
    return topo


def train_rank(config: TrainConfig) -> list[dict]:
    """Train ``config`` on this rank; its per-step records."""
    return Trainer(config, engine_topology(config)).fit()


def train_rank_stoppable(config: TrainConfig, pace: float = 0.0) -> dict:
    """``config.steps`` steps, one ``fit(1)`` at a time, leaving after the first step
    at which any rank saw a stop request. ``pace``: seconds of sleep between steps
    (a watchable run). Returns the records, the step it stopped after (``None``:
    it ran to the end) and when this rank's loop ended."""
    rec = telemetry.current()
    stoppable = install_stop_handler()
    rec.emit(
        Kind.CONTROL, what="ready" if stoppable else "unstoppable", pid=os.getpid()
    )
    rec.flush()  # the notebook learns now, not at the next publication
    trainer = Trainer(config, engine_topology(config))
    device = default_device()  # a device tensor for nccl's all-reduce
    stopped_at = None
    for step in range(config.steps):
        trainer.fit(1)
        if step == config.steps - 1:
            break  # the last step: nothing left to stop
        if pace > 0:
            time.sleep(pace)  # a watchable run: the dashboard has time to redraw
        flag = torch.tensor([1.0 if stop_requested() else 0.0], device=device)
        # one rank's request is every rank's: all leave after the same step
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, tag="control")
        if flag.item() > 0:
            stopped_at = step
            rec.emit(Kind.CONTROL, what="stopped", at_step=step)
            break
    clear_stop_request()
    return {"records": trainer.records, "stopped_at": stopped_at, "t_end": time.time()}

"""The engine's side of a training run that survives a lost replica (chapter 08,
next to checkpoints; the idea of torchft).

Under data parallelism every rank of a dp group holds the same training state (DDP
replicates it: model, optimizer, step), so the loss of one rank loses nothing its
replicas do not hold. :func:`train` runs ``config`` one step at a time and keeps,
after each step that every rank finished, a copy of this rank's state
(:meth:`dtlab.train.Trainer.state_dict`) and its records, in this engine's memory:
the last :data:`KEEP` of them.

When an engine dies, the notebook (:mod:`dtlab.lab.replicas`) replaces it and
calls :func:`train` again on every rank with ``newcomers``, the ranks on new
engines. Then, in the new world:

1. the ranks agree on the step to resume after: the newest step that every
   survivor kept (an all-reduce MIN; a rank can be one step ahead of another if the
   death fell inside a step's last collective);
2. every rank builds its trainer again (the groups are new); a survivor loads its
   own copy of that step;
3. each newcomer receives the copy of a survivor of its dp group (the same tensor
   and pipeline coordinates: the same shards) as bytes over ``dtlab.comm`` (tag
   ``"replica"``), with the records so far;
4. training goes on from the next step, with the losses the run would have had.

Every step ends with a barrier-like all-reduce of the step number (tag
``"control"``) before its copy is kept, so a kept step is one that every rank
completed.
"""

from __future__ import annotations

import copy
import io
import time
from collections import deque

import torch
import torch.distributed as dist

from dtlab import comm
from dtlab.lab.engine.training import engine_topology
from dtlab.topology import Layout
from dtlab.train import TrainConfig, Trainer, default_device

KEEP = 2  # copies of the newest steps kept per rank
TAG = "replica"
# this engine's copies: {"config": dict, "copies": deque of (step, state, records)}
_kept: dict = {}


def train(config: TrainConfig, newcomers=(), pace: float = 0.0) -> dict:
    """Train ``config`` to its last step on this rank, resuming if the run was
    interrupted (see the module docstring); ``newcomers``: the ranks whose engines
    are new. Returns this rank's records, the step resumed after (``None``: from
    the start), and what resuming cost (seconds, bytes received)."""
    layout = config.resolve_layout(dist.get_world_size())
    trainer = Trainer(config, engine_topology(config))
    resumed_after, restored = None, {"seconds": 0.0, "bytes": 0}
    if newcomers:
        t0 = time.perf_counter()
        resumed_after, restored["bytes"] = _resume(trainer, config, layout, newcomers)
        restored["seconds"] = time.perf_counter() - t0
    else:
        _kept.clear()
        _kept.update(config=config.to_dict(), copies=deque(maxlen=KEEP))
        _keep(trainer)  # step -1: the initial state, should the first step fail
    device = default_device()
    while trainer.step < config.steps:
        trainer.fit(1)
        done = torch.tensor([float(trainer.step)], device=device)
        # every rank finished this step: only then is its copy worth keeping
        comm.all_reduce(done, op=comm.ReduceOp.MIN, tag="control")
        _keep(trainer)
        if pace > 0:
            time.sleep(pace)
    return {
        "records": trainer.records,
        "resumed_after": resumed_after,
        "restored": restored,
    }


def _keep(trainer: Trainer) -> None:
    state = copy.deepcopy(trainer.state_dict())
    records = [dict(r) for r in trainer.records]
    _kept["copies"].append((trainer.step - 1, state, records))


def _resume(trainer, config, layout: Layout, newcomers) -> tuple[int, int]:
    """Steps 1-3 of the module docstring; returns (step resumed after, bytes this
    rank received)."""
    rank, device = dist.get_rank(), default_device()
    mine = rank not in newcomers
    if mine and _kept.get("config") != config.to_dict():
        raise RuntimeError(
            f"rank {rank} kept no copy of this run: the engines that survived must "
            "be the ones that trained it"
        )
    newest = max(s for s, _, _ in _kept["copies"]) if mine else float("inf")
    agreed = torch.tensor([float(newest)], device=device)
    comm.all_reduce(agreed, op=comm.ReduceOp.MIN, tag=TAG)
    step = int(agreed.item())
    copies = {s: (state, records) for s, state, records in _kept.get("copies", [])}
    if mine and step not in copies:
        raise RuntimeError(f"rank {rank} kept steps {sorted(copies)}, not {step}")
    received = 0
    for newcomer in sorted(newcomers):
        source = _source(layout, newcomer, newcomers)
        if rank == source:
            _send(copies[step], newcomer)
        elif rank == newcomer:
            state, records, received = _receive(source)
            state["coords"] = dict(trainer.topo.coords)  # a replica's, at ours
            for r in records:
                r.update(rank=rank, coords=dict(trainer.topo.coords))
                r["restored_from"] = source
            copies[step] = (state, records)
    state, records = copies[step]
    trainer.load_state_dict(copy.deepcopy(state))
    trainer.records = [dict(r) for r in records]
    _kept.update(config=config.to_dict(), copies=deque(maxlen=KEEP))
    _keep(trainer)
    return step, received


def _source(layout: Layout, newcomer: int, newcomers) -> int:
    """A survivor holding ``newcomer``'s state: one of its dp group (same tensor
    and pipeline coordinates)."""
    replicas = [r for r in layout.group_of("dp", newcomer) if r not in newcomers]
    if not replicas:
        raise RuntimeError(
            f"every replica of rank {newcomer}'s state was lost (its dp group "
            f"{layout.group_of('dp', newcomer)}): nothing to restore it from"
        )
    return replicas[0]


def _send(kept, dst: int) -> None:
    buffer = io.BytesIO()
    torch.save(kept, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    comm.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, tag=TAG)
    comm.send(payload, dst, tag=TAG)


def _receive(src: int):
    size = torch.zeros(1, dtype=torch.int64)
    comm.recv(size, src, tag=TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    comm.recv(payload, src, tag=TAG)
    state, records = torch.load(
        io.BytesIO(payload.numpy().tobytes()), weights_only=False
    )
    return state, records, payload.numel()

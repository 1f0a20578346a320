"""The engine's side of a training run that survives a lost replica (chapter 08,
next to checkpoints; the idea of torchft).

A rank's training state is its weights, its optimizer state, its step and its
random state (:meth:`dtlab.train.Trainer.state_dict`). The first three are held
alike by the ranks that hold the same shards (:func:`holders`): under DDP every
rank of its dp (dp·cp) group, and for a mixture of experts the ranks of its
expert-data-parallel group, which hold the same experts too; under HSDP the ranks
of its replicate group. The random state is a rank's own (each rank draws its own
dropout masks), so after every step the ranks hand each other theirs, with their
newest record (one small all-gather, tag ``"replica"``): then nothing of a lost
rank exists on it alone.

:func:`train_resuming` runs ``config`` one step at a time and keeps, after each
step that every rank finished, a copy of this rank's state and records and every rank's
random state and records, in this engine's memory (the newest :data:`KEEP`).

When an engine dies, the notebook (:mod:`dtlab.lab.kernel.replicas`) replaces it and
calls :func:`train_resuming` again on every rank with ``newcomers``, the ranks on new
engines. Then, in the new world:

1. the ranks agree on the step to resume after: the newest step that every
   survivor kept (an all-reduce MIN; a rank can be one step ahead of another if the
   death fell inside a step's last collective);
2. every rank builds its trainer again (the groups are new); a survivor loads its
   own copy of that step;
3. each newcomer receives, as bytes over ``dtlab.comm`` (tag ``"replica"``), from
   the first survivor among its holders: that survivor's state with the lost
   rank's own random state in it, and the lost rank's records; it keeps its own
   coordinates;
4. every rank sends the notebook again, marked ``recovered``, each of its records
   up to that step that the notebook does not have (``handed``: the steps it
   has, per rank). A death loses records in flight on every rank, not only the
   dead one's: the notebook stops listening to the call as soon as it sees the
   engine gone, and what the survivors publish after that (their last steps,
   flushed as their calls fail) never reaches it. The notebook drops a step it
   already has, so every step reaches it once;
5. training goes on from the next step, with the losses the run would have had.

Every step ends with a barrier-like all-reduce of the step number (tag
``"control"``) before its copy is kept, so a kept step is one that every rank
completed.
"""

from __future__ import annotations

import copy
import time
from collections import deque

import torch
import torch.distributed as dist

from dtlab import comm, telemetry
from dtlab.events import Kind
from dtlab.lab.engine.training import engine_topology
from dtlab.objects import all_gather_objects, recv_object, send_object
from dtlab.topology import Layout
from dtlab.train import TrainConfig, Trainer, default_device

KEEP = 2  # copies of the newest steps kept per rank
TAG = "replica"
# this engine's copies: {"config": dict, "copies": deque of (step, state, records),
# "peers": {rank: {"rng": deque of (step, random state), "records": [...]}}}
_kept: dict = {}


def holders(config: TrainConfig, layout: Layout, rank: int) -> list[int]:
    """The ranks that hold the same weights and optimizer state as ``rank`` (itself
    included): where a lost rank's state can be copied from.

    - DDP: its expert-data-parallel group (``edp``): the dp·cp replicas of its
      tensor and pipeline slice that hold the same experts; without experts
      (ep = 1) that is every dp·cp replica.
    - HSDP (ZeRO with ``zero_shard_size``): its replicate group, the ranks at its
      place in the other shard groups.
    - ZeRO over every replica: itself alone (its shard is nowhere else).
    """
    if config.zero_stage is None:
        return layout.group_of("edp", rank)
    if config.zero_shard_size is None:
        return [rank]
    ranks = layout.group_of("dp_cp" if layout.cp > 1 else "dp", rank)
    size = config.zero_shard_size
    return ranks[ranks.index(rank) % size :: size]


def warm() -> None:
    """Nothing: calling it on a new engine imports this module, and with it
    :mod:`dtlab.train` and every technique (seconds on a cold engine)."""


def train_resuming(
    config: TrainConfig, newcomers=(), pace: float = 0.0, handed=None
) -> dict:
    """Train ``config`` to its last step on this rank, resuming if the run was
    interrupted (see the module docstring). ``newcomers``: the ranks whose engines
    are new; ``handed``: ``{rank: the steps of its records the notebook has}``,
    the rest of those up to the step resumed after are sent again. Returns this
    rank's records, the step resumed after (``None``: from the start), and what
    resuming cost: seconds from the ranks' agreement to the state loaded, bytes
    received, and seconds building the trainer (the one a new engine builds first
    is the slowest)."""
    newcomers = sorted(newcomers)
    layout = config.resolve_layout(dist.get_world_size())
    t0 = time.perf_counter()
    trainer = Trainer(config, engine_topology(config))
    resumed_after = None
    restored = {"seconds": 0.0, "bytes": 0, "build_s": time.perf_counter() - t0}
    if newcomers:
        resumed_after, restored["bytes"], restored["seconds"] = _resume(
            trainer, config, layout, newcomers
        )
        rec = telemetry.current()
        for r in unsent(trainer.records, (handed or {}).get(dist.get_rank(), ())):
            rec.emit(Kind.STEP, **r)  # step 4 of the module docstring
        rec.emit(Kind.CONTROL, what="resumed", after=resumed_after, **restored)
        rec.flush()  # the notebook learns now, even if this attempt dies later
    else:
        _kept.clear()
        _kept.update(config=config.to_dict(), copies=deque(maxlen=KEEP), peers={})
        _keep(trainer, every_record=True)  # step -1: should the first step fail
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


def unsent(records: list[dict], handed) -> list[dict]:
    """The ``records`` whose steps are not in ``handed`` (the steps the notebook
    has of this rank), marked ``recovered``: what a rank sends again on resuming."""
    handed = set(handed)
    return [{**r, "recovered": True} for r in records if r["step"] not in handed]


def _keep(trainer: Trainer, every_record: bool = False) -> None:
    """Keep a copy of this rank's state and records at its newest step, and every
    rank's random state and newest record (all of them: ``every_record``). The copy
    counts only once the exchange is done, so a kept step has its peers' too."""
    step = trainer.step - 1
    state = copy.deepcopy(trainer.state_dict())
    records = [dict(r) for r in trainer.records]
    since = 0 if every_record else max(len(records) - 1, 0)
    mine = {"rng": trainer.random_state(), "since": since, "records": records[since:]}
    for rank, theirs in enumerate(_all_gather_objects(mine)):
        peer = _kept["peers"].setdefault(
            rank, {"rng": deque(maxlen=KEEP + 1), "records": []}
        )
        peer["rng"].append((step, theirs["rng"]))
        peer["records"][theirs["since"] :] = theirs["records"]
    _kept["copies"].append((step, state, records))


def _resume(trainer, config, layout: Layout, newcomers: list[int]):
    """Steps 1-3 of the module docstring; returns the step resumed after, the bytes
    this rank received and the seconds from the agreement to the state loaded."""
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
    t0 = time.perf_counter()  # every rank is here: what follows is the copy
    step = int(agreed.item())
    copies = {s: (state, records) for s, state, records in _kept.get("copies", [])}
    if mine and step not in copies:
        raise RuntimeError(f"rank {rank} kept steps {sorted(copies)}, not {step}")
    received = 0
    for newcomer in sorted(newcomers):
        source = _source(config, layout, newcomer, newcomers)
        if rank == source:
            _send(_theirs(copies[step][0], step, newcomer), newcomer)
        elif rank == newcomer:
            state, records, received = _receive(source)
            state["coords"] = dict(trainer.topo.coords)  # its holder's, at ours
            for r in records:
                r["restored_from"] = source
            copies[step] = (state, records)
    state, records = copies[step]
    trainer.load_state_dict(copy.deepcopy(state))
    trainer.records = [dict(r) for r in records]
    seconds = time.perf_counter() - t0
    _kept.update(config=config.to_dict(), copies=deque(maxlen=KEEP), peers={})
    _keep(trainer, every_record=True)
    return step, received, seconds


def _theirs(state: dict, step: int, newcomer: int):
    """What a lost rank needs: this rank's ``state`` at ``step`` (the same shards)
    with the lost rank's own random state in it, and the lost rank's records."""
    peer = _kept["peers"][newcomer]
    rng = dict(peer["rng"])[step]
    records = [dict(r) for r in peer["records"] if r["step"] <= step]
    return {**state, "rng": rng}, records


def _source(config, layout: Layout, newcomer: int, newcomers) -> int:
    """A survivor holding ``newcomer``'s state (:func:`holders`)."""
    group = holders(config, layout, newcomer)
    replicas = [r for r in group if r not in newcomers]
    if not replicas:
        raise RuntimeError(
            f"every rank holding rank {newcomer}'s state was lost ({group}): "
            "nothing to restore it from"
        )
    return replicas[0]


def _all_gather_objects(obj) -> list:
    """Every rank's ``obj`` (small: a random state and a record), as bytes through
    ``dtlab.comm``."""
    return all_gather_objects(obj, device=default_device(), tag=TAG)


def _send(kept, dst: int) -> None:
    send_object(kept, dst, device=default_device(), tag=TAG)


def _receive(src: int):
    (state, records), nbytes = recv_object(src, device=default_device(), tag=TAG)
    return state, records, nbytes

"""Sharded checkpoints of ZeRO-sharded training, and whole-model state gathered back.

Taught in chapter 03 (ZeRO), next to :mod:`dtlab.zero`.

Under ZeRO no rank holds the whole model state, so no rank can write it alone. Each
rank writes its own pieces instead (``rank00003.pt``: its local shard of every
parameter, elements ``[start, stop)`` of the flattened parameter, and the optimizer
state of that piece) and rank 0 adds ``meta.json``, the layout: every unit's
parameters with their offsets, and the world size the slices were cut for. This is
what PyTorch's distributed checkpoint (DCP) does with FSDP's sharded state dicts.

Loading at the same world size reads one file per rank and restores training
exactly. Loading at another world size *reshards*: the flat layout of a unit does
not depend on N (only its padding does), so the old rank j's piece of a parameter is
known from the layout, and new rank r's piece is cut from the old pieces that
overlap it. Per-element optimizer state (Adam's momentum and variance) is cut the
same way; per-tensor state (the step count, the same in every piece of a parameter)
is copied. :func:`gather_full_optimizer_state` and ``model.gather_full_params()``
give the whole thing in the unwrapped model's names, for export or comparison.

Under DDP every rank holds the same state, so one rank writes it
(:func:`save_replicated`) and any number of ranks reads it back. :func:`save_training`
and :func:`load_training` do either for a :class:`dtlab.train.Trainer`, with the step
counter and each rank's random state (torch's generators and tensor parallelism's
dropout streams: :meth:`dtlab.train.Trainer.random_state`), so that a run stopped at
step k and resumed gives the same loss curve as one that never stopped, dropout on.
"""

from __future__ import annotations

import json
import os

import torch

from dtlab import comm

__all__ = [
    "save_sharded",
    "load_sharded",
    "gather_full_optimizer_state",
    "save_replicated",
    "load_replicated",
    "save_training",
    "load_training",
]

META = "meta.json"


def _file(path, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.pt")


def _sharded(model):
    """``model`` itself, if it is a ZeRO wrapper."""
    from dtlab.zero import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        raise ValueError(
            f"{type(model).__name__} is not a dtlab.zero.FullyShardedDataParallel: "
            "wrap the model first (torch.save suits an unsharded one)"
        )
    whole = [u["name"] for u in model.units if u.get("replicated")]
    if whole:
        raise NotImplementedError(
            f"units {whole} are replicated (FullyShardedDataParallel(replicate=...)): "
            "the sharded checkpoint saves slices of sharded units only; save such a "
            "model without replicate, or its full state dict"
        )
    return model


def _check_optimizer(model, optimizer) -> None:
    ours = {id(p) for p in model.parameters()}
    theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not theirs <= ours:
        raise ValueError(
            "the optimizer steps tensors that are not this model's shards: build it "
            "over model.parameters() of the FullyShardedDataParallel"
        )


def _elementwise(value, tensor) -> bool:
    """Whether an optimizer state value holds one number per element of ``tensor``
    (Adam's moments), not one per tensor (its step count)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == tensor.shape


def _saved(value, flat: bool):
    """A state value as a checkpoint keeps it: on the CPU, flattened if per
    element."""
    if not torch.is_tensor(value):
        return value
    value = value.detach().cpu().clone()
    return value.reshape(-1) if flat else value


def save_sharded(path, model, optimizer=None, *, extra: dict | None = None) -> str:
    """Every rank writes its pieces to ``path/rankNNNNN.pt``; rank 0 writes
    ``path/meta.json``. A collective (ends with a barrier). Returns ``path``."""
    model = _sharded(model)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    pieces = {}
    for shard in model.local_shards():
        entry = {
            "start": shard.start,
            "stop": shard.stop,
            "tensor": shard.tensor.detach().reshape(-1).cpu().clone(),
        }
        if optimizer is not None and shard.tensor in optimizer.state:
            state = optimizer.state[shard.tensor]
            flat = [k for k, v in state.items() if _elementwise(v, shard.tensor)]
            entry["elementwise"] = flat
            entry["state"] = {k: _saved(v, k in flat) for k, v in state.items()}
        pieces[shard.name] = entry
    rank = model.rank if model.n_shards > 1 else 0
    payload = {
        "world_size": model.n_shards,
        "rank": rank,
        "stage": model.stage,
        "params": pieces,
        "param_groups": (
            [
                {k: v for k, v in g.items() if k != "params"}
                for g in optimizer.param_groups
            ]
            if optimizer is not None
            else None
        ),
        "extra": extra or {},
    }
    # one writer per shard: stage 0 has one copy of the whole state, and under HSDP
    # every replica holds the same shards (replica 0 writes them)
    first_replica = model.replica_rank == 0
    if first_replica and (model.n_shards > 1 or model.rank == 0):
        torch.save(payload, _file(path, rank))
    if model.rank == 0 and first_replica:
        units = [
            {
                "name": u["name"],
                "numel": u["numel"],
                "padded": u["padded"],
                "S": u["S"],
                "params": [[name, offset] for name, _, offset in u["params"]],
            }
            for u in model.units
        ]
        meta = {"world_size": model.n_shards, "stage": model.stage, "units": units}
        with open(os.path.join(path, META), "w", encoding="utf-8") as f:
            json.dump(meta, f)
    comm.barrier(model.process_group, tag="checkpoint")
    if model.replicate_group is not None:  # HSDP: replica 0 wrote
        comm.barrier(model.replicate_group, tag="checkpoint")
    return path


def _old_pieces(meta):
    """``{param name: (offset, S)}`` of the saved layout: where each parameter sits
    in its unit's flat buffer, and the slice length the old ranks had."""
    return {
        name: (offset, u["S"]) for u in meta["units"] for name, offset in u["params"]
    }


@torch.no_grad()
def load_sharded(path, model, optimizer=None) -> dict:
    """Restore this rank's pieces (and the optimizer's) from :func:`save_sharded`'s
    files, resharding when the world size changed. A collective. Returns the
    ``extra`` dict saved with the checkpoint."""
    model = _sharded(model)
    path = os.fspath(path)
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        raise ValueError(f"{path} holds no {META}: not a dtlab sharded checkpoint")
    with open(meta_file, encoding="utf-8") as f:
        meta = json.load(f)
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    where = _old_pieces(meta)
    cache: dict[int, dict] = {}

    def old(rank):
        if rank not in cache:
            cache[rank] = torch.load(_file(path, rank), weights_only=True)
        return cache[rank]

    saved = {u["name"]: u["numel"] for u in meta["units"]}
    for u in model.units:
        if saved.get(u["name"]) != u["numel"]:
            raise ValueError(
                f"unit {u['name']!r} ({u['numel']} parameters) is not in the "
                f"checkpoint or has another size there ({saved.get(u['name'])}): it "
                "was saved from a different model"
            )
    for shard in model.local_shards():
        offset, S0 = where[shard.name]
        # the old ranks whose slices overlap mine, and their pieces of the parameter
        first, last = (offset + shard.start) // S0, (offset + shard.stop - 1) // S0
        olds = [old(j)["params"][shard.name] for j in range(first, last + 1)]

        def cut(get, olds=olds, shard=shard):
            """My piece of a per-element tensor, from the old pieces it overlaps."""
            parts = []
            for e in olds:
                a, b = max(shard.start, e["start"]), min(shard.stop, e["stop"])
                parts.append(get(e)[a - e["start"] : b - e["start"]])
            return torch.cat(parts).view_as(shard.tensor)

        shard.tensor.copy_(cut(lambda e: e["tensor"]))
        if optimizer is None or "state" not in olds[0]:
            continue  # no optimizer state: the parameter never had a gradient
        if any(e.get("elementwise") != olds[0]["elementwise"] for e in olds):
            raise ValueError(
                f"the saved pieces of {shard.name} disagree on its optimizer state: "
                "a checkpoint of another run mixed in?"
            )
        new_state = {}
        for key, value in olds[0]["state"].items():
            if key in olds[0]["elementwise"]:
                t = cut(lambda e, key=key: e["state"][key])
                new_state[key] = t.to(shard.tensor.device)
            else:  # per tensor (Adam's step): every piece of the parameter has it
                new_state[key] = value.clone() if torch.is_tensor(value) else value
        optimizer.state[shard.tensor] = new_state
    if optimizer is not None:
        groups = old(0)["param_groups"] or []
        for g, saved_group in zip(optimizer.param_groups, groups):
            g.update(saved_group)
    model.sync_params()  # stages 0-2: the full weights follow the restored slices
    return old(0)["extra"]


@torch.no_grad()
def gather_full_optimizer_state(model, optimizer) -> dict[str, dict]:
    """``{param name: {state key: full tensor}}`` for every parameter that has
    optimizer state: per-element state all-gathered (in each unit's flat layout) and
    cut back into the unwrapped model's parameters, per-tensor state (the step) from
    the rank holding the parameter's first element. The form a single-process
    optimizer keeps. A collective."""
    model = _sharded(model)
    _check_optimizer(model, optimizer)
    shards = {s.name: s for s in model.local_shards()}
    # the keys, from any state this rank holds (every rank runs the same optimizer)
    elementwise, per_tensor = {}, {}
    for s in shards.values():
        for k, v in optimizer.state.get(s.tensor, {}).items():
            if _elementwise(v, s.tensor):
                elementwise[k] = v.dtype
            elif torch.is_tensor(v):
                per_tensor[k] = v.dtype
    out: dict[str, dict] = {}
    for u in model.units:
        names = [name for name, _, _ in u["params"]]
        # per parameter: [has state, per-tensor values...], from its first element's
        # owner; an all-reduce sum gives every rank every row
        rows = torch.zeros(len(names), 1 + len(per_tensor), dtype=torch.float64)
        flats = {k: torch.zeros(u["S"], dtype=dt) for k, dt in elementwise.items()}
        for i, (name, _, offset) in enumerate(u["params"]):
            s = shards.get(name)
            state = optimizer.state.get(s.tensor, {}) if s is not None else {}
            if not state:
                continue
            at = offset + s.start - u["lo"]
            for k in elementwise:
                flats[k][at : at + s.tensor.numel()] = state[k].reshape(-1).cpu()
            if s.start == 0:
                rows[i, 0] = 1.0
                for j, k in enumerate(per_tensor, start=1):
                    rows[i, j] = float(state[k])
        if model.n_shards > 1:
            rows = rows.to(model.device)
            comm.all_reduce(rows, group=model.process_group, tag="zero/gather-full")
            rows = rows.cpu()
        fulls = {k: model.gather_slices(flat) for k, flat in flats.items()}
        for i, (name, shape, offset) in enumerate(u["params"]):
            if not rows[i, 0]:
                continue
            numel = torch.Size(shape).numel()
            entry = out[name] = {}
            for k, full in fulls.items():
                entry[k] = full[offset : offset + numel].view(shape).clone()
            for j, (k, dt) in enumerate(per_tensor.items(), start=1):
                entry[k] = rows[i, j].to(dt).clone()
    return out


# ---- replicated state (DDP) ----------------------------------------------------------
def save_replicated(
    path, module, optimizer=None, *, group=None, extra: dict | None = None
) -> str:
    """Write the state every rank holds alike (a DDP replica and its optimizer):
    group rank 0 writes ``path/replica.pt``; a collective (ends with a barrier)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if comm.group_rank(group) == 0:
        payload = {
            "model": {k: v.detach().cpu() for k, v in module.state_dict().items()},
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "extra": extra or {},
        }
        torch.save(payload, os.path.join(path, "replica.pt"))
    comm.barrier(group, tag="checkpoint")
    return path


@torch.no_grad()
def load_replicated(path, module, optimizer=None) -> dict:
    """Load :func:`save_replicated`'s file on any number of ranks; returns the
    ``extra`` dict. Not a collective: every rank reads the same file."""
    file = os.path.join(os.fspath(path), "replica.pt")
    if not os.path.exists(file):
        raise ValueError(f"{path} holds no replica.pt: not a replicated checkpoint")
    payload = torch.load(file, weights_only=True)
    module.load_state_dict(payload["model"])
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"{path} was saved without an optimizer state")
        optimizer.load_state_dict(payload["optimizer"])
    return payload["extra"]


# ---- a Trainer: model, optimizer, step, random state --------------------------------
def _reshardable(trainer) -> str | None:
    """ "sharded" (ZeRO over dp only) or "replicated" (DDP over dp only): a state
    that can be re-cut for another world; None for tp/pp/16-bit runs, whose state
    is bound to the layout."""
    layout, config = trainer.topo.layout, trainer.config
    if layout.tp > 1 or layout.pp > 1 or config.precision != "fp32":
        return None
    if layout.cp > 1 or layout.ep > 1 or config.zero_shard_size is not None:
        return None  # beyond 3D: bound to its layout too
    return "replicated" if trainer.parts.zero_stage is None else "sharded"


def _sizes(layout) -> dict[str, int]:
    return {a: layout.size(a) for a in ("dp", "tp", "pp", "cp", "ep")}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def save_training(path, trainer) -> str:
    """Save a :class:`dtlab.train.Trainer` mid-run (every rank calls it; a
    collective). Each rank writes its own :meth:`~dtlab.train.Trainer.state_dict`
    (shards, optimizer, loss scaler, step, random state) and its records; for a
    plain DDP or ZeRO run, the weights and optimizer state are also written in a
    form any world size can load (sharded under ZeRO, one copy under DDP). Returns
    ``path``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model, optimizer = trainer.model, trainer.optimizer.optimizer
    layout = trainer.topo.layout
    info = {
        "step": trainer.step,
        "config": trainer.config.to_dict(),
        "layout": _sizes(layout),
        "reshardable": _reshardable(trainer),
    }
    rank = _rank()
    torch.save(
        {"state": trainer.state_dict(), "records": trainer.records},
        os.path.join(path, f"trainer{rank:05d}.pt"),
    )
    if rank == 0:  # what was saved, readable before any tensor is touched
        with open(os.path.join(path, "training.json"), "w", encoding="utf-8") as f:
            json.dump(info, f)
    state = os.path.join(path, "state")
    if info["reshardable"] == "sharded":
        save_sharded(state, model, optimizer)
    elif info["reshardable"] == "replicated":
        save_replicated(state, model.module, optimizer, group=trainer.dp)
    else:
        comm.barrier(tag="checkpoint")  # every rank's file is written
    return path


def load_training(path, trainer) -> int:
    """Restore :func:`save_training`'s checkpoint into a freshly built ``trainer``
    of the same config; returns the step it resumes at.

    At the layout it was saved at, each rank loads its own state: the run goes on
    with the losses of the run that never stopped. At another world size, a plain
    ZeRO run's slices are re-cut and a DDP replica fits any world (the random state
    and the records then start afresh: they belonged to the old ranks); a
    tensor- or pipeline-parallel (or 16-bit) run loads only at its own layout."""
    path = os.fspath(path)
    model, optimizer = trainer.model, trainer.optimizer.optimizer
    file = os.path.join(path, "training.json")
    if not os.path.exists(file):
        raise ValueError(f"{path} holds no training.json: not a save_training folder")
    with open(file, encoding="utf-8") as f:
        saved = json.load(f)
    mine = trainer.config.to_dict()
    if saved["config"]["model"] != mine["model"]:
        raise ValueError(
            f"the checkpoint holds another model ({saved['config']['model']}): "
            "build the trainer with the config it was saved from"
        )
    if saved["config"]["strategy"] != mine["strategy"]:
        was = "a ZeRO" if saved["config"]["strategy"].startswith("zero") else "a DDP"
        raise ValueError(
            f"the checkpoint was saved from {was} run "
            f"(strategy={saved['config']['strategy']!r}): load it with that strategy"
        )
    here = _sizes(trainer.topo.layout)
    own = os.path.join(path, f"trainer{_rank():05d}.pt")
    if {"cp": 1, "ep": 1, **saved["layout"]} == here:  # older ones: dp, tp, pp
        payload = torch.load(own, weights_only=False)  # our own file: config dicts
        trainer.load_state_dict(payload["state"])
        trainer.records = list(payload["records"])
        return trainer.step
    kind = _reshardable(trainer)
    if kind is None or saved["reshardable"] != kind:
        raise ValueError(
            f"the checkpoint was saved at layout {saved['layout']} and this trainer "
            f"runs at {here}: a tensor- or pipeline-parallel (or 16-bit) state loads "
            "only at the layout it was saved at; build the trainer with that layout"
        )
    state = os.path.join(path, "state")
    if kind == "sharded":
        load_sharded(state, model, optimizer)
    else:
        load_replicated(state, model.module, optimizer)
    trainer.step = int(saved["step"])
    trainer.records = []
    return trainer.step

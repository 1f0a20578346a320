"""Sharded checkpoints of ZeRO-sharded training, and whole-model state gathered back.

Taught in chapter 03 (ZeRO), next to :mod:`dtlab.zero`.

Under ZeRO no rank holds the whole model state, so no rank can write it alone. Each
rank writes its own slice instead (``rank00003.pt``: its flat master slice of every
unit and the optimizer state of that slice) and rank 0 adds ``meta.json``, the
layout: every unit's size and the world size the slices were cut for. This is what
PyTorch's distributed checkpoint (DCP) does with FSDP's sharded state dicts.

Loading at the same world size reads one file per rank and restores training
exactly. Loading at another world size *reshards*: the flat layout of a unit does
not depend on N (only its padding does), so new rank r's slice ``[r·S', (r+1)·S')``
is cut from the old slices that overlap it. Per-element optimizer state (Adam's
momentum and variance) is cut the same way; per-tensor state (the step count) is
copied. :func:`gather_full_optimizer_state` and ``model.gather_full_params()`` give
the whole thing in the unwrapped model's names, for export or comparison.

Under DDP every rank holds the same state, so one rank writes it
(:func:`save_replicated`) and any number of ranks reads it back. :func:`save_training`
and :func:`load_training` do either for a :class:`dtlab.train.Trainer`, with the step
counter and each rank's random state, so that a run stopped at step k and resumed
gives the same loss curve as one that never stopped.
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


def _shards(model):
    """(unit, shard) for every unit that has parameters."""
    if not hasattr(model, "_units"):
        raise ValueError(
            f"{type(model).__name__} is not a dtlab.zero.FullyShardedDataParallel: "
            "wrap the model first (torch.save suits an unsharded one)"
        )
    return [(u, u.shard) for u in model._units if u.shard is not None]


def _check_optimizer(model, optimizer) -> None:
    ours = {id(s) for _, s in _shards(model)}
    theirs = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not theirs <= ours:
        raise ValueError(
            "the optimizer steps tensors that are not this model's shards: build it "
            "over model.parameters() of the FullyShardedDataParallel"
        )


def save_sharded(path, model, optimizer=None, *, extra: dict | None = None) -> str:
    """Every rank writes its slices to ``path/rankNNNNN.pt``; rank 0 writes
    ``path/meta.json``. A collective (ends with a barrier). Returns ``path``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    n_shards = model._n_shards
    units, state = [], {}
    for u, shard in _shards(model):
        units.append(dict(name=u.name, numel=u.numel, padded=u.padded, S=u.S))
        entry = {"shard": shard.detach().cpu().clone()}
        if optimizer is not None:
            entry["optim"] = {
                k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                for k, v in optimizer.state.get(shard, {}).items()
            }
        state[u.name] = entry
    payload = {
        "world_size": n_shards,
        "rank": model.rank if n_shards > 1 else 0,
        "stage": model.stage,
        "units": state,
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
    if n_shards > 1 or model.rank == 0:  # stage 0: one copy is the whole state
        torch.save(payload, _file(path, payload["rank"]))
    if model.rank == 0:
        with open(os.path.join(path, META), "w", encoding="utf-8") as f:
            json.dump({"world_size": n_shards, "stage": model.stage, "units": units}, f)
    comm.barrier(model.process_group, tag="checkpoint")
    return path


@torch.no_grad()
def load_sharded(path, model, optimizer=None) -> dict:
    """Restore this rank's slices (and the optimizer's) from :func:`save_sharded`'s
    files, resharding when the world size changed. A collective. Returns the
    ``extra`` dict saved with the checkpoint."""
    path = os.fspath(path)
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        raise ValueError(f"{path} holds no {META}: not a dtlab sharded checkpoint")
    with open(meta_file, encoding="utf-8") as f:
        meta = json.load(f)
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    old_units = {u["name"]: u for u in meta["units"]}
    cache: dict[int, dict] = {}

    def old(rank):
        if rank not in cache:
            cache[rank] = torch.load(_file(path, rank), weights_only=True)
        return cache[rank]

    for u, shard in _shards(model):
        saved = old_units.get(u.name)
        if saved is None or saved["numel"] != u.numel:
            raise ValueError(
                f"unit {u.name!r} ({u.numel} parameters) is not in the checkpoint or "
                f"has another size there ({saved and saved['numel']}): it was saved "
                "from a different model"
            )
        S0 = saved["S"]
        lo, hi = u.lo, min(u.lo + u.S, u.numel)  # the real elements of my slice

        def cut(get, u=u, lo=lo, hi=hi, S0=S0, dtype=shard.dtype):
            return _cut(old, u.name, get, lo, hi, u.S, S0, dtype)

        shard.copy_(cut(lambda e: e["shard"]))
        if optimizer is None:
            continue
        # per-tensor state is the same on every old rank: read it from one we need
        first = old(min(lo // S0, meta["world_size"] - 1))["units"][u.name]
        first = first.get("optim", {})
        new_state = {}
        for key, value in first.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == S0:
                t = cut(lambda e, key=key: e["optim"][key])
                new_state[key] = t.to(shard.device)
            elif torch.is_tensor(value):
                new_state[key] = value.clone()  # a per-tensor value: Adam's step
            else:
                new_state[key] = value
        optimizer.state[shard] = new_state
    if optimizer is not None:
        groups = old(0)["param_groups"] or []
        for g, saved in zip(optimizer.param_groups, groups):
            g.update(saved)
    if model.stage <= 2:
        model.sync_params()  # the full weights follow the restored slices
    return old(0)["extra"]


def _cut(old, name, get, lo, hi, S, S0, dtype) -> torch.Tensor:
    """The new slice ``[lo, hi)`` (``S`` long with padding) of a flat per-element
    tensor, from the old slices of length ``S0`` that overlap it."""
    pieces = []
    for j in range(lo // S0, -(-hi // S0)):  # old ranks whose slices overlap mine
        t = get(old(j)["units"][name])
        a, b = max(lo, j * S0), min(hi, (j + 1) * S0)
        if a < b:
            pieces.append(t[a - j * S0 : b - j * S0])
    out = torch.zeros(S, dtype=pieces[0].dtype if pieces else dtype)
    if pieces:
        out[: hi - lo] = torch.cat(pieces)
    return out


@torch.no_grad()
def gather_full_optimizer_state(model, optimizer) -> dict[str, dict]:
    """``{param name: {state key: full tensor}}``: per-element state all-gathered and
    cut back into the unwrapped model's parameters (the form a single-process
    optimizer keeps). A collective."""
    _check_optimizer(model, optimizer)
    out: dict[str, dict] = {}
    for u, shard in _shards(model):
        for key, value in optimizer.state.get(shard, {}).items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == u.S:
                src = value.detach().to(model.device)
                if model._n_shards > 1:
                    full = torch.empty(u.S * model._n_shards, dtype=src.dtype,
                                       device=src.device)  # fmt: skip
                    comm.all_gather(
                        full, src, model.process_group, tag="zero/gather-full"
                    )
                else:
                    full = src
                full = full.cpu()
                for name, p, off, k in u.entries:
                    out.setdefault(name, {})[key] = (
                        full[off : off + k].view(p.shape).clone()
                    )
            else:
                for name, *_ in u.entries:
                    out.setdefault(name, {})[key] = (
                        value.clone() if torch.is_tensor(value) else value
                    )
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
    return "replicated" if trainer.parts.zero_stage is None else "sharded"


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
        "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
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
    layout = trainer.topo.layout
    here = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    own = os.path.join(path, f"trainer{_rank():05d}.pt")
    if saved["layout"] == here:
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

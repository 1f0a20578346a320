"""Saving a :class:`dtlab.train.Trainer` so that any layout can load it.

Taught in chapter 13 (:mod:`dtlab.reshard`). :func:`save` is DCP's save in three
moves: each rank *plans* (its :func:`~dtlab.reshard.holdings.holdings`: every tensor
it steps, as a piece of the full tensor), *writes* the pieces it is the writer of
into its own file, and the ranks' indexes meet at rank 0 (one all-gather of a few
kilobytes of JSON, through :mod:`dtlab.comm`) which writes ``metadata.json``. No
tensor crosses ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import torch
import torch.distributed as dist

from dtlab import comm
from dtlab.objects import all_gather_bytes
from dtlab.reshard.format import (
    FORMAT,
    METADATA,
    data_file,
    dtype_name,
    random_file,
)
from dtlab.reshard.holdings import holdings

__all__ = ["save", "layout_sizes"]


def layout_sizes(layout) -> dict[str, int]:
    """``{axis: size}`` of a layout, as the metadata keeps it."""
    return {a: layout.size(a) for a in ("dp", "tp", "pp", "cp", "ep")}


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _arrays(holding, state) -> tuple[dict, dict]:
    """What is saved for one tensor: ``{key: tensor}`` of the arrays with one number
    per element (the master weight, Adam's moments) and ``{key: [value, dtype]}``
    of the per-tensor numbers (Adam's step)."""
    arrays, scalars = {"weight": holding.master}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != holding.master.shape:
                raise ValueError(
                    f"{holding.name}: optimizer state {key!r} has shape "
                    f"{tuple(value.shape)}, its tensor {tuple(holding.master.shape)}: "
                    "only element-wise and per-tensor state reshards"
                )
            arrays[key] = value
        elif torch.is_tensor(value):
            scalars[key] = [value.item(), dtype_name(value.dtype)]
        else:
            scalars[key] = [value, None]
    return arrays, scalars


def _write_pieces(path, rank, mine, optimizer) -> list[dict]:
    """Write this rank's pieces to its file; return their index entries."""
    index = []
    if not mine:
        return index
    name = data_file(rank)
    with open(os.path.join(path, name), "wb") as f:
        at = 0
        for h in mine:
            arrays, scalars = _arrays(h, optimizer.state.get(h.master, {}))
            data = {}
            for key, t in arrays.items():
                # the piece's elements lead the tensor; the padding rows are not saved
                flat = t.detach().reshape(-1)[: h.piece.numel].cpu().clone()
                blob = bytes(flat.untyped_storage())
                f.write(blob)
                data[key] = [at, dtype_name(flat.dtype)]
                at += len(blob)
            index.append(
                {
                    "name": h.name,
                    "shape": list(h.piece.shape),
                    "file": name,
                    **h.piece.to_dict(),
                    "data": data,
                    "scalars": scalars,
                }
            )
    return index


def _all_gather_json(obj, device) -> list:
    """Every rank's JSON-able ``obj``, in rank order
    (:func:`dtlab.objects.all_gather_bytes` of its JSON)."""
    _, world = _world()
    if world == 1:
        return [obj]
    raw = all_gather_bytes(json.dumps(obj).encode(), device=device, tag="reshard/plan")
    return [json.loads(data.decode()) for data in raw]


def _check_cover(tensors: dict) -> None:
    """Every element of every tensor written once (the writer rule holds)."""
    for name, entry in tensors.items():
        total = sum(p["hi"] - p["lo"] for p in entry["pieces"])
        if total != math.prod(entry["shape"]):
            raise RuntimeError(
                f"the ranks wrote {total} elements of {name}, which has "
                f"{math.prod(entry['shape'])}: the writer rule is broken"
            )


@torch.no_grad()
def save(path, trainer) -> str:
    """Save ``trainer`` (every rank calls it; a collective) into the folder
    ``path``: each rank's pieces in its own file, ``metadata.json`` from rank 0,
    each rank's random state. Returns ``path``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    rank, world = _world()
    config, inner = trainer.config, trainer.optimizer.optimizer
    mine = [h for h in holdings(trainer) if h.writes and h.piece.numel]
    index = _write_pieces(path, rank, mine, inner)
    torch.save(
        {
            "coords": dict(trainer.topo.coords),
            "layout": layout_sizes(trainer.topo.layout),
            "state": trainer.random_state(),
        },
        os.path.join(path, random_file(rank)),
    )
    every = _all_gather_json(index, trainer.device)
    tensors: dict[str, dict] = {}
    for entries in every:
        for e in entries:
            name, shape = e.pop("name"), e.pop("shape")
            tensors.setdefault(name, {"shape": shape, "pieces": []})["pieces"].append(e)
    _check_cover(tensors)  # on every rank alike: all of them hold the index
    if rank == 0:
        meta = {
            "format": FORMAT,
            "byteorder": sys.byteorder,
            "step": trainer.step,
            "model": dataclasses.asdict(config.model),
            "config": config.to_dict(),
            "saved_at": {
                "world_size": world,
                "layout": layout_sizes(trainer.topo.layout),
                "strategy": config.strategy,
                "precision": config.precision,
            },
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"}
                for g in inner.param_groups
            ],
            "scaler": trainer.optimizer.scaler.state_dict(),
            "random_state": [random_file(r) for r in range(world)],
            "tensors": tensors,
        }
        with open(os.path.join(path, METADATA), "w", encoding="utf-8") as f:
            json.dump(meta, f, default=str)
    if world > 1:
        comm.barrier(tag="reshard/save")  # the metadata is there for everyone
    return path

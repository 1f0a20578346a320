"""PyTorch's own resharding checkpoint beside dtlab's: DCP saving FSDP2.

Taught in chapter 13 ("from dtlab to the real thing"). The same job as
:mod:`dtlab.frameworks.fsdp2` (``fully_shard`` on every block, then on the root;
the reference's AdamW; this rank's slice of each global batch), checkpointed with
``torch.distributed.checkpoint``:

- ``get_state_dict(model, optimizer)`` gives the model's and the optimizer's state
  keyed by parameter name, every tensor a ``DTensor`` sharded on dim 0 (Adam's
  moments are sharded like their parameter; the step count is a plain tensor);
- ``dcp.save`` plans on every rank, deduplicates at the coordinator, writes one
  ``__<rank>_0.distcp`` per rank and a pickled ``.metadata`` (each chunk's offsets
  and sizes in the full tensor, and where its bytes are);
- ``dcp.load`` at another world size fills the state dict of a model sharded *there*
  (or of a plain model, in one process without a process group), reading the saved
  chunks that overlap each of its own; ``set_state_dict`` puts it back.

:func:`fsdp2_train` trains and saves on every rank of a world; :func:`fsdp2_resume`
loads on every rank of any world (or alone) and trains on; :func:`describe_dcp`
counts what the folder holds, in the keys :func:`dtlab.reshard.describe` uses.
"""

from __future__ import annotations

import math
import os

import torch

from dtlab.frameworks.job import (
    build_data,
    build_model,
    build_optimizer,
    check_job,
    local_batch,
    mean_over_world,
    world,
)

__all__ = ["fsdp2_train", "fsdp2_resume", "describe_dcp"]


def _model_and_optimizer(config):
    """The job's GPT, under FSDP2 over the whole world when there is one, and its
    AdamW over what it holds."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(config)
    _, n = world()
    if torch.distributed.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (n,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)  # one unit per block, as dtlab's ZeRO
        fully_shard(model, mesh=mesh)  # the root: embeddings (tied head), final norm
    return model, build_optimizer(model.parameters(), config)


def _train(model, optimizer, config, first: int, last: int) -> list[float]:
    """Steps ``first .. last-1`` on this rank's slice of each global batch; the
    losses averaged over the world."""
    data, losses = build_data(config), []
    for step in range(first, last):
        x, y = local_batch(data, step, config)  # (B/N, T)
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(mean_over_world(loss.item()))
    return losses


def fsdp2_train(config, path, save_at: int) -> dict:
    """Train ``config`` (fp32 ``zero3``: the job FSDP2 runs) for ``config.steps``
    steps on every rank of the current world, saving with DCP into ``path`` after
    ``save_at`` of them. Returns ``{"losses": every step's}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    check_job(config, "fsdp2_train")
    if config.precision != "fp32" or config.grad_clip is not None:
        raise ValueError("fsdp2_train runs fp32 without clipping (the DCP comparison)")
    model, optimizer = _model_and_optimizer(config)
    losses = _train(model, optimizer, config, 0, save_at)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": save_at}
    dcp.save(state, checkpoint_id=os.fspath(path))
    losses += _train(model, optimizer, config, save_at, config.steps)
    return {"losses": losses}


def fsdp2_resume(config, path) -> dict:
    """Load ``path`` (saved by :func:`fsdp2_train`, at any world size) on every rank
    of the current world, or in this process alone when there is no process group
    (a plain GPT), and train to ``config.steps``. Returns ``{"step": the step it
    resumed at, "losses": the steps after it}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    check_job(config, "fsdp2_resume")
    model, optimizer = _model_and_optimizer(config)
    # the optimizer's state exists once it has stepped: get_state_dict makes it
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    no_dist = not torch.distributed.is_initialized()
    dcp.load(state, checkpoint_id=os.fspath(path), no_dist=no_dist)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    step = int(state["step"])
    return {
        "step": step,
        "losses": _train(model, optimizer, config, step, config.steps),
    }


def describe_dcp(path) -> dict:
    """What a DCP folder holds, as :func:`dtlab.reshard.describe` counts a dtlab one:
    ``files``, ``metadata_bytes``, ``data_bytes`` (per ``.distcp`` file),
    ``tensors`` (the tensor entries, optimizer state included), ``pieces``
    (chunks), ``payload_bytes`` (the tensors' own bytes), ``stored_bytes`` (what the
    files spend on them: DCP ``torch.save`` s each item, header included) and
    ``keys`` (the tensor entries' names)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.fspath(path)
    meta = FileSystemReader(path).read_metadata()
    files = {
        f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
    }
    tensors = {
        k: v
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    payload = sum(
        math.prod(c.sizes) * v.properties.dtype.itemsize
        for v in tensors.values()
        for c in v.chunks
    )
    stored = sum(
        info.length for idx, info in meta.storage_data.items() if idx.fqn in tensors
    )
    return {
        "files": files,
        "metadata_bytes": files[".metadata"],
        "data_bytes": {f: b for f, b in files.items() if f.endswith(".distcp")},
        "tensors": len(tensors),
        "pieces": sum(len(v.chunks) for v in tensors.values()),
        "payload_bytes": payload,
        "stored_bytes": stored,
        "keys": sorted(tensors),
    }

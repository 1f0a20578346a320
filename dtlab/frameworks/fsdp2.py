"""PyTorch's FSDP2 (``fully_shard``) on dtlab's job, and HSDP on a 2D device mesh,
beside :class:`dtlab.zero.FullyShardedDataParallel`.

Taught in chapter 03 ("from dtlab to the real thing"). FSDP2 is ZeRO-3 built on
DTensor (Zhao et al. 2023, "PyTorch FSDP"; torch's FSDP2 rewrite): ``fully_shard``
on each transformer block and then on the root turns every parameter into a
``DTensor`` sharded along dim 0 over the mesh (``Shard(0)``), each block a unit
that is all-gathered before its forward and reduce-scattered after its backward,
as dtlab's units are. The knobs the issue names:

- ``reshard_after_forward``: True frees a block's gathered weights after forward
  and gathers them again for backward (ZeRO-3: 3Ψ bytes per step); False keeps
  them until backward (ZeRO-2's memory for the weights' lifetime, 2Ψ).
- ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: the weights are gathered
  and computed in ``param_dtype`` while the sharded fp32 parameters stay the
  optimizer's (the master weights), gradients are reduce-scattered in
  ``reduce_dtype``: with both bf16 it is dtlab's ``compute_dtype=bf16``.
- HSDP (hybrid sharding): a 2D mesh ``(dp_replicate, dp_shard)``; each weight is
  sharded over ``dp_shard`` and replicated over ``dp_replicate``, so a step
  reduce-scatters within a shard group and all-reduces the shard across the
  replicas: ZeRO-3 inside a node, DDP across nodes.

:func:`train_fsdp2` takes its arguments from
:func:`dtlab.frameworks.translate.fsdp2_arguments`, so the chapter's translation
table is what runs. fp16 is not run through it: FSDP2 with
``MixedPrecisionPolicy(param_dtype=float16)`` and ``torch.amp.GradScaler`` does
train here, but GradScaler looks for infs in each rank's own gradient *shards*
and has no collective (torch 2.13's ``torch/amp/grad_scaler.py``), so the ranks
can disagree on skipping a step; in a measured run they agreed only because every
shard overflowed together. dtlab's :class:`~dtlab.amp.LossScaler` MAX-reduces the
flag over the ranks for exactly this reason.
"""

from __future__ import annotations

import torch

from dtlab.frameworks.job import (
    build_data,
    build_model,
    build_optimizer,
    check_job,
    local_batch,
    mean_over_world,
    state_bytes,
    world,
)
from dtlab.frameworks.traffic import CollectiveCounter
from dtlab.frameworks.translate import check_fsdp2, fsdp2_arguments

__all__ = ["train_fsdp2"]


def train_fsdp2(
    config, *, replicate: int = 1, reshard_after_forward: bool | None = None
) -> dict:
    """Train ``config`` (``zero2`` or ``zero3``; fp32 or bf16) with FSDP2 on every
    rank of the current world: ``replicate > 1`` is HSDP on a ``(replicate,
    N/replicate)`` mesh; ``reshard_after_forward`` overrides the strategy's
    (True for ZeRO-3, False for ZeRO-2). Returns ``{"losses", "traffic" (per
    step), "memory", "mesh", "placements", "param_type", "arguments"}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_job(config, "train_fsdp2")
    if config.precision == "fp16":
        raise ValueError(
            "train_fsdp2 runs fp32 or bf16: fp16 needs a loss scaler that agrees on "
            "overflow across the gradient shards, and torch.amp.GradScaler checks "
            "each rank's own (see this module's docstring)"
        )
    _, n = world()
    arguments = fsdp2_arguments(config, n, replicate=replicate)
    if reshard_after_forward is not None:
        arguments["reshard_after_forward"] = reshard_after_forward
    built = check_fsdp2(arguments)
    mesh = init_device_mesh(
        "cpu", built["mesh_shape"], mesh_dim_names=built["mesh_dim_names"]
    )
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=built["reshard_after_forward"],
        mp_policy=built["mp_policy"],
        offload_policy=built["offload_policy"],
    )
    model = build_model(config)
    for block in model.blocks:
        fully_shard(block, **kwargs)  # one unit per block, as dtlab's ZeRO
    fully_shard(model, **kwargs)  # the root: embeddings (tied head), final norm
    optimizer = build_optimizer(model.parameters(), config)  # steps the shards
    data = build_data(config)
    counter = CollectiveCounter()
    losses = []
    for step in range(config.steps):
        x, y = local_batch(data, step, config)  # (B/N, T)
        optimizer.zero_grad(set_to_none=True)
        counter.step = step
        with counter:
            _, loss = model(x, y)  # all-gathers each unit before its forward
            loss.backward()  # (re-gathers,) reduce-scatters each unit's grads
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(mean_over_world(loss.item()))
    first = next(model.parameters())
    return {
        "losses": losses,
        "traffic": [counter.per_step(s) for s in range(config.steps)],
        "memory": state_bytes(model.parameters(), optimizer),
        "mesh": {"shape": tuple(mesh.shape), "names": mesh.mesh_dim_names},
        "placements": [str(p) for p in first.placements],
        "param_type": f"{type(first).__module__}.{type(first).__qualname__}",
        "arguments": {k: v for k, v in arguments.items() if k != "units"},
    }

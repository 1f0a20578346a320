"""FP8 on the wire: all-gathering FP8 weight shards, and what FP8 saves per parameter.

Taught in chapter 12 (the frontier), its FP8 section, with chapter 03's FSDP in
mind. Under FSDP (ZeRO-3) every layer's weight is all-gathered before its forward and
again before its backward. If the matmul reads the weight in FP8 anyway, the shards
can be cast *before* the gather and travel at 1 byte per parameter instead of bf16's
2 (torchao's "float8 all-gather" for FSDP2). Two details make it work:

- **One scale for the whole weight.** Each rank holds a different shard, but the
  gathered tensor must be one FP8 tensor with one scale. :func:`sharded_scale` takes
  the MAX of the ranks' local amaxes with one 4-byte all-reduce, so every rank casts
  its shard with the scale the full weight would get.
- **gloo carries no float8.** torch 2.13's gloo refuses float8 tensors ("Invalid
  scalar type"). The FP8 bytes travel as their ``uint8`` view — the same bytes,
  reinterpreted, no copy — and are viewed back as FP8 on arrival
  (:func:`all_gather_fp8`). The recorded event says ``uint8``, 1 byte per element.

:func:`fp8_memory` puts the savings in numbers: FP8 halves what the matmul reads and
what the all-gather carries; the fp32 master weights and Adam's two moments, 12 of
mixed precision's 16 bytes per parameter, do not change.
"""

from __future__ import annotations

import torch

from dtlab import comm
from dtlab.checks import positive_int
from dtlab.estimate import bytes_per_param, wire_bytes
from dtlab.fp8.formats import FP8_DTYPES, amax, scale_from_amax

__all__ = ["sharded_scale", "all_gather_fp8", "fp8_memory"]


def sharded_scale(shard, fmt="e4m3", group=None, *, margin=0, tag="fp8-amax"):
    """The scale of the tensor whose ``shard`` each rank of ``group`` holds: its
    local amax, all-reduced with MAX (one fp32 scalar through :mod:`dtlab.comm`),
    turned into a scale by :func:`dtlab.fp8.formats.scale_from_amax`. The same on
    every rank, and equal to the scale of the gathered tensor."""
    a = amax(shard).reshape(1).clone()  # (1,) fp32: all_reduce works in place
    comm.all_reduce(a, op=comm.ReduceOp.MAX, group=group, tag=tag)
    return scale_from_amax(a[0], fmt, margin)


def all_gather_fp8(shard_fp8: torch.Tensor, group=None, *, tag="fp8-all-gather"):
    """Every rank's FP8 ``shard_fp8`` concatenated along dim 0, as FP8, on every
    rank of ``group``. The payload goes through :func:`dtlab.comm.all_gather` as the
    shard's ``uint8`` view (gloo refuses float8 dtypes), so the recorded
    ``payload_bytes`` is the gathered tensor's element count, 1 byte each. The ranks'
    shards must have equal shapes (checked with one small all-gather first, where a
    mismatch would hang gloo), and were cast with one shared scale
    (:func:`sharded_scale`)."""
    if shard_fp8.dtype not in FP8_DTYPES.values():
        raise ValueError(
            f"all_gather_fp8 expects an FP8 shard, got {shard_fp8.dtype}: cast it "
            "first with dtlab.fp8.quantize (and sharded_scale for the scale)"
        )
    n = comm.group_size(group)
    flat = shard_fp8.contiguous().view(torch.uint8).reshape(-1)  # same bytes
    out = torch.empty(n * flat.numel(), dtype=torch.uint8, device=flat.device)
    comm.all_gather(out, flat, group, tag=tag, check_sizes=True)
    shape = tuple(shard_fp8.shape) or (1,)  # a 0-d shard gathers into (n,)
    return out.view(shard_fp8.dtype).reshape(n * shape[0], *shape[1:])


def fp8_memory(n_params: int, *, world_size: int = 1) -> dict:
    """Bytes for ``n_params`` parameters under bf16 mixed precision and under FP8
    training (bf16 weights and gradients, FP8 matmuls), and what FP8 saves.

    Per recipe: ``compute_weights`` (the weights as the matmul reads them: 2 B in
    bf16, 1 B in FP8), ``gradients`` (2 B in both: weight gradients leave the FP8
    matmul in 16 bits), ``master_weights`` (fp32, 4 B) and ``adam_states`` (two fp32
    moments, 8 B), both untouched by FP8, ``all_gather`` (the payload of one FSDP
    all-gather of every weight: 2 B vs 1 B) and ``all_gather_wire`` (what each rank
    sends for it over ``world_size`` ranks, ``(N-1)/N`` of the payload). ``saved``:
    bf16 minus FP8, per key."""
    positive_int("n_params", n_params)
    positive_int("world_size", world_size)
    mixed = bytes_per_param("bf16", "adam")  # 2 + 2 + 12 (ZeRO's K)
    per_param = {
        "bf16": {"compute_weights": mixed.params, "all_gather": mixed.params},
        "fp8": {"compute_weights": 1, "all_gather": 1},
    }
    out = {}
    for name, own in per_param.items():
        b = {
            "compute_weights": own["compute_weights"] * n_params,
            "gradients": mixed.grads * n_params,
            "master_weights": 4 * n_params,
            "adam_states": (mixed.optimizer - 4) * n_params,
            "all_gather": own["all_gather"] * n_params,
        }
        b["all_gather_wire"] = wire_bytes("all_gather", b["all_gather"], world_size)
        out[name] = b
    out["saved"] = {k: out["bf16"][k] - out["fp8"][k] for k in out["bf16"]}
    return out

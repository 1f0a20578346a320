"""``dtlab bench tp``: forward+backward of one MLP and one attention block split by
dtlab's tensor parallelism and by DTensor's (``ColwiseParallel`` / ``RowwiseParallel``),
same weights (chapter 04)."""

from __future__ import annotations

import statistics
import time

import torch

from dtlab.tensor_parallel import (
    ParallelMLP,
    ParallelSelfAttention,
    TPRandom,
    load_shards_,
)

__all__ = ["time_blocks", "run"]


def time_blocks(d_model, n_heads, batch, seq_len, steps, warmup):
    """On every rank: time forward+backward of one MLP and one attention block split
    by dtlab and by DTensor (ColwiseParallel / RowwiseParallel), same weights."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dtlab.model import MLP, CausalSelfAttention, GPTConfig
    from dtlab.topology import Layout, Topology

    n = dist.get_world_size()
    topo = Topology(Layout(tp=n))
    axis = topo.axis("tp")
    cfg = GPTConfig(d_model=d_model, n_heads=n_heads, seq_len=seq_len)
    device = (
        "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    )
    mesh = DeviceMesh.from_group(topo.group("tp"), device)
    rng = TPRandom(0, axis)
    x = torch.randn(batch, seq_len, d_model, generator=torch.Generator().manual_seed(1))
    x = x.to(device)

    def make(kind):
        torch.manual_seed(0)
        if kind == "mlp":
            full = MLP(cfg)
            ours = ParallelMLP(d_model, cfg.d_ff, axis, rng)
            plan = {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
        else:
            full = CausalSelfAttention(cfg)
            ours = ParallelSelfAttention(d_model, n_heads, axis, rng)
            plan = {name: ColwiseParallel() for name in ("q", "k", "v")}
            plan["proj"] = RowwiseParallel()
        load_shards_(ours, full, axis)  # same weights for both
        theirs = parallelize_module(full.to(device), mesh, plan)
        return ours.to(device), theirs

    def timeit(module):
        times = []
        for i in range(warmup + steps):
            dist.barrier()
            t0 = time.perf_counter()
            out = module(x)
            out.float().sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    result = {}
    for kind in ("mlp", "attention"):
        ours, theirs = make(kind)
        y_ours, y_theirs = ours(x), theirs(x)
        result[kind] = {
            "dtlab_s": timeit(ours),
            "dtensor_s": timeit(theirs),
            "max_abs_diff": float((y_ours - y_theirs).detach().abs().max()),
        }
    return result


def run(
    world_size: int = 2,
    *,
    d_model: int = 256,
    n_heads: int = 8,
    batch: int = 8,
    seq_len: int = 128,
    steps: int = 10,
    warmup: int = 3,
    timeout: float = 300.0,
) -> dict:
    """Median forward+backward time of the same MLP and attention block under
    dtlab's TP and DTensor's TP, on ``world_size`` fresh CPU processes (gloo).
    Returns rank 0's ``{"mlp": {...}, "attention": {...}}``; run by ``dtlab bench
    tp``)."""
    from dtlab.launch import spawn

    out = spawn(
        time_blocks, world_size, d_model, n_heads, batch, seq_len, steps, warmup,
        timeout=timeout,
    )  # fmt: skip
    return out[0]

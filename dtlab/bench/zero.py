"""``dtlab bench zero``: dtlab's ZeRO stages against PyTorch's ZeRO-1 (DDP +
``ZeroRedundancyOptimizer``) and FSDP2 ``fully_shard``, and dtlab's peak bytes per
stage (chapter 03). Every variant is timed without a memory tracker (its hooks
measure at every gather, reduction and saved tensor, which costs time); one more
step, tracked, gives dtlab's peak bytes. On 4 ranks and more, dtlab's HSDP (shard
groups of 2, chapter 11) and FSDP2's (``fully_shard`` on a 2D mesh) step in turn,
one step each, in the same processes: both see the same load."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from dtlab import comm, memory
from dtlab.zero import STAGES, FullyShardedDataParallel

__all__ = ["run"]


def _on_rank(config, steps: int, warmup: int, micro_batch: int) -> list[dict]:
    """On every rank: step time of dtlab's stages next to PyTorch's ZeRO-1
    (DDP + ZeroRedundancyOptimizer) and FSDP2, and dtlab's peak bytes per stage."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from dtlab.model import GPT, SyntheticTokens

    r, n = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(config.vocab_size, config.seq_len)
    adamw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def torch_zero1():
        model = DistributedDataParallel(GPT(config))
        return model, ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, **adamw
        )

    def torch_fsdp2():
        model, mesh = GPT(config), DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), **adamw)

    def ours(stage):
        def build():
            model = FullyShardedDataParallel(GPT(config), stage=stage)
            return model, torch.optim.AdamW(model.parameters(), **adamw)

        return build

    variants = [
        ("torch ZeRO-1", torch_zero1, False),
        ("torch FSDP2", torch_fsdp2, False),
    ]
    variants += [(f"dtlab stage {s}", ours(s), True) for s in STAGES]

    def one_step(model, opt, step, tracker=None):
        x, y = data.shard(step, micro_batch * n, r, n)
        for phase in ("forward", "backward", "step"):
            with tracker.phase(phase) if tracker else nullcontext():
                if phase == "forward":
                    _, loss = model(x, y)
                elif phase == "backward":
                    loss.backward()
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)

    rows = []
    for name, build, track in variants:
        model, opt = build()
        times = []
        for step in range(warmup + steps):
            comm.barrier()  # every rank starts the step together
            t0 = time.perf_counter()
            one_step(model, opt, step)
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        peak = None
        if track:  # one more step, measured: the tracker's hooks cost time
            tracker = memory.MemoryTracker(model, opt)
            one_step(model, opt, warmup + steps, tracker)
            peak = tracker.peak()
        rows.append(
            dict(
                variant=name,
                world_size=n,
                step_s=sorted(times)[len(times) // 2],
                peak_bytes=peak,
            )
        )
    if n >= 4 and n % 2 == 0:
        rows += _hsdp_interleaved(config, steps, warmup, one_step, adamw)
    return rows


def _hsdp_interleaved(config, steps: int, warmup: int, one_step, adamw) -> list:
    """dtlab HSDP and FSDP2 HSDP (ZeRO-3 in shard groups of 2, replicated across
    n/2 groups), one step of each in turn; the median step time of each."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from dtlab.model import GPT
    from dtlab.zero import hsdp_groups

    n, shard = dist.get_world_size(), 2
    grid = hsdp_groups(shard)
    ours = FullyShardedDataParallel(
        GPT(config), process_group=grid.shard, replicate_group=grid.replicate
    )
    theirs = GPT(config)
    mesh = DeviceMesh(
        "cpu",
        torch.arange(n).view(n // shard, shard),
        mesh_dim_names=("replicate", "shard"),
    )
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    runs = {
        "dtlab HSDP": (ours, torch.optim.AdamW(ours.parameters(), **adamw)),
        "torch FSDP2 HSDP": (theirs, torch.optim.AdamW(theirs.parameters(), **adamw)),
    }
    times = {name: [] for name in runs}
    for step in range(warmup + steps):
        for name, (model, opt) in runs.items():
            comm.barrier()
            t0 = time.perf_counter()
            one_step(model, opt, step)
            if step >= warmup:
                times[name].append(time.perf_counter() - t0)
    return [
        dict(
            variant=name,
            world_size=n,
            mesh=f"{n // shard}x{shard}",
            step_s=sorted(t)[len(t) // 2],
            peak_bytes=None,
        )
        for name, t in times.items()
    ]


def run(world_sizes=(2, 4), *, steps: int = 10, warmup: int = 3, micro_batch=4):
    """Step time of dtlab's ZeRO stages against PyTorch's ZeroRedundancyOptimizer and
    FSDP2 on fresh processes, and dtlab's peak bytes per rank per stage. A
    benchmark, not a test: the times depend on the machine."""
    from dtlab.launch import spawn
    from dtlab.model import GPTConfig

    config = GPTConfig(vocab_size=256, seq_len=64, n_layers=4, n_heads=4, d_model=128)
    rows = []
    for n in world_sizes:
        rows += spawn(_on_rank, n, config, steps, warmup, micro_batch, timeout=300)[0]
    return rows

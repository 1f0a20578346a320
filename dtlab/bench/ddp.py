"""``dtlab bench ddp``: dtlab's :class:`~dtlab.ddp.DistributedDataParallel` against
``torch.nn.parallel.DistributedDataParallel`` on the same model and data, their steps
interleaved in the same processes so both see the same machine load (chapter 02).

Where dtlab is slower, and why it stays so: at N = 2 on a 2-core Sapphire Rapids Xeon,
eight runs of 30 steps gave dtlab/torch 0.99-1.24, median 1.04. A profile of rank 0
(cProfile, 20 steps, the same model; it inflates Python's share) puts the difference
in backward: 31 ms a step inside dtlab's ``loss.backward()`` against 28 ms in
PyTorch's, forward and AdamW equal. The work is the same (per-parameter readiness,
13 bucket copies, launches and waits, the copy back); dtlab's runs in Python hooks,
PyTorch's Reducer in C++. A course keeps it in Python, where the learner can read
it."""

from __future__ import annotations

import statistics

import torch.distributed as dist

from dtlab import telemetry
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.reference import make_optimizer

__all__ = ["BENCH_MODEL", "run"]

BENCH_MODEL = GPTConfig(vocab_size=256, seq_len=64, n_layers=4, n_heads=4, d_model=128)


def _on_rank(model_cfg, steps, warmup, micro_batch, bucket_cap_mb):
    """On every rank: dtlab DDP and PyTorch DDP on the same model and data, their
    steps interleaved so both see the same machine load."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from dtlab.ddp import DistributedDataParallel

    r, n = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(model_cfg.vocab_size, model_cfg.seq_len)
    impls = {
        "dtlab": DistributedDataParallel(GPT(model_cfg), bucket_cap_mb=bucket_cap_mb),
        "torch": TorchDDP(GPT(model_cfg), bucket_cap_mb=bucket_cap_mb),
    }
    opts = {k: make_optimizer(m.parameters()) for k, m in impls.items()}
    times: dict[str, list[float]] = {k: [] for k in impls}
    overlap, exposed, buckets = [], [], 0
    for step in range(warmup + steps):
        x, y = data.shard(step, micro_batch * n, r, n)
        for name, model in impls.items():
            dist.barrier()
            t0 = telemetry.clock()
            opts[name].zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            opts[name].step()
            if step >= warmup:
                times[name].append(telemetry.clock() - t0)
                if name == "dtlab":
                    overlap.append(model.last_sync["overlap"])
                    exposed.append(model.last_sync["exposed_s"])
                    buckets = model.last_sync["buckets"]
    return {
        "world_size": n,
        "dtlab_step_s": statistics.median(times["dtlab"]),
        "torch_step_s": statistics.median(times["torch"]),
        "overlap": statistics.median(overlap),
        "exposed_s": statistics.median(exposed),
        "buckets": buckets,
        "params": sum(p.numel() for p in impls["dtlab"].parameters()),
    }


def run(
    world_sizes=(2, 4),
    *,
    steps: int = 20,
    warmup: int = 3,
    micro_batch: int = 4,
    bucket_cap_mb: float = 0.25,
    model: GPTConfig = BENCH_MODEL,
) -> list[dict]:
    """Step time of dtlab's DDP against PyTorch's, same model, same run,
    on fresh processes (:func:`dtlab.launch.spawn`); one row per world size (rank
    0's medians). A benchmark, not a test: the numbers depend on the machine."""
    from dtlab.launch import spawn

    rows = []
    for n in world_sizes:
        out = spawn(
            _on_rank, n, model, steps, warmup, micro_batch, bucket_cap_mb,
            timeout=120,
        )  # fmt: skip
        rows.append(out[0])
    return rows

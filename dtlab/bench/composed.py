"""``dtlab bench 2d``: dtlab's dp2·tp2 with ZeRO-3 against PyTorch's own 2D
composition (FSDP2 over DTensor tensor parallelism) on the same model and global
batch (chapter 07). :func:`torch_2d` is also the PyTorch side of the parity test and
of chapter 07."""

from __future__ import annotations

from dtlab.model import GPT
from dtlab.train import default_device

__all__ = ["torch_2d", "run"]


def torch_2d(model_config, dp: int, tp: int, seed: int = 0):
    """PyTorch's own 2D parallelism on dtlab's GPT, for comparison: a (dp, tp)
    ``DeviceMesh`` (tp fastest, as dtlab orders ranks), Megatron's plan through
    DTensor (q, k, v and fc column-parallel, both proj row-parallel; embeddings,
    norms and head replicated over tp), then FSDP2's ``fully_shard`` of every block
    and of the root over dp: what ``Layout(dp, tp)`` with ZeRO-3 is in dtlab.
    Returns ``(model, dp_mesh)``. A collective call: every rank of the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    device = default_device()
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = GPT(model_config, seed=seed).to(device)
    plan = {
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
    }  # fmt: skip
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"]


def _on_rank(model_kwargs, batch, steps, warmup):
    """On every rank of a 4-rank world: dtlab's dp2·tp2 ZeRO-3 step and PyTorch's
    FSDP2 + DTensor step, alternating (so load drift hits both), each timed
    between barriers. Returns both step times and both loss curves."""
    import time

    import torch.distributed as dist

    from dtlab.model import GPTConfig, SyntheticTokens
    from dtlab.reference import make_optimizer
    from dtlab.topology import Layout, Topology
    from dtlab.train import TrainConfig, Trainer

    cfg = GPTConfig(**model_kwargs)
    config = TrainConfig(
        model=cfg, layout=Layout(dp=2, tp=2), strategy="zero3",
        global_batch_size=batch, steps=steps + warmup,
    )  # fmt: skip
    ours = Trainer(config, Topology(config.layout))
    theirs, dp_mesh = torch_2d(cfg, 2, 2)
    opt = make_optimizer(theirs.parameters())
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len)
    dp_rank = dp_mesh.get_local_rank()
    times = {"dtlab": [], "torch": []}
    losses = {"dtlab": [], "torch": []}
    for step in range(steps + warmup):
        dist.barrier()
        t0 = time.perf_counter()
        record = ours.fit(1)[-1]
        dist.barrier()
        t1 = time.perf_counter()
        x, y = data.shard(step, batch, dp_rank, 2)
        opt.zero_grad(set_to_none=True)
        _, loss = theirs(x.to(default_device()), y.to(default_device()))
        loss.backward()
        opt.step()
        dist.barrier()
        t2 = time.perf_counter()
        if step >= warmup:
            times["dtlab"].append(t1 - t0)
            times["torch"].append(t2 - t1)
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_mesh.get_group())
        losses["dtlab"].append(record["loss"])
        losses["torch"].append(total.item() / 2)
    return {"times": times, "losses": losses}


def run(steps: int = 8, warmup: int = 2, batch: int = 8, **model) -> dict:
    """``dtlab bench 2d``: on 4 fresh processes, the median step of dtlab's dp2·tp2
    with ZeRO-3 and of PyTorch's FSDP2 + DTensor TP on the same model and global
    batch, and how far their losses are apart (they follow the same reference)."""
    import statistics

    from dtlab.launch import spawn

    kwargs = {"vocab_size": 128, "seq_len": 32, "n_layers": 4, "n_heads": 4,
              "d_model": 64}  # fmt: skip
    kwargs.update(model)
    results = spawn(_on_rank, 4, kwargs, batch, steps, warmup, timeout=600)
    step = {
        name: statistics.median(max(r["times"][name][i] for r in results)
                                for i in range(steps))
        for name in ("dtlab", "torch")
    }  # fmt: skip
    a, b = results[0]["losses"]["dtlab"], results[0]["losses"]["torch"]
    return {
        "world_size": 4, "steps": steps, "model": kwargs, "step_s": step,
        "max_rel_loss_diff": max(abs(x - y) / abs(y) for x, y in zip(a, b)),
    }  # fmt: skip

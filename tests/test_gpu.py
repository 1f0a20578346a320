"""The CUDA and nccl paths, on a machine with a GPU (skipped everywhere else; CI has
no GPU, so these run only when a developer has one: ``pytest tests/test_gpu.py``).

One GPU is enough: a world of one nccl rank still runs every collective through nccl
on device tensors, which is what breaks when a scratch tensor is created on the host.
Each strategy trains the same global batches as the single-process reference on the
same GPU; the tolerances are explained where they are used.
"""

import pytest
import torch

from dtlab.launch import spawn
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.reference import make_optimizer, reference_step

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (nccl paths)"
)

CFG = GPTConfig(vocab_size=128, seq_len=32, n_layers=4, n_heads=4, d_model=64)
STEPS, BATCH = 4, 8


def _batches():
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len, seed=0)
    return [
        tuple(t.cuda() for t in data.batch(s, BATCH)) for s in range(STEPS)
    ]  # (B, T) pairs on the GPU


def _reference(batches):
    model = GPT(CFG, seed=0).cuda()
    opt = make_optimizer(model.parameters())
    return [reference_step(model, opt, x, y)["loss"] for x, y in batches]


def _train(model, opt, batches, finish=None):
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if finish is not None:
            finish()
        opt.step()
        losses.append(loss.item())
    return losses


def _every_strategy_on_one_gpu():
    """In a spawned nccl world of one rank: each dtlab strategy's losses next to
    the reference's, and the GPU's own memory counter next to dtlab's accounting."""
    import torch.distributed as dist

    from dtlab import memory
    from dtlab.ddp import DistributedDataParallel
    from dtlab.pipeline import Pipeline
    from dtlab.tensor_parallel import tensor_parallel_gpt
    from dtlab.topology import Layout, Topology
    from dtlab.zero import FullyShardedDataParallel

    assert dist.get_backend() == "nccl"
    batches = _batches()
    out = {"reference": _reference(batches)}

    ddp = DistributedDataParallel(GPT(CFG, seed=0).cuda(), bucket_cap_mb=0.05)
    out["ddp"] = _train(ddp, make_optimizer(ddp.parameters()), batches)

    del ddp
    for stage in (1, 2, 3):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        fsdp = FullyShardedDataParallel(GPT(CFG, seed=0).cuda(), stage=stage)
        opt = make_optimizer(fsdp.parameters())
        out[f"zero{stage}"] = _train(
            fsdp, opt, batches, fsdp.finish_gradient_synchronization
        )
        torch.cuda.synchronize()
        # what the allocator holds for this model now, next to dtlab's accounting
        out[f"zero{stage}_bytes"] = (
            torch.cuda.memory_allocated() - before,
            sum(memory.count_bytes(fsdp.memory_tensors(opt)).values()),
        )
        del fsdp, opt

    bf16 = FullyShardedDataParallel(GPT(CFG, seed=0).cuda(), torch.bfloat16, stage=3)
    out["zero3_bf16"] = _train(
        bf16, make_optimizer(bf16.parameters()), batches,
        bf16.finish_gradient_synchronization,
    )  # fmt: skip

    topo = Topology(Layout())
    tp = tensor_parallel_gpt(CFG, topo).cuda()
    out["tp"] = _train(tp, make_optimizer(tp.parameters()), batches)

    pipe = Pipeline(CFG, topo, "1f1b", microbatches=2)
    for stage in pipe.stages:
        stage.cuda()
    opt = make_optimizer(list(pipe.parameters()))
    out["pp"] = []
    for x, y in batches:
        pipe.zero_grad()
        out["pp"].append(pipe.step(x, y)["loss"])
        opt.step()
    return out


def test_every_strategy_runs_on_nccl_and_matches_the_reference():
    out = spawn(_every_strategy_on_one_gpu, 1, backend="nccl", timeout=120)[0]
    ref = out["reference"]
    # One rank: DDP and ZeRO average over a group of one, the same sums in the same
    # order as the reference on the same GPU, so the losses are identical.
    for name in ("ddp", "zero1", "zero2", "zero3"):
        assert out[name] == ref, name
    # TP's vocab-parallel cross-entropy and the pipeline's two microbatches sum in
    # another order than F.cross_entropy over the whole batch: fp32 rounding only.
    for name in ("tp", "pp"):
        assert out[name] == pytest.approx(ref, rel=1e-5), name
    # bf16 compute keeps ~3 significant digits; the losses stay within 1 %.
    assert out["zero3_bf16"] == pytest.approx(ref, rel=1e-2)
    # dtlab's byte accounting against the CUDA allocator's: the allocator rounds each
    # block up to 512 bytes and the last step's loss is still alive, so allow 10 %.
    for stage in (1, 2, 3):
        allocated, counted = out[f"zero{stage}_bytes"]
        print(f"zero{stage}: allocated {allocated} B, dtlab counted {counted} B")
        assert counted == pytest.approx(allocated, rel=0.10), stage


def _trainer_on_one_gpu():
    """dtlab.train's whole path (the one the lab and ``dtlab run`` take) on the GPU:
    every data-parallel flavour, each precision, checkpointing."""
    from dtlab.reference import train_reference
    from dtlab.train import TrainConfig, Trainer

    out = {}
    base = TrainConfig(model=CFG, steps=STEPS, global_batch_size=BATCH)
    configs = {
        "ddp": base,
        "zero3": base.replace(strategy="zero3"),
        "zero1_bf16": base.replace(strategy="zero1", precision="bf16"),
        "ddp_fp16": base.replace(precision="fp16"),
        "ddp_full_ckpt": base.replace(activation_checkpointing="full"),
        "zero2_selective": base.replace(
            strategy="zero2", activation_checkpointing="selective"
        ),
    }
    for name, config in configs.items():
        trainer = Trainer(config)
        assert all(p.is_cuda for p in trainer.parameters()), name
        out[name] = [r["loss"] for r in trainer.fit()]
    for precision in ("fp32", "bf16", "fp16"):
        ref = train_reference(
            CFG, steps=STEPS, global_batch_size=BATCH, precision=precision
        )
        out[f"cpu_reference_{precision}"] = [r["loss"] for r in ref.records]
    return out


def test_the_trainer_runs_every_flavour_on_the_gpu():
    out = spawn(_trainer_on_one_gpu, 1, backend="nccl", timeout=120)[0]
    ref = out["cpu_reference_fp32"]
    # The reference runs on the CPU: fp32 kernels on the GPU sum in other orders
    # (and no TF32: torch leaves it off for matmuls), so about 1e-5 relative.
    for name in ("ddp", "zero3", "ddp_full_ckpt", "zero2_selective"):
        assert out[name] == pytest.approx(ref, rel=1e-4), name
    # 16-bit compute against the CPU reference making the same casts: the GPU's
    # bf16/fp16 kernels round differently from the CPU's, so 1 %.
    assert out["zero1_bf16"] == pytest.approx(out["cpu_reference_bf16"], rel=1e-2)
    assert out["ddp_fp16"] == pytest.approx(out["cpu_reference_fp16"], rel=1e-2)


def test_the_lab_cluster_trains_on_nccl():
    """The course's own GPU path: one ipyparallel engine per GPU on nccl, training
    through the lab with telemetry streamed back."""
    pytest.importorskip("ipyparallel")
    from dtlab.lab import LabCluster
    from dtlab.train import TrainConfig

    config = TrainConfig(model=CFG, steps=STEPS, global_batch_size=BATCH)
    with LabCluster(1, backend="nccl", timeout=60) as cluster:
        run = cluster.train(config, live=False, timeout=300)
        backends = cluster.run(_backend_and_device)
    assert backends == [("nccl", "cuda")]
    assert len(run.losses()) == STEPS
    comm_events = [e for e in run.events if e.get("kind") == "comm"]
    memory_events = [e for e in run.events if e.get("kind") == "memory"]
    assert memory_events and len(run.records[0]) == STEPS
    print(f"lab on nccl: {len(comm_events)} comm events, losses {run.losses()}")


def _backend_and_device():
    import torch.distributed as dist

    from dtlab.train import default_device

    return dist.get_backend(), default_device().type

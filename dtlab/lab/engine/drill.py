"""The interview drill's runs on every rank (chapter 10): a few steps of ZeRO 0-3
(and ZeRO-3 with offload), DDP, and one tensor-parallel step of a small GPT, with
telemetry on, so that the cards quote bytes the course measured.

:func:`rank_measurements` is what :class:`dtlab.lab.drill.Drill` ships through
``cluster.run`` (once, on the first card that needs it).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dtlab import telemetry
from dtlab.ddp import DistributedDataParallel
from dtlab.events import Kind
from dtlab.memory import MemoryTracker, memory_events
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.tensor_parallel import tensor_parallel_gpt
from dtlab.topology import Layout, Topology
from dtlab.zero import FullyShardedDataParallel

# the model every live measurement trains: small enough for seconds on 2 cores
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=4, n_heads=4, d_model=32)
BATCH = 8  # global batch of the live runs


def zero_steps(stage: int, offload: bool = False, steps: int = 2) -> dict:
    """Train ``steps`` steps of FSDP at ``stage``: the bytes held at the end of the
    last backward, the ZeRO wire bytes of the last step, the losses, and Ψ (the
    padded parameter count)."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = FullyShardedDataParallel(GPT(CFG), stage=stage, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tracker = MemoryTracker(model, opt)
    rec = telemetry.Recorder(r)
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    losses = []
    with telemetry.use(rec):
        for step in range(steps):
            rec.step = step
            x, y = data.shard(step, BATCH, r, n)
            with tracker.phase("forward"):
                _, loss = model(x, y)
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("step"):
                opt.step()
                opt.zero_grad()
            losses.append(float(loss))
    mem = memory_events(rec.events, phase="backward", step=steps - 1)[0]
    # ZeRO's own collectives of the last step, not the loss metrics or grad norms
    wire = sum(
        e["wire_bytes"]
        for e in rec.events
        if e["kind"] == Kind.COMM
        and e["step"] == steps - 1
        and e["tag"] != "metrics"
        and e["tag"].startswith("zero")
        and "norm" not in e["tag"]
    )
    keys = ("params", "grads", "optimizer", "activations", "host")
    return {
        "memory": {k: mem[k] for k in keys},
        "wire": wire,
        "losses": losses,
        "psi": model.padded_numel,
    }


def ddp_steps(steps: int = 2) -> dict:
    """Train ``steps`` steps of DDP: wire bytes of the last step, the bytes of the
    weights, the losses."""
    r, n = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = telemetry.Recorder(r)
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    losses = []
    with telemetry.use(rec):
        for step in range(steps):
            rec.step = step
            x, y = data.shard(step, BATCH, r, n)
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    last = [e for e in rec.events if e["kind"] == Kind.COMM and e["step"] == steps - 1]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "wire": sum(e["wire_bytes"] for e in last),
        "params": params,
        "losses": losses,
    }


def tensor_parallel_step() -> dict:
    """One forward and backward of the GPT split over tp=2 (dp = world/2): the
    bytes of this rank's weights and the wire bytes it sent."""
    topo = Topology(Layout(dp=dist.get_world_size() // 2, tp=2))
    model = tensor_parallel_gpt(CFG, topo)
    rec = telemetry.Recorder(topo.rank)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, 2)
    with telemetry.use(rec):
        _, loss = model(x, y)
        loss.backward()
        model.finish_gradient_synchronization()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    wire = sum(e["wire_bytes"] for e in rec.events if e["kind"] == Kind.COMM)
    return {"params": params, "wire": wire}


def rank_measurements() -> dict:
    """Everything the cards measure live, on this rank: the process id, ZeRO stages
    0-3 (and stage 3 with offload), DDP and tensor parallelism."""
    return {
        "pid": os.getpid(),
        "world": dist.get_world_size(),
        "zero": {s: zero_steps(s) for s in (0, 1, 2, 3)},
        "offload": zero_steps(3, offload=True),
        "ddp": ddp_steps(),
        "tp": tensor_parallel_step(),
    }

"""Interview practice cards: a question, a box for your answer, and a Reveal button
that shows a model answer in the four-question frame next to a number the course
measured or computed.

Taught in chapter 10 (interview drill).

    from dtlab.lab.drill import Drill
    drill = Drill(cluster)          # cluster = dtlab.lab.start(world_size=4)
    drill                            # every card
    drill.reveal("zero_stages")      # what the Reveal button does; returns the number

Every card's number comes from somewhere the learner can re-run: a short run on the
live cluster (world 2-4: bytes per rank by category, wire bytes per step, from
dtlab's telemetry and memory accounting), the pipeline simulator
(:func:`dtlab.pipeline.simulate`), a computation on the kernel's own process, or
the analytic model (:mod:`dtlab.estimate`). The live runs happen once, on the first
card that needs them, in one bounded ``cluster.run``.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dtlab import estimate as est
from dtlab.model import GPT, GPTConfig, SyntheticTokens

__all__ = [
    "CARDS",
    "SOURCE_QUESTIONS",
    "Card",
    "Measurement",
    "Drill",
    "rank_measurements",
]

# the model every live measurement trains: small enough for seconds on 2 cores
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=4, n_heads=4, d_model=32)
BATCH = 8  # global batch of the live runs


@dataclass(frozen=True)
class Measurement:
    """One number behind a model answer: ``value`` in ``unit``, where it came from
    (``kind``: live | simulate | local | estimate), and what it shows (``text``);
    ``predicted`` is what a formula of :mod:`dtlab.estimate` says it should be."""

    value: float
    unit: str
    kind: str
    text: str
    predicted: float | None = None
    extra: dict = field(default_factory=dict)  # other numbers the text quotes


@dataclass(frozen=True)
class Card:
    """A practice question. ``answer`` has the four-question frame's keys
    (``replicated``, ``sharded``, ``synchronized``, ``cost``) and a ``summary``;
    ``measure(ctx)`` returns the card's :class:`Measurement`."""

    key: str
    question: str
    sources: tuple[str, ...]
    answer: dict
    measure: Callable


# ---- on every rank: the course's own runs, small ---------------------------------
def _step_zero(stage, offload=False, steps=2):
    """Train ``steps`` steps of FSDP at ``stage``; bytes at the end of the last
    backward, wire bytes of the last step, the losses."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.memory import MemoryTracker, memory_events
    from dtlab.zero import FullyShardedDataParallel

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
    wire = sum(
        e["wire_bytes"]
        for e in rec.events
        if e["kind"] == "comm" and e["step"] == steps - 1 and e["tag"] != "metrics"
        and e["tag"].startswith("zero") and "norm" not in e["tag"]
    )  # fmt: skip
    keys = ("params", "grads", "optimizer", "activations", "host")
    return {
        "memory": {k: mem[k] for k in keys},
        "wire": wire,
        "losses": losses,
        "psi": model.padded_numel,
    }


def _step_ddp(steps=2):
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.ddp import DistributedDataParallel

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
    last = [e for e in rec.events if e["kind"] == "comm" and e["step"] == steps - 1]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"wire": sum(e["wire_bytes"] for e in last), "params": params,
            "losses": losses}  # fmt: skip


def _step_tp():
    """One forward and backward of the GPT split over tp=2 (dp = world/2)."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab import tensor_parallel as tpm
    from dtlab.topology import Layout, Topology

    topo = Topology(Layout(dp=dist.get_world_size() // 2, tp=2))
    model = tpm.tensor_parallel_gpt(CFG, topo)
    rec = telemetry.Recorder(topo.rank)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, 2)
    with telemetry.use(rec):
        _, loss = model(x, y)
        loss.backward()
        model.finish_gradient_synchronization()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    wire = sum(e["wire_bytes"] for e in rec.events if e["kind"] == "comm")
    return {"params": params, "wire": wire}


def rank_measurements() -> dict:
    """Everything the cards measure live, on this rank: the process id, ZeRO stages
    0-3 (and stage 3 with offload), DDP and tensor parallelism."""
    import torch.distributed as dist

    return {
        "pid": os.getpid(),
        "world": dist.get_world_size(),
        "zero": {s: _step_zero(s) for s in (0, 1, 2, 3)},
        "offload": _step_zero(3, offload=True),
        "ddp": _step_ddp(),
        "tp": _step_tp(),
    }


# ---- the cards' measurements -------------------------------------------------------
class _Context:
    """What measurements share: the live results, fetched once."""

    def __init__(self, cluster=None, timeout: float = 120):
        self.cluster, self.timeout = cluster, timeout
        self._live: list | None = None

    def live(self) -> list[dict]:
        if self._live is None:
            if self.cluster is None:
                raise ValueError(
                    "this card measures on the live cluster: pass Drill(cluster) "
                    "(cluster = dtlab.lab.start(world_size=4))"
                )
            n = self.cluster.world_size
            if not 2 <= n <= 4 or n % 2:
                raise ValueError(f"the drill runs on 2 or 4 ranks, not {n}")
            self._live = self.cluster.run(rank_measurements, timeout=self.timeout)
        return self._live


def _gb(x: float) -> str:
    return f"{x / est.GB:,.1f} GB"


def _m_why_distribute(ctx) -> Measurement:
    psi = est.MODELS["70B"].n_params
    states = est.zero_memory_per_device(psi, 1, 0)["total"]
    days = est.train_time(psi, 2e12, 1, 989e12, 0.4) / 86400
    return Measurement(
        states / est.GB, "GB", "estimate",
        f"70B with mixed-precision Adam needs {_gb(states)} of model states (16 "
        f"bytes a parameter) against one H100's 80 GB, and 2T tokens at 40 % MFU "
        f"would take {days / 365:,.0f} years on that one GPU "
        f"({days / 1024:,.0f} days on 1024).",
    )  # fmt: skip


def _m_dp_vs_mp(ctx) -> Measurement:
    live = ctx.live()
    full, tp = live[0]["ddp"]["params"], live[0]["tp"]["params"]
    return Measurement(
        tp / full, "ratio", "live",
        f"Measured on rank 0: DDP holds all {full:,} bytes of weights; tp=2 holds "
        f"{tp:,} ({tp / full:.0%}) — the norms and position embeddings stay whole.",
        predicted=est.stage_params(CFG, est.Parallelism(tp=2))["total"]
        / CFG.n_params(),
    )  # fmt: skip


def _m_fsdp(ctx) -> Measurement:
    live = ctx.live()
    n = live[0]["world"]
    got = [r["zero"][3]["memory"]["params"] for r in live]
    psi = live[0]["zero"][3]["psi"]
    return Measurement(
        got[0], "bytes", "live",
        f"ZeRO-3 on {n} ranks: each holds {got[0]:,} bytes of fp32 weights, 1/{n} "
        f"of the {4 * psi:,} a replica would (Ψ padded to a multiple of {n}).",
        predicted=4 * psi / n,
    )  # fmt: skip


def _m_tp_node(ctx) -> Measurement:
    live = ctx.live()
    wire = live[0]["tp"]["wire"]
    want = est.layout_traffic(CFG, est.Parallelism(tp=2), micro_batch_size=2)["tp"]
    kw = dict(peak_flops=989e12, mfu=0.5, sequence_parallel=True)
    fast = est.tp_step_time(80, 1, 4096, 8192, 8, link="nvlink", **kw)
    slow = est.tp_step_time(80, 1, 4096, 8192, 8, link="ethernet", **kw)
    return Measurement(
        wire, "bytes", "live",
        f"One forward+backward at tp=2 sent {wire:,.0f} bytes per rank (predicted "
        f"{want:,.0f}): every layer, every micro-batch. Scaled to a 70B layer stack "
        f"at tp=8, communication is {fast['comm_fraction']:.0%} of the time over "
        f"NVLink and {slow['comm_fraction']:.0%} over 100 Gb/s Ethernet.",
        predicted=want,
    )  # fmt: skip


def _pipeline_bubble(p, m, schedule="1f1b", v=1) -> float:
    from dtlab import pipeline

    return pipeline.bubble(pipeline.simulate(pipeline.make_schedule(schedule, p, m, v)))


def _m_bubble(ctx) -> Measurement:
    few, many = _pipeline_bubble(4, 4), _pipeline_bubble(4, 16)
    inter = _pipeline_bubble(4, 4, "interleaved", 2)
    return Measurement(
        few, "fraction", "simulate",
        f"Simulated 1F1B on p=4 stages: the bubble is {few:.0%} of the step with "
        f"m=4 micro-batches, {many:.0%} with m=16, and {inter:.0%} with m=4 "
        f"interleaved over v=2 chunks; (p-1)/(m+p-1) predicts "
        f"{est.pipeline_bubble_fraction(4, 4):.0%} and "
        f"{est.pipeline_bubble_fraction(4, 16):.0%}.",
        predicted=est.pipeline_bubble_fraction(4, 4),
    )  # fmt: skip


def _m_zero3_vs_fsdp(ctx) -> Measurement:
    live = ctx.live()
    z0, z3 = live[0]["zero"][0]["wire"], live[0]["zero"][3]["wire"]
    return Measurement(
        z3 / z0, "ratio", "live",
        f"Measured per step and rank: ZeRO-3 sent {z3:,.0f} bytes, plain data "
        f"parallelism {z0:,.0f}: {z3 / z0:.2f}x — the weights are gathered again "
        f"for backward. FSDP and DeepSpeed's ZeRO-3 move the same bytes.",
        predicted=1.5,
    )  # fmt: skip


def _m_zero_stages(ctx) -> Measurement:
    live = ctx.live()
    n, psi = live[0]["world"], live[0]["zero"][0]["psi"]
    rows = []
    for s in range(4):
        got = live[0]["zero"][s]["memory"]
        states = got["params"] + got["grads"] + got["optimizer"]
        rows.append(f"stage {s}: {states:,}")
    z0 = sum(live[0]["zero"][0]["memory"][k] for k in ("params", "grads", "optimizer"))
    z3 = sum(live[0]["zero"][3]["memory"][k] for k in ("params", "grads", "optimizer"))
    want = est.zero_states_per_rank(psi, n, 3, "fp32")["total"]
    return Measurement(
        z0 / z3, "ratio", "live",
        f"Model-state bytes per rank on {n} ranks (fp32 Adam, measured; Adam's "
        f"step counters included): {'; '.join(rows)}. Stage 3 holds 1/{n} of "
        f"stage 0.",
        predicted=4 * psi * 4 / want,
    )  # fmt: skip


def _m_dp_vs_ddp(ctx) -> Measurement:
    from dtlab.ddp import DataParallel

    live = ctx.live()
    n = live[0]["world"]
    dp = DataParallel(GPT(CFG), n_devices=n, threads=False)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    dp(x, y)
    report = dp.memory_report()
    total = [sum(v for k, v in d.items() if k != "device") for d in report]
    wire = live[0]["ddp"]["wire"]
    want = est.ddp_bytes_per_step(CFG.n_params(), n)
    return Measurement(
        total[0] / total[1], "ratio", "local",
        f"nn.DataParallel's way, one process: device 0 holds {total[0]:,} bytes, "
        f"the others {total[1]:,} each (the gradients and gathered outputs land on "
        f"the primary). DDP, {n} processes: every rank the same, and each sent "
        f"{wire:,.0f} bytes per step = 2(N-1)/N·Ψ·4 = {want:,.0f}.",
    )  # fmt: skip


def _m_1f1b(ctx) -> Measurement:
    from dtlab import pipeline

    p, m = 4, 8
    peak = {
        s: max(max(r) for r in pipeline.in_flight(pipeline.make_schedule(s, p, m)))
        for s in ("gpipe", "1f1b")
    }
    return Measurement(
        peak["1f1b"], "micro-batches", "simulate",
        f"p=4 stages, m=8 micro-batches: GPipe keeps the activations of "
        f"{peak['gpipe']} micro-batches on the first stage, 1F1B of {peak['1f1b']} "
        f"(at most p), with the same bubble.",
        predicted=est.pipeline_in_flight(p, 0, m, "1f1b"),
    )  # fmt: skip


def _m_amp(ctx) -> Measurement:
    model = GPT(CFG)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    model(x, y)[1].backward()
    # a large model's per-element gradients are far smaller than this toy's:
    # shift them by 1e-4 to where they typically live
    g = torch.cat([p.grad.flatten() for p in model.parameters()]) * 1e-4
    nonzero = g != 0
    lost = float(((g.half() == 0) & nonzero).float().mean())
    scale = 2.0**16
    kept = float((((g * scale).half() == 0) & nonzero).float().mean())
    return Measurement(
        lost, "fraction", "local",
        f"Gradients cast to fp16: {lost:.1%} flush to zero (below 2^-24); "
        f"multiplied first by the loss scale 2^16: {kept:.1%}. The scale is divided "
        f"out again in fp32 before the optimizer step; bf16 needs no scaling (fp32's "
        f"exponent range).",
        extra={"lost_with_scaling": kept},
    )  # fmt: skip


def _m_3d(ctx) -> Measurement:
    plan = est.plan("405B", n_gpus=1024, global_batch=1024, micro_batch_sizes=(1, 2))
    b = plan.best
    return Measurement(
        b.layout.tp, "tp", "estimate",
        f"The planner's fastest layout for 405B on 1024 H100s (128 nodes of 8): "
        f"{b.layout}, ZeRO-{b.zero_stage}, {b.checkpointing} checkpointing, "
        f"{_gb(b.memory['total'])} per GPU, {b.step_s:.0f} s per step of 1024 x "
        f"8K tokens. tp stays within a node's 8 GPUs.",
    )  # fmt: skip


def _m_accelerate(ctx) -> Measurement:
    live = ctx.live()
    ddp, z3 = live[0]["ddp"]["losses"], live[0]["zero"][3]["losses"]
    diff = max(abs(a - b) for a, b in zip(ddp, z3))
    return Measurement(
        diff, "abs loss difference", "live",
        f"The same loop, the strategy swapped (DDP -> ZeRO-3): losses "
        f"{', '.join(f'{v:.6f}' for v in ddp)} vs {', '.join(f'{v:.6f}' for v in z3)}"
        f" — a difference of {diff:.1e} after two steps. Wrappers change where the "
        f"bytes live, not the maths.",
        predicted=0.0,
    )  # fmt: skip


def _m_offload(ctx) -> Measurement:
    live = ctx.live()
    got = live[0]["offload"]["memory"]
    on_device = got["params"] + got["grads"] + got["optimizer"]
    plan = est.plan("70B", n_gpus=8, global_batch=64, micro_batch_sizes=(1,),
                    offload=True)  # fmt: skip
    best = plan.best
    return Measurement(
        got["host"], "bytes", "live",
        f"ZeRO-3 with offload, measured on rank 0: {on_device:,} bytes of model "
        f"states on the device, {got['host']:,} on the host (fp32 master slice, its "
        f"gradient, Adam's moments). At scale: 70B on 8 x 80 GB fits only this way "
        f"— {best.layout}, {_gb(best.memory['total'])} on each GPU and "
        f"{_gb(best.memory['host'])} of host memory per GPU, at "
        f"{best.step_s:.0f} s a step.",
    )  # fmt: skip


def _m_comm(ctx) -> Measurement:
    live = ctx.live()
    wire = live[0]["ddp"]["wire"]
    psi = est.MODELS["70B"].n_params
    ar = est.collective_time("all_reduce", 2 * psi, 64, 5e-6, 50e9)
    compute = est.training_flops(psi, 64 * 4096) / (64 * 989e12 * 0.5)
    return Measurement(
        wire, "bytes", "live",
        f"Each DDP step moved {wire:,.0f} bytes per rank here (2(N-1)/N of the "
        f"gradients, whatever the batch). For 70B over 64 GPUs on 50 GB/s "
        f"InfiniBand, one bf16 gradient all-reduce takes {ar:.1f} s, against "
        f"{compute:.1f} s of compute for a 64 x 4K-token batch.",
    )  # fmt: skip


def _m_serving(ctx) -> Measurement:
    train = est.layout_memory("70B", est.Parallelism(dp=8), zero_stage=3,
                              precision="bf16", checkpointing="full",
                              states="paper")  # fmt: skip
    serve = est.serving_memory("70B", tp=8, batch=32, context=4096)
    return Measurement(
        serve["total"] / est.GB, "GB", "estimate",
        f"70B on 8 GPUs: training with ZeRO-3 needs {_gb(train['total'])} per GPU; "
        f"serving with tp=8 needs {_gb(serve['weights'])} of weights and "
        f"{_gb(serve['kv_cache'])} of KV cache for 32 sequences of 4K tokens.",
    )  # fmt: skip


def _m_processes(ctx) -> Measurement:
    live = ctx.live()
    pids = {r["pid"] for r in live}
    return Measurement(
        len(pids), "processes", "live",
        f"The {len(live)} ranks of this drill are {len(pids)} separate processes "
        f"(pids {sorted(pids)}), each with its own interpreter, one per device — "
        f"no GIL shared, unlike nn.DataParallel's threads; this kernel is "
        f"{os.getpid()}.",
        predicted=len(live),
    )  # fmt: skip


def _m_cp_ep(ctx) -> Measurement:
    spec = est.MODELS["70B"]
    one = est.layout_memory(spec, est.Parallelism(tp=8), seq_len=131072,
                            checkpointing="selective", precision="bf16",
                            sequence_parallel=True)  # fmt: skip
    cp = est.layout_memory(spec, est.Parallelism(tp=8, cp=8), seq_len=131072,
                           checkpointing="selective", precision="bf16",
                           sequence_parallel=True)  # fmt: skip
    ep = est.layout_traffic("8x7B", est.Parallelism(dp=8, ep=8), precision="bf16")
    return Measurement(
        one["activations"] / cp["activations"], "ratio", "estimate",
        f"70B at 128K tokens, tp=8 with sequence parallelism: "
        f"{_gb(one['activations'])} of activations per GPU; cp=8 divides them to "
        f"{_gb(cp['activations'])}. Mixtral 8x7B with ep=8: "
        f"{ep['ep'] / 1e9:.1f} GB of all-to-all per rank per 4K-token sequence.",
        predicted=8.0,
    )  # fmt: skip


def _m_beyond(ctx) -> Measurement:
    rows, dim, n = 1_000_000_000, 128, 64
    table = rows * dim * 4
    lookups = 65536 * 100  # a batch of 64K users, 100 ids each
    a2a = est.wire_bytes("all_to_all", lookups * dim * 4, n)
    return Measurement(
        table / n / est.GB, "GB", "estimate",
        f"A recommender's 1B x 128 fp32 embedding table is {_gb(table)}: "
        f"row-sharded over {n} GPUs, {_gb(table / n)} each. Each batch then "
        f"exchanges the looked-up rows by all-to-all, {a2a / 1e9:.1f} GB sent per "
        f"rank — expert parallelism's pattern.",
    )  # fmt: skip


def _frame(replicated, sharded, synchronized, cost, summary) -> dict:
    return dict(replicated=replicated, sharded=sharded, synchronized=synchronized,
                cost=cost, summary=summary)  # fmt: skip


S000, S001, S004 = "000 systems view", "001 strategies + Q&A", "004 interview series"
CARDS: tuple[Card, ...] = (
    Card(
        "why_distribute",
        "Why can a 70B model not be trained on one GPU, and why would it take too "
        "long even if it fit?",
        (S000, S001, S004),
        _frame(
            "Nothing yet: one device holds everything.",
            "Nothing: that is the problem.",
            "Nothing to synchronize.",
            "Memory first (16 bytes a parameter of model states plus activations), "
            "then time: 6·N·D FLOPs at a realistic MFU.",
            "Two walls: capacity and throughput. Training keeps weights, gradients "
            "and Adam's states, several times the weights; and one device's FLOP/s "
            "turn a pre-training run into years. Distribution is the only way to "
            "both fit and finish.",
        ),
        _m_why_distribute,
    ),
    Card(
        "dp_vs_mp",
        "What is the difference between data parallelism and model parallelism?",
        (S001, S004),
        _frame(
            "DP: the whole model and optimizer on every rank. MP: nothing of the "
            "weights (each rank its part).",
            "DP: the batch. MP: the model — tensors within a layer (TP) or layers "
            "into stages (PP).",
            "DP: gradients, all-reduced once per step. TP: activations inside every "
            "layer; PP: activations between stages per micro-batch.",
            "DP: gradient traffic 2Ψ per step, but memory does not shrink. MP: "
            "memory shrinks, communication (TP) or idle time (PP) grows.",
            "Data parallelism buys throughput, model parallelism buys capacity; "
            "large jobs need both.",
        ),
        _m_dp_vs_mp,
    ),
    Card(
        "fsdp_shards",
        "What does FSDP shard, and why?",
        (S001,),
        _frame(
            "Only the activations of each rank's own micro-batch, and for a moment "
            "the one or two layers being gathered.",
            "Parameters, gradients and optimizer state, each in N flat slices "
            "(ZeRO-3).",
            "Each layer's weights are all-gathered before its forward and again "
            "before its backward; gradients are reduce-scattered as backward "
            "produces them; every step.",
            "1.5x DDP's bytes (3Ψ); hidden by prefetching the next layer while the "
            "current one computes.",
            "Model states drop to 16Ψ/N per GPU, so a model many times one GPU's "
            "memory trains on a node.",
        ),
        _m_fsdp,
    ),
    Card(
        "tp_in_node",
        "Why is tensor parallelism kept within a node?",
        (S000, S001),
        _frame(
            "Layer norms, the residual stream's activations (without sequence "
            "parallelism).",
            "Every weight matrix: columns of the first, rows of the second "
            "(Megatron's f and g).",
            "Two all-reduces forward and two backward in every layer, for every "
            "micro-batch, on the critical path.",
            "Bandwidth: activation-sized collectives dozens of times a step. Over "
            "NVLink they are affordable; across nodes they dominate.",
            "TP's communication cannot wait and cannot be batched, so it goes where "
            "the links are fastest; pipeline stages, which only pass activations "
            "between neighbours, cross the nodes.",
        ),
        _m_tp_node,
    ),
    Card(
        "pipeline_bubble",
        "What is the pipeline bubble and how do you reduce it?",
        (S001, S004),
        _frame(
            "Nothing of the weights; each stage owns its layers.",
            "Layers into p stages; the batch into m micro-batches.",
            "Activations forward and gradients backward between neighbouring "
            "stages, once per micro-batch; gradients over dp once per step.",
            "Idle time: (p-1)/(m+p-1) of the step while the pipeline fills and drains.",
            "More micro-batches per step shrink it; interleaving v chunks per rank "
            "divides it by v (more p2p messages); zero-bubble schedules split the "
            "backward to fill the gaps.",
        ),
        _m_bubble,
    ),
    Card(
        "zero3_vs_fsdp",
        "When would you choose DeepSpeed ZeRO-3 over PyTorch FSDP?",
        (S001, S004),
        _frame(
            "The same in both: each rank's activations.",
            "The same in both: parameters, gradients, optimizer state.",
            "The same in both: gather before use, reduce-scatter gradients.",
            "The same bytes (3Ψ per step); the differences are engineering: "
            "offload to CPU/NVMe (ZeRO-Infinity), MoE support and config files in "
            "DeepSpeed; no extra dependency and composability with torch in FSDP.",
            "It is one algorithm with two implementations: pick DeepSpeed for "
            "offload or its MoE stack, FSDP for native PyTorch; at frontier scale "
            "it gets combined with TP and PP anyway.",
        ),
        _m_zero3_vs_fsdp,
    ),
    Card(
        "zero_stages",
        "What do ZeRO stages 1, 2 and 3 partition, and how much does each save?",
        (S001, S004),
        _frame(
            "Stage 1: weights and gradients. Stage 2: weights. Stage 3: nothing "
            "persistent.",
            "Stage 1: optimizer state (12 of 16 bytes). Stage 2: + gradients. Stage "
            "3: + weights.",
            "Stages 1-2: reduce-scatter gradients, all-gather updated weights, each "
            "step (2Ψ, as DDP). Stage 3: also gathers weights per layer (3Ψ).",
            "Memory 16Ψ -> 4Ψ + 12Ψ/N -> 2Ψ + 14Ψ/N -> 16Ψ/N; traffic only grows "
            "at stage 3.",
            "About 4x, 8x and Nx less model state; stages 1 and 2 are free in bytes.",
        ),
        _m_zero_stages,
    ),
    Card(
        "dp_vs_ddp",
        "nn.DataParallel or DistributedDataParallel: what is the difference?",
        (S004,),
        _frame(
            "Both: the model on every device. DataParallel also copies the weights "
            "from the primary every step.",
            "Both: the batch.",
            "DataParallel: scatter inputs, gather outputs and sum gradients on GPU "
            "0, broadcast weights, each step. DDP: one bucketed all-reduce of "
            "gradients, overlapped with backward.",
            "DataParallel: one process's GIL and an overloaded primary GPU. DDP: "
            "2(N-1)/N·Ψ bytes per rank per step, spread evenly.",
            "DDP is one process per GPU with a ring all-reduce; DataParallel is "
            "threads around one primary and is kept only for quick experiments.",
        ),
        _m_dp_vs_ddp,
    ),
    Card(
        "one_f_one_b",
        "What is 1F1B scheduling and why is it preferred over GPipe?",
        (S004,),
        _frame(
            "Nothing of the weights.",
            "Layers into stages, the batch into micro-batches.",
            "As any pipeline: per micro-batch p2p sends; the order differs: after "
            "a warm-up of p-1 forwards each stage alternates one forward, one "
            "backward.",
            "Same bubble as GPipe, but a stage holds at most p micro-batches of "
            "activations instead of m.",
            "1F1B frees each micro-batch's activations as soon as its backward runs, "
            "so m can grow (shrinking the bubble) without memory growing with it.",
        ),
        _m_1f1b,
    ),
    Card(
        "amp_loss_scaling",
        "How does mixed-precision training work, and why does fp16 need loss scaling?",
        (S004, S001),
        _frame(
            "An fp32 master copy of the weights, kept by the optimizer.",
            "Nothing more: precision is orthogonal to sharding (ZeRO shards the "
            "master copy too).",
            "Gradients are reduced in 16 bits; an overflow on any rank skips the "
            "step on all ranks.",
            "Half the bytes for weights, activations and traffic; the master copy "
            "costs 4 more bytes a parameter.",
            "Compute in fp16/bf16, update in fp32. fp16's small exponent range "
            "flushes small gradients to zero, so the loss is multiplied by a "
            "dynamic scale before backward and divided out before the step; bf16 "
            "has fp32's range and needs none.",
        ),
        _m_amp,
    ),
    Card(
        "three_d",
        "What is 3D parallelism, and how do you map it onto the hardware?",
        (S000, S001, S004),
        _frame(
            "Across dp: the whole tp x pp model slice.",
            "TP within each layer, PP across layers, DP across the batch (often with "
            "ZeRO over dp).",
            "TP: per layer and micro-batch; PP: per micro-batch between stages; DP: "
            "per step.",
            "Each axis has its own: TP bandwidth, PP bubble, DP gradient traffic; "
            "the layout puts the chattiest axis on the fastest links.",
            "TP inside a node over NVLink, PP across nodes, DP over the remaining "
            "replicas; the product is the world size.",
        ),
        _m_3d,
    ),
    Card(
        "accelerate_vs_deepspeed",
        "accelerate or DeepSpeed: what does each one do for you?",
        (S004,),
        _frame(
            "Whatever the chosen backend replicates.",
            "Whatever the chosen backend shards (accelerate can drive DDP, FSDP or "
            "DeepSpeed itself).",
            "The backend's collectives; the wrapper adds none of its own.",
            "The backend's; the wrapper's cost is a little indirection.",
            "accelerate is a thin launcher and wrapper: the same script runs on one "
            "GPU, many GPUs, FSDP or DeepSpeed. DeepSpeed is an engine that takes "
            "over the training loop and brings ZeRO, offload, pipeline and MoE.",
        ),
        _m_accelerate,
    ),
    Card(
        "offload",
        "What are ZeRO-Offload and ZeRO-Infinity, and what do they cost?",
        (S001, S004),
        _frame(
            "As in ZeRO underneath.",
            "Optimizer state, master weights and their gradients move to CPU memory "
            "(Offload) or NVMe (Infinity).",
            "Every step: gradient slices go to the host, updated 16-bit weights come "
            "back over PCIe; the CPU runs Adam.",
            "PCIe bandwidth and the CPU's optimizer step, which can exceed the GPU's "
            "compute for small batches.",
            "Trade step time for capacity: the GPU keeps the 16-bit weights it "
            "computes with, the rest of the 16 bytes a parameter lives where memory "
            "is cheap.",
        ),
        _m_offload,
    ),
    Card(
        "comm_dominates",
        "Why is communication, rather than computation, the real cost of "
        "distributed training?",
        (S000, S001),
        _frame(
            "Whatever the strategy replicates must be kept consistent.",
            "Whatever it shards must be gathered where it is used.",
            "That is the question every strategy answers: what, when, how often.",
            "Links are 10-100x slower than HBM and collectives involve every rank; "
            "bytes per step grow with the model, not with the batch.",
            "Compute scales with the number of GPUs; synchronization does not, so "
            "each design minimizes and hides bytes: buckets, overlap, placement.",
        ),
        _m_comm,
    ),
    Card(
        "training_vs_serving",
        "Why is the same model served with a simpler layout than it was trained with?",
        (S000,),
        _frame(
            "Often the whole 16-bit model per replica, many replicas for throughput.",
            "Only the weights (tp) when one GPU cannot hold them, plus the KV cache.",
            "No gradients, no optimizer: per token only tp's all-reduces.",
            "Latency per token and KV-cache memory; a pipeline or sharded optimizer "
            "would add waiting and traffic a request cannot afford.",
            "Serving keeps 2 bytes a parameter instead of 16 and optimizes for "
            "latency, so a small tp group per replica replaces the training job's "
            "3D layout.",
        ),
        _m_serving,
    ),
    Card(
        "processes",
        "How are the processes of a distributed job started (torch.multiprocessing, "
        "mp.spawn, torchrun)?",
        (S004,),
        _frame(
            "The script: every process runs the same program.",
            "The rank: each process learns its own and its device.",
            "A rendezvous (store) once at start-up, then the process group's "
            "collectives.",
            "Start-up only; afterwards nothing but the collectives.",
            "One process per device: mp.spawn forks them from Python, torchrun "
            "launches them per node with the environment set, and "
            "init_process_group joins them.",
        ),
        _m_processes,
    ),
    Card(
        "long_context_moe",
        "How do context parallelism and expert parallelism extend 3D parallelism?",
        (S001,),
        _frame(
            "CP: the weights (like dp). EP: attention and the dense layers.",
            "CP: the sequence of every micro-batch, hence activations / cp. EP: the "
            "experts of each MoE layer, across the dp ranks.",
            "CP: K/V blocks around a ring in every attention layer. EP: tokens to "
            "their experts and back, two all-to-alls per MoE layer each way.",
            "CP: ring traffic, overlapped with attention. EP: all-to-all bandwidth, "
            "and load imbalance between experts.",
            "CP makes 100K+ token contexts fit; EP makes sparse models with many "
            "experts fit while each token pays only for its top-k experts.",
        ),
        _m_cp_ep,
    ),
    Card(
        "beyond_llms",
        "Where does the same reasoning show up beyond LLMs?",
        (S000,),
        _frame(
            "Recommenders: the dense towers. Storage: replicas for availability.",
            "Recommenders: embedding tables by rows. Graphs: the vertices into "
            "partitions.",
            "Recommenders: an all-to-all of looked-up rows per batch. Graphs: the "
            "boundary (halo) vertices per iteration.",
            "The bytes crossing partitions: a good partition cuts few edges, as a "
            "good layout keeps chatty axes together.",
            "Replicate what is small and read often, shard what is large, and place "
            "the shards so that the traffic crosses the fewest slow links.",
        ),
        _m_beyond,
    ),
)

# the questions of the course's sources, each mapped to its card
SOURCE_QUESTIONS: dict[str, str] = {
    "What is the difference between data parallelism and model parallelism?": (
        "dp_vs_mp"
    ),
    "What does FSDP shard and why?": "fsdp_shards",
    "Why is tensor parallelism kept within a node?": "tp_in_node",
    "What is the pipeline bubble and how do you reduce it?": "pipeline_bubble",
    "When would you choose DeepSpeed ZeRO-3 over FSDP?": "zero3_vs_fsdp",
    "Three stages of ZeRO": "zero_stages",
    "DP vs DDP": "dp_vs_ddp",
    "Pipeline Parallelism + 1F1B": "one_f_one_b",
    "AMP Mixed Precision + Loss Scaling": "amp_loss_scaling",
    "3D Parallelism (TP+PP+DP)": "three_d",
    "accelerate vs DeepSpeed": "accelerate_vs_deepspeed",
    "ZeRO-Offload / ZeRO-Infinity": "offload",
    "Communication Is the Real Cost": "comm_dominates",
    "Training vs Inference": "training_vs_serving",
    "Why LLMs Force Distribution": "why_distribute",
    "torch.multiprocessing": "processes",
    "Context parallelism / expert parallelism": "long_context_moe",
    "How This Transfers Beyond LLMs": "beyond_llms",
}

FRAME = (
    ("replicated", "What is replicated"),
    ("sharded", "What is sharded"),
    ("synchronized", "What is synchronized, and how often"),
    ("cost", "What dominates the cost"),
)


def answer_html(card: Card, m: Measurement) -> str:
    """The model answer: the summary, the four questions, the measurement."""
    items = "".join(
        f"<li><b>{title}:</b> {html.escape(card.answer[key])}</li>"
        for key, title in FRAME
    )
    pred = "" if m.predicted is None else f" (predicted: {m.predicted:,.3g})"
    return (
        f"<p>{html.escape(card.answer['summary'])}</p><ul>{items}</ul>"
        f"<p><b>Measured</b> <i>[{m.kind}]</i>: {html.escape(m.text)}{pred}</p>"
    )


@dataclass
class _CardView:
    card: Card
    widget: object
    textarea: object
    answer: object
    button: object
    measurement: Measurement | None = field(default=None)


class Drill:
    """All :data:`CARDS` as widgets; ``cluster`` (world 2 or 4) serves the live
    measurements. :meth:`reveal` is the Reveal button in code."""

    def __init__(self, cluster=None, *, timeout: float = 120, cards=CARDS):
        import ipywidgets as W

        self.ctx = _Context(cluster, timeout)
        self.views: dict[str, _CardView] = {}
        boxes = []
        for i, card in enumerate(cards, 1):
            text = W.Textarea(placeholder="Your answer, before you reveal…",
                              layout=W.Layout(width="98%", height="70px"))  # fmt: skip
            button = W.Button(description="Reveal", button_style="info")
            answer = W.HTML()
            title = W.HTML(f"<h4>{i}. {html.escape(card.question)}</h4>")
            view = _CardView(card, W.VBox([title, text, button, answer]), text,
                             answer, button)  # fmt: skip
            button.on_click(lambda _, key=card.key: self._click(key))
            self.views[card.key] = view
            boxes.append(view.widget)
        self.output = W.Output()
        self.widget = W.VBox([*boxes, self.output])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _click(self, key: str) -> None:
        self.output.clear_output()
        with self.output:
            try:
                self.reveal(key)
            except Exception:  # shown under the cards, not lost in a callback
                import traceback

                traceback.print_exc()

    def reveal(self, key: str) -> Measurement:
        """Measure (once) and show card ``key``'s model answer."""
        if key not in self.views:
            raise ValueError(f"no card {key!r}: expected one of {list(self.views)}")
        view = self.views[key]
        if view.measurement is None:
            view.measurement = view.card.measure(self.ctx)
            value = view.measurement.value
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"card {key!r} measured a non-number: {value!r}")
        view.answer.value = answer_html(view.card, view.measurement)
        view.button.description = "Revealed"
        return view.measurement

    def reveal_all(self) -> dict[str, Measurement]:
        return {key: self.reveal(key) for key in self.views}

    def answers(self) -> dict[str, str]:
        """What the learner typed, by card."""
        return {k: v.textarea.value for k, v in self.views.items()}

"""The numbers behind the drill's model answers (chapter 10), one function per card.

Each function takes the drill's :class:`Context` and returns a :class:`Measurement`:
a value the course measured on the live cluster (``live``: the runs of
:mod:`dtlab.lab.engine.drill`, fetched once for every card), simulated
(``simulate``: :func:`dtlab.pipeline.simulate`), computed in this kernel's own
process (``local``), or taken from the analytic model (``estimate``:
:mod:`dtlab.estimate`), next to what a formula predicts where one does. The cards
(``cards.ini``) name their measurement; :data:`MEASUREMENTS` finds it by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dtlab import estimate, pipeline
from dtlab.ddp import DataParallel
from dtlab.lab.drill.measurements_frontier import FRONTIER
from dtlab.lab.drill.measurements_resilience import RESILIENCE
from dtlab.lab.engine.drill import BATCH, CFG, rank_measurements
from dtlab.model import GPT, SyntheticTokens

KINDS = ("live", "simulate", "local", "estimate")  # where a number comes from


@dataclass(frozen=True)
class Measurement:
    """One number behind a model answer: ``value`` in ``unit``, where it came from
    (``kind``: one of :data:`KINDS`), and what it shows (``text``); ``predicted`` is
    what a formula of :mod:`dtlab.estimate` says it should be."""

    value: float
    unit: str
    kind: str
    text: str
    predicted: float | None = None
    extra: dict = field(default_factory=dict)  # other numbers the text quotes


class Context:
    """What the measurements share: the cluster, and its live results, fetched
    once (one bounded ``cluster.run`` of
    :func:`dtlab.lab.engine.drill.rank_measurements`)."""

    def __init__(self, cluster=None, timeout: float = 120):
        self.cluster, self.timeout = cluster, timeout
        self._live: list | None = None

    def live(self) -> list[dict]:
        """Each rank's live results (a list in rank order)."""
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
    return f"{x / estimate.GB:,.1f} GB"


def why_distribute(ctx: Context) -> Measurement:
    psi = estimate.MODELS["70B"].n_params
    states = estimate.zero_memory_per_device(psi, 1, 0)["total"]
    days = estimate.train_time(psi, 2e12, 1, 989e12, 0.4) / 86400
    return Measurement(
        states / estimate.GB,
        "GB",
        "estimate",
        f"70B with mixed-precision Adam needs {_gb(states)} of model states (16 "
        f"bytes a parameter) against one H100's 80 GB, and 2T tokens at 40 % MFU "
        f"would take {days / 365:,.0f} years on that one GPU "
        f"({days / 1024:,.0f} days on 1024).",
    )


def tp_weight_share(ctx: Context) -> Measurement:
    live = ctx.live()
    full, tp = live[0]["ddp"]["params"], live[0]["tp"]["params"]
    return Measurement(
        tp / full,
        "ratio",
        "live",
        f"Measured on rank 0: DDP holds all {full:,} bytes of weights; tp=2 holds "
        f"{tp:,} ({tp / full:.0%}) — the norms and position embeddings stay whole.",
        predicted=estimate.stage_params(CFG, estimate.Parallelism(tp=2))["total"]
        / CFG.n_params(),
    )


def fsdp_param_shards(ctx: Context) -> Measurement:
    live = ctx.live()
    n = live[0]["world"]
    got = [r["zero"][3]["memory"]["params"] for r in live]
    psi = live[0]["zero"][3]["psi"]
    return Measurement(
        got[0],
        "bytes",
        "live",
        f"ZeRO-3 on {n} ranks: each holds {got[0]:,} bytes of fp32 weights, 1/{n} "
        f"of the {4 * psi:,} a replica would (Ψ padded to a multiple of {n}).",
        predicted=4 * psi / n,
    )


def tp_traffic(ctx: Context) -> Measurement:
    live = ctx.live()
    wire = live[0]["tp"]["wire"]
    want = estimate.layout_traffic(CFG, estimate.Parallelism(tp=2), micro_batch_size=2)[
        "tp"
    ]
    kw = dict(peak_flops=989e12, mfu=0.5, sequence_parallel=True)
    fast = estimate.tp_step_time(80, 1, 4096, 8192, 8, link="nvlink", **kw)
    slow = estimate.tp_step_time(80, 1, 4096, 8192, 8, link="ethernet", **kw)
    return Measurement(
        wire,
        "bytes",
        "live",
        f"One forward+backward at tp=2 sent {wire:,.0f} bytes per rank (predicted "
        f"{want:,.0f}): every layer, every microbatch. Scaled to a 70B layer stack "
        f"at tp=8, communication is {fast['comm_fraction']:.0%} of the time over "
        f"NVLink and {slow['comm_fraction']:.0%} over 100 Gb/s Ethernet.",
        predicted=want,
    )


def simulated_bubble(p, m, schedule="1f1b", v=1) -> float:
    return pipeline.bubble(pipeline.simulate(pipeline.make_schedule(schedule, p, m, v)))


def pipeline_bubble(ctx: Context) -> Measurement:
    few, many = simulated_bubble(4, 4), simulated_bubble(4, 16)
    inter = simulated_bubble(4, 4, "interleaved", 2)
    return Measurement(
        few,
        "fraction",
        "simulate",
        f"Simulated 1F1B on p=4 stages: the bubble is {few:.0%} of the step with "
        f"m=4 microbatches, {many:.0%} with m=16, and {inter:.0%} with m=4 "
        f"interleaved over v=2 chunks; (p-1)/(m+p-1) predicts "
        f"{estimate.pipeline_bubble_fraction(4, 4):.0%} and "
        f"{estimate.pipeline_bubble_fraction(4, 16):.0%}.",
        predicted=estimate.pipeline_bubble_fraction(4, 4),
    )


def zero3_traffic_ratio(ctx: Context) -> Measurement:
    live = ctx.live()
    z0, z3 = live[0]["zero"][0]["wire"], live[0]["zero"][3]["wire"]
    return Measurement(
        z3 / z0,
        "ratio",
        "live",
        f"Measured per step and rank: ZeRO-3 sent {z3:,.0f} bytes, plain data "
        f"parallelism {z0:,.0f}: {z3 / z0:.2f}x — the weights are gathered again "
        f"for backward. FSDP and DeepSpeed's ZeRO-3 move the same bytes.",
        predicted=1.5,
    )


def zero_stage_states(ctx: Context) -> Measurement:
    live = ctx.live()
    n, psi = live[0]["world"], live[0]["zero"][0]["psi"]
    rows = []
    for s in range(4):
        got = live[0]["zero"][s]["memory"]
        states = got["params"] + got["grads"] + got["optimizer"]
        rows.append(f"stage {s}: {states:,}")
    z0 = sum(live[0]["zero"][0]["memory"][k] for k in ("params", "grads", "optimizer"))
    z3 = sum(live[0]["zero"][3]["memory"][k] for k in ("params", "grads", "optimizer"))
    want = estimate.zero_states_per_rank(psi, n, 3, "fp32")["total"]
    return Measurement(
        z0 / z3,
        "ratio",
        "live",
        f"Model-state bytes per rank on {n} ranks (fp32 Adam, measured; Adam's "
        f"step counters included): {'; '.join(rows)}. Stage 3 holds 1/{n} of "
        f"stage 0.",
        predicted=4 * psi * 4 / want,
    )


def data_parallel_primary(ctx: Context) -> Measurement:
    live = ctx.live()
    n = live[0]["world"]
    dp = DataParallel(GPT(CFG), n_devices=n, threads=False)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    dp(x, y)
    report = dp.memory_report()
    total = [sum(v for k, v in d.items() if k != "device") for d in report]
    wire = live[0]["ddp"]["wire"]
    want = estimate.ddp_bytes_per_step(CFG.n_params(), n)
    return Measurement(
        total[0] / total[1],
        "ratio",
        "local",
        f"nn.DataParallel's way, one process: device 0 holds {total[0]:,} bytes, "
        f"the others {total[1]:,} each (the gradients and gathered outputs land on "
        f"the primary). DDP, {n} processes: every rank the same, and each sent "
        f"{wire:,.0f} bytes per step = 2(N-1)/N·Ψ·4 = {want:,.0f}.",
    )


def one_f_one_b_in_flight(ctx: Context) -> Measurement:
    p, m = 4, 8
    peak = {
        s: max(max(r) for r in pipeline.in_flight(pipeline.make_schedule(s, p, m)))
        for s in ("gpipe", "1f1b")
    }
    return Measurement(
        peak["1f1b"],
        "microbatches",
        "simulate",
        f"p=4 stages, m=8 microbatches: GPipe keeps the activations of "
        f"{peak['gpipe']} microbatches on the first stage, 1F1B of {peak['1f1b']} "
        f"(at most p), with the same bubble.",
        predicted=estimate.pipeline_in_flight(p, 0, m, "1f1b"),
    )


def fp16_underflow(ctx: Context) -> Measurement:
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
        lost,
        "fraction",
        "local",
        f"This toy model's gradients, scaled by 1e-4 to the magnitudes of a large "
        f"model's, cast to fp16: {lost:.1%} flush to zero (below 2^-24); "
        f"multiplied first by the loss scale 2^16: {kept:.1%}. The scale is divided "
        f"out again in fp32 before the optimizer step; bf16 needs no scaling (fp32's "
        f"exponent range).",
        extra={"lost_with_scaling": kept},
    )


def planned_3d_layout(ctx: Context) -> Measurement:
    plan = estimate.plan(
        "405B", n_gpus=1024, global_batch=1024, micro_batch_sizes=(1, 2)
    )
    b = plan.best
    return Measurement(
        b.layout.tp,
        "tp",
        "estimate",
        f"The planner's fastest layout for 405B on 1024 H100s (128 nodes of 8): "
        f"{b.layout}, ZeRO-{b.zero_stage}, {b.checkpointing} checkpointing, "
        f"{_gb(b.memory['total'])} per GPU, {b.step_s:.0f} s per step of 1024 x "
        f"8K tokens. tp stays within a node's 8 GPUs.",
    )


def accelerate_and_dtlab(config) -> dict:
    """On every rank: the same job through HF accelerate (``Accelerator(cpu=True)
    .prepare``: torch DDP on gloo inside) and through dtlab's own DDP."""
    from dtlab.frameworks.accelerate_run import train_accelerate
    from dtlab.frameworks.job import dtlab_run

    theirs = train_accelerate(config)
    return {
        "accelerate": theirs["losses"],
        "prepared": theirs["prepared"],
        "dtlab": dtlab_run(config)["losses"],
    }


def accelerate_prepare(ctx: Context) -> Measurement:
    from dtlab.frameworks import missing
    from dtlab.train import TrainConfig

    if missing("accelerate") is not None:  # an install without the frameworks
        raise ValueError(f"this card runs HF accelerate: {missing('accelerate')}")
    if ctx.cluster is None:
        raise ValueError(
            "this card measures on the live cluster: pass Drill(cluster) "
            "(cluster = dtlab.lab.start(world_size=4))"
        )
    job = TrainConfig(model=CFG, steps=3, global_batch_size=BATCH)
    got = ctx.cluster.run(accelerate_and_dtlab, job, timeout=ctx.timeout)[0]
    diff = max(abs(a - b) for a, b in zip(got["accelerate"], got["dtlab"]))
    wrapped = ", ".join(t.rsplit(".", 1)[-1] for t in got["prepared"])
    return Measurement(
        diff,
        "abs loss difference",
        "live",
        f"accelerate.prepare(model, optimizer, loader) returned {wrapped}: torch's "
        f"DDP on gloo, wrapped. Its losses "
        f"{', '.join(f'{v:.6f}' for v in got['accelerate'])} against dtlab's DDP "
        f"{', '.join(f'{v:.6f}' for v in got['dtlab'])}: a difference of {diff:.1e} "
        f"after {len(got['dtlab'])} steps. The wrapper adds no maths and no "
        f"collectives of its own; the backend does the work.",
        predicted=0.0,
    )


def offload_bytes(ctx: Context) -> Measurement:
    live = ctx.live()
    got = live[0]["offload"]["memory"]
    on_device = got["params"] + got["grads"] + got["optimizer"]
    plan = estimate.plan(
        "70B", n_gpus=8, global_batch=64, micro_batch_sizes=(1,), offload=True
    )
    best = plan.best
    return Measurement(
        got["host"],
        "bytes",
        "live",
        f"ZeRO-3 with offload, measured on rank 0: {on_device:,} bytes of model "
        f"states on the device, {got['host']:,} on the host (fp32 master slice, its "
        f"gradient, Adam's moments). At scale: 70B on 8 x 80 GB fits only this way "
        f"— {best.layout}, {_gb(best.memory['total'])} on each GPU and "
        f"{_gb(best.memory['host'])} of host memory per GPU, at "
        f"{best.step_s:.0f} s a step.",
    )


def gradient_traffic(ctx: Context) -> Measurement:
    live = ctx.live()
    wire = live[0]["ddp"]["wire"]
    psi = estimate.MODELS["70B"].n_params
    ar = estimate.collective_time("all_reduce", 2 * psi, 64, 5e-6, 50e9)
    compute = estimate.training_flops(psi, 64 * 4096) / (64 * 989e12 * 0.5)
    return Measurement(
        wire,
        "bytes",
        "live",
        f"Each DDP step moved {wire:,.0f} bytes per rank here (2(N-1)/N of the "
        f"gradients, whatever the batch). For 70B over 64 GPUs on 50 GB/s "
        f"InfiniBand, one bf16 gradient all-reduce takes {ar:.1f} s, against "
        f"{compute:.1f} s of compute for a 64 x 4K-token batch.",
    )


def serving_memory(ctx: Context) -> Measurement:
    train = estimate.layout_memory(
        "70B",
        estimate.Parallelism(dp=8),
        zero_stage=3,
        precision="bf16",
        checkpointing="full",
        states="paper",
    )
    serve = estimate.serving_memory("70B", tp=8, batch=32, context=4096)
    return Measurement(
        serve["total"] / estimate.GB,
        "GB",
        "estimate",
        f"70B on 8 GPUs: training with ZeRO-3 needs {_gb(train['total'])} per GPU; "
        f"serving with tp=8 needs {_gb(serve['weights'])} of weights and "
        f"{_gb(serve['kv_cache'])} of KV cache for 32 sequences of 4K tokens.",
    )


def rank_processes(ctx: Context) -> Measurement:
    live = ctx.live()
    pids = {r["pid"] for r in live}
    return Measurement(
        len(pids),
        "processes",
        "live",
        f"The {len(live)} ranks of this drill are {len(pids)} separate processes "
        f"(pids {sorted(pids)}), each with its own interpreter, one per device — "
        f"no GIL shared, unlike nn.DataParallel's threads; this kernel is "
        f"{os.getpid()}.",
        predicted=len(live),
    )


def context_and_expert_parallel(ctx: Context) -> Measurement:
    spec = estimate.MODELS["70B"]
    one = estimate.layout_memory(
        spec,
        estimate.Parallelism(tp=8),
        seq_len=131072,
        checkpointing="selective",
        precision="bf16",
        sequence_parallel=True,
    )
    cp = estimate.layout_memory(
        spec,
        estimate.Parallelism(tp=8, cp=8),
        seq_len=131072,
        checkpointing="selective",
        precision="bf16",
        sequence_parallel=True,
    )
    ep = estimate.layout_traffic(
        "8x7B", estimate.Parallelism(dp=8, ep=8), precision="bf16"
    )
    return Measurement(
        one["activations"] / cp["activations"],
        "ratio",
        "estimate",
        f"70B at 128K tokens, tp=8 with sequence parallelism: "
        f"{_gb(one['activations'])} of activations per GPU; cp=8 divides them to "
        f"{_gb(cp['activations'])} (a little over 1/cp: the ring also keeps "
        "its output and log-sum-exp for the merge). "
        f"Mixtral 8x7B with ep=8: {ep['ep'] / 1e9:.1f} GB of all-to-all per rank "
        "per 4K-token sequence.",
    )


def embedding_table_sharding(ctx: Context) -> Measurement:
    rows, dim, n = 1_000_000_000, 128, 64
    table = rows * dim * 4
    lookups = 65536 * 100  # a batch of 64K users, 100 ids each
    a2a = estimate.wire_bytes("all_to_all", lookups * dim * 4, n)
    return Measurement(
        table / n / estimate.GB,
        "GB",
        "estimate",
        f"A recommender's 1B x 128 fp32 embedding table is {_gb(table)}: "
        f"row-sharded over {n} GPUs, {_gb(table / n)} each. Each batch then "
        f"exchanges the looked-up rows by all-to-all, {a2a / 1e9:.1f} GB sent per "
        f"rank — expert parallelism's pattern.",
    )


def ddp_wire(ctx: Context) -> Measurement:
    live = ctx.live()
    n, wire = live[0]["world"], live[0]["ddp"]["wire"]
    want = estimate.ddp_bytes_per_step(CFG.n_params(), n)
    return Measurement(
        wire,
        "bytes",
        "live",
        f"Measured: each of {n} DDP ranks sent {wire:,.0f} bytes in one step of a "
        f"{CFG.n_params():,}-parameter GPT, 2(N-1)/N·Ψ·4 = {want:,.0f}; on 1024 GPUs "
        f"the same formula gives {estimate.ddp_bytes_per_step(1, 1024, 1) / 2:.3f}·2Ψ.",
        predicted=want,
    )


def checkpointing_memory(ctx: Context) -> Measurement:
    shape = (32, 4096, 1, 4096, 32)  # layers, tokens, microbatch, d, heads
    none = estimate.activation_bytes(*shape)
    full = estimate.activation_bytes(*shape, recompute="full")
    extra = estimate.recompute_overhead("full", 4096, 4096)
    return Measurement(
        none / full,
        "ratio",
        "estimate",
        f"A 7B-shaped model (32 layers, d = 4096), 4096 tokens: {_gb(none)} of "
        f"activations without checkpointing, {_gb(full)} with full checkpointing "
        f"({none / full:.0f}x less), for {extra:.0%} more compute.",
    )


MEASUREMENTS: dict[str, Callable[[Context], Measurement]] = {
    fn.__name__: fn
    for fn in (
        why_distribute,
        tp_weight_share,
        ddp_wire,
        checkpointing_memory,
        fsdp_param_shards,
        tp_traffic,
        pipeline_bubble,
        zero3_traffic_ratio,
        zero_stage_states,
        data_parallel_primary,
        one_f_one_b_in_flight,
        fp16_underflow,
        planned_3d_layout,
        accelerate_prepare,
        offload_bytes,
        gradient_traffic,
        serving_memory,
        rank_processes,
        context_and_expert_parallel,
        embedding_table_sharding,
    )
}
MEASUREMENTS.update(  # chapter 12's cards: FP8, the V, sharded Muon
    {name: (lambda ctx, f=f: Measurement(**f(ctx))) for name, f in FRONTIER.items()}
)
MEASUREMENTS.update(  # chapter 13's: checkpoint interval, DiLoCo, resharding
    {name: (lambda ctx, f=f: Measurement(**f(ctx))) for name, f in RESILIENCE.items()}
)

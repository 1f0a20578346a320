"""The planner: which layouts fit, and what a step costs.

:class:`ClusterSpec` describes the machines, :func:`layout_step_time` splits one
layout's step into compute, communication and bubble, and :func:`plan` prices
every layout of a cluster.

Taught in chapter 09 (planning at scale); chapter 07 (3D parallelism) uses it
too.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.checks import divisors, one_of, positive_int
from dtlab.estimate.activations import RECOMPUTE
from dtlab.estimate.collectives import collective_time
from dtlab.estimate.hardware import GPU, GPUS
from dtlab.estimate.layouts import (
    Parallelism,
    as_parallelism,
    layout_memory,
    layout_traffic,
    sharded_dense_count,
    stage_layers,
    stage_params,
    value_bytes,
)
from dtlab.estimate.models import ModelPreset, model_spec
from dtlab.estimate.pipeline import pipeline_step_time
from dtlab.estimate.states import GB
from dtlab.estimate.techniques import offload_bytes_per_step, recompute_overhead
from dtlab.estimate.tensor_parallel import LINKS, Link, tp_layer_flops, tp_step_time
from dtlab.estimate.training_time import training_flops
from dtlab.estimate.zero import zero_comm_per_step
from dtlab.events import schedule_name


# ---- the planner: which layouts fit, and what a step costs (chapter 09) --------------
@dataclass(frozen=True)
class ClusterSpec:
    """The machines: ``n_gpus`` accelerators, ``gpus_per_node`` per node joined by
    ``intra`` (NVLink), nodes joined by ``inter`` (InfiniBand, Ethernet). A group
    whose ranks all sit in one node talks over ``intra``, any other over ``inter``
    (its slowest link). Ranks are placed Megatron's way: tp fastest, then cp, dp,
    pp, so tp groups are the first to stay inside a node."""

    n_gpus: int
    gpus_per_node: int = 8
    intra: Link = LINKS["nvlink"]
    inter: Link = LINKS["infiniband"]
    # ZeRO-Offload: PCIe 5 x16 to the host (~50 GB/s each way), and the host
    # memory bandwidth a CPU Adam streams its states at
    pcie_Bps: float = 50e9
    host_Bps: float = 100e9

    def __post_init__(self) -> None:
        positive_int("n_gpus", self.n_gpus)
        positive_int("gpus_per_node", self.gpus_per_node)

    def link(self, span: int) -> Link:
        """The link of a group whose ranks span ``span`` consecutive ranks."""
        return self.intra if span <= self.gpus_per_node else self.inter


@dataclass
class PlanRow:
    """One layout the planner considered: its knobs, bytes per device by category,
    the step time split into compute, communication and bubble, and ``why`` it was
    rejected (empty when it fits)."""

    layout: Parallelism
    zero_stage: int
    micro_batch_size: int
    microbatches: int
    schedule: str
    chunks: int
    checkpointing: str
    sequence_parallel: bool
    memory: dict
    traffic: dict
    compute_s: float
    comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    fits: bool
    why: str = ""

    def as_dict(self) -> dict:
        """A flat row for a table (GB and seconds)."""
        par = self.layout
        return {
            "dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep,
            "zero": self.zero_stage, "mbs": self.micro_batch_size,
            "m": self.microbatches, "schedule": self.schedule,
            "checkpointing": self.checkpointing, "sp": self.sequence_parallel,
            **{f"{k}_GB": v / GB for k, v in self.memory.items()},
            "compute_s": self.compute_s, "comm_s": self.comm_s,
            "bubble_s": self.bubble_s, "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "fits": self.fits, "why": self.why,
        }  # fmt: skip


@dataclass
class Plan:
    """What :func:`plan` found: ``fits`` (fastest first) and ``rejected`` (each with
    its ``why``), and the assumptions it used."""

    fits: list
    rejected: list
    assumptions: dict

    @property
    def best(self) -> PlanRow | None:
        return self.fits[0] if self.fits else None

    def table(self, n: int = 10, *, rejected: bool = False) -> list[dict]:
        rows = self.rejected if rejected else self.fits
        return [r.as_dict() for r in rows[:n]]


def _flops_d_ff(spec: ModelPreset) -> float:
    """The ``d_ff`` that makes :func:`tp_layer_flops`' two-matrix MLP count a
    gated MLP's three matrices and a MoE's ``top_k`` experts per token."""
    return spec.d_ff * (1.5 if spec.gated_mlp else 1.0) * spec.top_k


def layout_step_time(
    model,
    layout,
    *,
    gpu: GPU,
    cluster: ClusterSpec,
    zero_stage: int = 0,
    precision: str = "bf16",
    micro_batch_size: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    chunks: int = 1,
    checkpointing: str = "none",
    sequence_parallel: bool = False,
    seq_len: int | None = None,
    mfu: float = 0.5,
    dp_overlap: float = 0.8,
    offload: bool = False,
) -> dict[str, float]:
    """Step time of one layout, split into ``compute_s``, ``comm_s`` (exposed) and
    ``bubble_s``; ``step_s`` is their sum.

    - Compute: :func:`tp_layer_flops` (forward + backward, ``3 × 2·b·s·params``
      plus attention's s² term) for the stage's layers, divided by ``tp·cp``, at
      ``mfu`` of the GPU's peak; the head's ``6·b·s·h·V/tp``; checkpointing adds
      :func:`recompute_overhead` (full: a forward; selective: the score matmuls).
    - Tensor parallelism: the collectives of :func:`tp_step_time`, on the critical
      path; context parallelism's K/V ring and expert parallelism's all-to-alls
      likewise (:func:`collective_time` each); pipeline sends, one per microbatch
      and boundary. Each on the intra-node link if its group fits in a node.
    - The pipeline: :func:`pipeline_step_time` with those per-microbatch times;
      its excess over ``m·(t_f + t_b)`` is the bubble.
    - Data parallelism: :func:`zero_comm_per_step`'s collectives; ``dp_overlap``
      of them hide behind the last backward (chapter 02's overlap), the rest is
      exposed.
    - ``offload`` (ZeRO-Offload, Ren et al. 2021): the fp32 gradient slice goes to
      the host and the weights come back over PCIe
      (:func:`offload_bytes_per_step`), and the CPU's Adam streams master weights,
      moments and gradient (28 bytes per parameter of the slice) at the host's
      memory bandwidth; counted as communication.
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if not 0 <= dp_overlap <= 1:
        raise ValueError(f"dp_overlap must be in [0, 1], got {dp_overlap}")
    s = seq_len or spec.seq_len
    b, m, bpv = micro_batch_size, microbatches, value_bytes(precision)
    h, t = spec.d_model, par.tp
    key = schedule_name(schedule) if par.pp > 1 else "1f1b"
    v = chunks if key == "interleaved" else 1
    rate = gpu.peak_bf16_flops * mfu
    layers = stage_layers(spec.n_layers, par.pp, 0)  # the most loaded stage
    # compute of one microbatch through this stage
    layer_flops = tp_layer_flops(b, s, h, _flops_d_ff(spec)) / (t * par.cp)
    checkpointing = one_of("checkpointing", checkpointing, RECOMPUTE)
    # chapter 08's price of recomputation, a share of the layer's 3F
    recompute = recompute_overhead(checkpointing, s, h) * layer_flops
    flops = layers * (layer_flops + recompute)
    flops += 6 * b * s * h * spec.vocab_size / (t * par.cp) / par.pp  # head, spread
    compute_mb = flops / rate
    # communication on the critical path, per microbatch
    tokens = b * s // par.cp
    comm_mb = 0.0
    if t > 1:
        link = cluster.link(t)
        comm_mb += tp_step_time(
            layers, b, s // par.cp, h, t, link=link, peak_flops=gpu.peak_bf16_flops,
            mfu=mfu, bytes_per_value=bpv, sequence_parallel=sequence_parallel,
        )["comm_s"]  # fmt: skip
    if par.cp > 1:
        link = cluster.link(t * par.cp)
        kv = h * (spec.n_kv_heads or spec.n_heads) / spec.n_heads
        S_kv = 2 * b * s * kv * bpv / t
        comm_mb += (
            layers
            * 3
            * collective_time(
                "all_gather", S_kv, par.cp, link.alpha_s, link.bandwidth_Bps
            )
        )
    if par.ep > 1 and spec.n_experts > 1:
        link = cluster.link(t * par.cp * par.ep)
        S = tokens * spec.top_k * h * bpv
        comm_mb += (
            layers
            * 4
            * collective_time("all_to_all", S, par.ep, link.alpha_s, link.bandwidth_Bps)
        )
    p2p = 0.0
    if par.pp > 1:
        link = cluster.link(t * par.cp * par.dp + 1)  # neighbours one stage apart
        S = tokens * h * bpv / (t if sequence_parallel else 1)
        p2p = 2 * v * (link.alpha_s + S / link.bandwidth_Bps)  # forward + backward
    t_f = (compute_mb + comm_mb) / 3 + p2p / 2
    t_b = 2 * (compute_mb + comm_mb) / 3 + p2p / 2
    if par.pp > 1:
        step = pipeline_step_time(par.pp, m, t_f, t_b, v=v, schedule=key)
    else:
        step = m * (t_f + t_b)
    bubble = step - m * (t_f + t_b)
    # data parallelism: once per step (ZeRO 2-3: reductions per microbatch);
    # expert weights only among the dp·cp/ep ranks that hold the same experts
    group = par.dp * par.cp
    dp_s = 0.0
    sp0 = stage_params(spec, par, 0)
    parts = [(sharded_dense_count(spec, par, sp0, zero_stage), group)]
    if sp0["experts"]:
        parts.append((sp0["layers"] * sp0["experts"], group // par.ep))
    per_mb = m if zero_stage >= 2 else 1
    for psi, n in parts:
        if n == 1:
            continue
        link = cluster.link(t * n)
        ops = zero_comm_per_step(psi, n, zero_stage, bpv)
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            if ops[op]:
                times = per_mb if (op == "reduce_scatter" or zero_stage == 3) else 1
                dp_s += times * collective_time(
                    op, ops[op], n, link.alpha_s, link.bandwidth_Bps
                )
    hidden = min(dp_overlap * dp_s, t_b)
    exposed_dp = dp_s - hidden
    if offload:
        psi = stage_params(spec, par, 0)["total"]
        n_s = group if zero_stage else 1
        pcie = offload_bytes_per_step(psi, n_s, grad_bytes=4, param_bytes=bpv)
        exposed_dp += pcie["total"] / cluster.pcie_Bps
        exposed_dp += 28 * psi / n_s / cluster.host_Bps  # CPU Adam streams 28 B
    compute = m * compute_mb
    comm = m * (comm_mb + p2p) + exposed_dp
    total = step + exposed_dp
    return {
        "compute_s": compute,
        "comm_s": comm,
        "bubble_s": bubble,
        "step_s": total,
        "dp_comm_s": dp_s,
        "dp_exposed_s": exposed_dp,
    }


def _why_not(mem: dict, usable: float, gpu: GPU) -> str:
    """A short reason: how far over, and the biggest category."""
    biggest = max(("params", "grads", "optimizer", "activations"), key=mem.get)
    return (
        f"needs {mem['total'] / GB:.1f} GB per GPU, {usable / GB:.1f} GB usable on "
        f"{gpu.name}; largest: {biggest} {mem[biggest] / GB:.1f} GB"
    )


def plan(
    model,
    *,
    gpu: GPU | str = "H100-80GB",
    cluster: ClusterSpec | None = None,
    n_gpus: int | None = None,
    global_batch: int = 1024,
    seq_len: int | None = None,
    precision: str = "bf16",
    zero_stages=(0, 1, 2, 3),
    micro_batch_sizes=(1, 2, 4),
    checkpointing=("none", "selective", "full"),
    schedules=("1f1b",),
    chunks: int = 2,
    cp_options=(1,),
    ep_options=(1,),
    max_tp: int | None = None,
    sequence_parallel: bool = True,
    mfu: float = 0.5,
    dp_overlap: float = 0.8,
    memory_reserve: float = 0.1,
    offload: bool = False,
) -> Plan:
    """Layouts of ``model`` on ``cluster`` for a ``global_batch`` of sequences that
    fit in ``gpu``'s memory, fastest first, with the rejected ones and why.

    Every combination of tp (a divisor of the heads, at most ``max_tp``, default
    two nodes' worth), pp (at most one stage per layer), cp and ep (from the
    options), dp (the rest of ``n_gpus``), ZeRO stage, microbatch size,
    activation checkpointing and pipeline schedule is priced with
    :func:`layout_memory` (bytes per device by category, most loaded stage) and
    :func:`layout_step_time` (compute, communication, bubble). A layout fits if
    its total stays under ``(1 - memory_reserve)`` of the GPU's memory (the rest
    goes to the CUDA context, allocator fragmentation and communication buffers).
    Microbatches per step ``m = global_batch / (dp · micro_batch)`` must be a
    whole number, and at least pp with a pipeline. ``sequence_parallel`` applies
    whenever tp > 1. ``states="paper"`` accounting (ZeRO §5.1) is used, the
    numbers an interviewer expects.

    The assumptions are returned with the plan (``plan.assumptions``): MFU, the
    links, the overlap of data-parallel communication, the memory reserve.
    """
    spec = model_spec(model)
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"unknown gpu {gpu!r}: expected one of {list(GPUS)}")
        gpu = GPUS[gpu]
    if cluster is None:
        if n_gpus is None:
            raise ValueError("give cluster=ClusterSpec(...) or n_gpus")
        cluster = ClusterSpec(n_gpus)
    elif n_gpus is not None and n_gpus != cluster.n_gpus:
        raise ValueError(f"n_gpus={n_gpus} but the cluster has {cluster.n_gpus}")
    positive_int("global_batch", global_batch)
    if not 0 <= memory_reserve < 1:
        raise ValueError(f"memory_reserve must be in [0, 1), got {memory_reserve}")
    s = seq_len or spec.seq_len
    world = cluster.n_gpus
    usable = gpu.memory_bytes * (1 - memory_reserve)
    max_tp = max_tp or 2 * cluster.gpus_per_node
    fits, rejected = [], []
    for cp in cp_options:
        for tp in divisors(world):
            if tp > max_tp or spec.n_heads % tp or world % (tp * cp):
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > spec.n_layers:
                    continue
                dp = world // (tp * cp * pp)
                for ep in ep_options:
                    if (dp * cp) % ep or (ep > 1 and spec.n_experts % ep):
                        continue
                    par = Parallelism(dp, tp, pp, cp, ep)
                    for row in _price(
                        spec, par, gpu, cluster, global_batch, s, precision,
                        zero_stages, micro_batch_sizes, checkpointing,
                        schedules if pp > 1 else ("1f1b",), chunks,
                        sequence_parallel and tp > 1, mfu, dp_overlap, usable,
                        offload,
                    ):  # fmt: skip
                        (fits if row.fits else rejected).append(row)
    fits.sort(key=lambda r: (r.step_s, r.memory["total"]))
    rejected.sort(key=lambda r: r.memory["total"])
    assumptions = {
        "model": spec.name,
        "params": spec.n_params,
        "gpu": gpu.name,
        "gpu_memory_GB": gpu.memory_bytes / GB,
        "usable_GB": usable / GB,
        "peak_TFLOPs": gpu.peak_bf16_flops / 1e12,
        "mfu": mfu,
        "n_gpus": world,
        "gpus_per_node": cluster.gpus_per_node,
        "intra_GBps": cluster.intra.bandwidth_Bps / GB,
        "inter_GBps": cluster.inter.bandwidth_Bps / GB,
        "global_batch": global_batch,
        "seq_len": s,
        "precision": precision,
        "dp_overlap": dp_overlap,
    }
    return Plan(fits, rejected, assumptions)


def _price(
    spec, par, gpu, cluster, global_batch, s, precision, zero_stages,
    micro_batch_sizes, checkpointing, schedules, chunks, sp, mfu, dp_overlap,
    usable, offload,
):  # fmt: skip
    """Every knob setting of one layout, as PlanRows."""
    for mbs in micro_batch_sizes:
        per_rank = global_batch / (par.dp * mbs)
        if per_rank != int(per_rank) or per_rank < max(1, par.pp):
            continue
        m = int(per_rank)
        for sched in schedules:
            v = chunks if schedule_name(sched) == "interleaved" else 1
            if v > 1 and (m % par.pp or spec.n_layers < par.pp * v):
                continue
            for ck in checkpointing:
                # without replicas there is nothing for ZeRO to shard
                for zero in zero_stages if par.dp * par.cp > 1 else (0,):
                    kw = dict(
                        zero_stage=zero, precision=precision, micro_batch_size=mbs,
                        microbatches=m, schedule=sched, chunks=v, checkpointing=ck,
                        sequence_parallel=sp, seq_len=s,
                    )  # fmt: skip
                    mem = layout_memory(
                        spec, par, **kw, offload=offload,
                        states="dtlab" if offload else "paper",
                    )  # fmt: skip
                    traffic = layout_traffic(
                        spec, par, **{k: kw[k] for k in kw if k != "checkpointing"}
                    )
                    time = layout_step_time(
                        spec, par, gpu=gpu, cluster=cluster, mfu=mfu,
                        dp_overlap=dp_overlap, offload=offload, **kw,
                    )  # fmt: skip
                    fits = mem["total"] <= usable
                    tokens = global_batch * s
                    model_flops = training_flops(spec.n_params, tokens)
                    yield PlanRow(
                        layout=par, zero_stage=zero, micro_batch_size=mbs,
                        microbatches=m, schedule=sched, chunks=v,
                        checkpointing=ck, sequence_parallel=sp, memory=mem,
                        traffic=traffic, compute_s=time["compute_s"],
                        comm_s=time["comm_s"], bubble_s=time["bubble_s"],
                        step_s=time["step_s"],
                        tokens_per_s=tokens / time["step_s"],
                        mfu=model_flops
                        / (par.world_size * gpu.peak_bf16_flops * time["step_s"]),
                        fits=fits, why="" if fits else _why_not(mem, usable, gpu),
                    )  # fmt: skip

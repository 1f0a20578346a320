"""The planner: which layouts fit, and what a step costs.

:func:`plan` prices every layout of a cluster with :func:`layout_memory` and
:func:`layout_step_time` (:mod:`.step_time`, with :class:`ClusterSpec`), and
returns them as :class:`PlanRow` s of a :class:`Plan`.

Taught in chapter 09 (planning at scale); chapter 07 (3D parallelism) uses it
too.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.checks import divisors, positive_int
from dtlab.estimate.hardware import GPU, GPUS
from dtlab.estimate.layouts import Parallelism, layout_memory
from dtlab.estimate.models import model_spec
from dtlab.estimate.states import GB
from dtlab.estimate.step_time import (  # noqa: F401 (re-exported: the planner's names)
    ClusterSpec,
    efficiency_input,
    gpu_link,
    layout_step_time,
)
from dtlab.estimate.traffic import layout_traffic
from dtlab.events import schedule_name


# ---- the planner: which layouts fit, and what a step costs (chapter 09) --------------
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
    mfu: float  # the step's model FLOPs utilisation: an output
    fits: bool
    why: str = ""
    achieved_flops_per_gpu: float = 0.0  # model FLOPs / (GPUs · step time)

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
            "tflops_per_gpu": self.achieved_flops_per_gpu / 1e12,
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
    kernel_efficiency: float | None = None,
    dp_overlap: float = 0.8,
    memory_reserve: float = 0.1,
    offload: bool = False,
    mfu: float | None = None,
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

    Each row's ``mfu`` and ``achieved_flops_per_gpu`` are the step's outputs
    (:func:`layout_step_time`: model FLOPs over the step time, a mixture of
    experts' over its active weights); ``kernel_efficiency`` (old name ``mfu``,
    default 0.5) is the input, the share of peak the matmuls run at.

    The assumptions are returned with the plan (``plan.assumptions``): the kernel
    efficiency, the links (the GPU's NVLink inside a node unless the cluster
    names one), the overlap of data-parallel communication, the memory reserve,
    and the model's shape as counted.
    """
    spec = model_spec(model)
    eff = efficiency_input(kernel_efficiency, mfu)
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
    cluster = cluster.for_gpu(gpu)
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
                        sequence_parallel and tp > 1, eff, dp_overlap, usable,
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
        "kernel_efficiency": eff,
        "n_gpus": world,
        "gpus_per_node": cluster.gpus_per_node,
        "intra_GBps": cluster.intra.bandwidth_Bps / GB,
        "inter_GBps": cluster.inter.bandwidth_Bps / GB,
        "global_batch": global_batch,
        "seq_len": s,
        "shape": {
            k: getattr(spec, k)
            for k in (
                "n_layers",
                "d_model",
                "n_heads",
                "n_kv_heads",
                "d_ff",
                "vocab_size",
                "gated_mlp",
                "tied_embeddings",
                "dropout",
                "n_experts",
                "top_k",
            )
        },
        "active_params": spec.active_params,
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
                        spec, par, gpu=gpu, cluster=cluster,
                        kernel_efficiency=mfu,
                        dp_overlap=dp_overlap, offload=offload, **kw,
                    )  # fmt: skip
                    fits = mem["total"] <= usable
                    tokens = global_batch * s
                    yield PlanRow(
                        layout=par, zero_stage=zero, micro_batch_size=mbs,
                        microbatches=m, schedule=sched, chunks=v,
                        checkpointing=ck, sequence_parallel=sp, memory=mem,
                        traffic=traffic, compute_s=time["compute_s"],
                        comm_s=time["comm_s"], bubble_s=time["bubble_s"],
                        step_s=time["step_s"],
                        tokens_per_s=tokens / time["step_s"], mfu=time["mfu"],
                        fits=fits, why="" if fits else _why_not(mem, usable, gpu),
                        achieved_flops_per_gpu=time["achieved_flops_per_gpu"],
                    )  # fmt: skip

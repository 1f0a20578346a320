"""Step time: what one layout's training step costs, and what it achieves.

:class:`ClusterSpec` describes the machines (each GPU's own NVLink inside a node,
:func:`gpu_link`), and :func:`layout_step_time` splits one layout's step into
compute, communication and bubble, with its MFU and achieved FLOP/s as outputs.

Taught in chapter 09 (planning at scale); chapter 07 (3D parallelism) uses it
too; :func:`dtlab.estimate.plan` prices every layout with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtlab.checks import one_of, positive_int
from dtlab.estimate.collectives import collective_time
from dtlab.estimate.hardware import GPU
from dtlab.estimate.layouts import (
    as_parallelism,
    sharded_dense_count,
    stage_layers,
    stage_params,
    value_bytes,
)
from dtlab.estimate.models import ModelPreset, matmul_params, model_spec
from dtlab.estimate.pipeline import pipeline_step_time
from dtlab.estimate.states import GB
from dtlab.estimate.techniques import offload_bytes_per_step, recompute_time_overhead
from dtlab.estimate.tensor_parallel import LINKS, Link, tp_layer_flops, tp_step_time
from dtlab.estimate.training_time import step_utilisation
from dtlab.estimate.zero import zero_comm_per_step
from dtlab.events import CHECKPOINTING, schedule_name


def gpu_link(gpu: GPU) -> Link:
    """The intra-node link of ``gpu``: its NVLink, half the datasheet's
    both-directions figure each way (A100: NVLink 3, 600 GB/s -> 300 GB/s; H100
    and H200: NVLink 4, 900 GB/s -> 450 GB/s), at NVLink's latency."""
    if gpu.nvlink_Bps <= 0:
        raise ValueError(
            f"{gpu.name} has no NVLink bandwidth: give ClusterSpec(intra=Link(...))"
        )
    bw = gpu.nvlink_Bps / 2
    name = f"NVLink of {gpu.name} ({bw / GB:.0f} GB/s)"
    return Link(name, bw, LINKS["nvlink"].alpha_s)


@dataclass(frozen=True)
class ClusterSpec:
    """The machines: ``n_gpus`` accelerators, ``gpus_per_node`` per node joined by
    ``intra`` (NVLink), nodes joined by ``inter`` (InfiniBand, Ethernet). A group
    whose ranks all sit in one node talks over ``intra``, any other over ``inter``
    (its slowest link). Ranks are placed Megatron's way: tp fastest, then cp, dp,
    pp, so tp groups are the first to stay inside a node.

    ``intra=None`` (the default) means the GPU's own NVLink (:func:`gpu_link`):
    :func:`plan` and :func:`layout_step_time` read it from the GPU they price
    (:meth:`for_gpu`); :meth:`link` without a GPU falls back to
    ``LINKS["nvlink"]``, an H100's."""

    n_gpus: int
    gpus_per_node: int = 8
    intra: Link | None = None
    inter: Link = LINKS["infiniband"]
    # ZeRO-Offload: PCIe 5 x16 to the host (~50 GB/s each way), and the host
    # memory bandwidth a CPU Adam streams its states at
    pcie_Bps: float = 50e9
    host_Bps: float = 100e9

    def __post_init__(self) -> None:
        positive_int("n_gpus", self.n_gpus)
        positive_int("gpus_per_node", self.gpus_per_node)

    def for_gpu(self, gpu: GPU) -> ClusterSpec:
        """This cluster with ``gpu``'s NVLink inside a node, unless ``intra`` was
        given."""
        if self.intra is not None:
            return self
        return dataclasses.replace(self, intra=gpu_link(gpu))

    def link(self, span: int) -> Link:
        """The link of a group whose ranks span ``span`` consecutive ranks."""
        if span <= self.gpus_per_node:
            return self.intra or LINKS["nvlink"]
        return self.inter


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
    kernel_efficiency: float | None = None,
    dp_overlap: float = 0.8,
    offload: bool = False,
    mfu: float | None = None,
    flops: str = "model",
) -> dict[str, float]:
    """Step time of one layout, split into ``compute_s``, ``comm_s`` (exposed) and
    ``bubble_s``; ``step_s`` is their sum. Also what the step achieves:
    ``model_flops`` (:func:`training_flops` of its ``dp·m·b`` sequences),
    ``achieved_flops_per_gpu`` (FLOP/s, the papers' TFLOP/s per GPU) and ``mfu``
    (that over the GPU's peak): outputs, not inputs.

    ``kernel_efficiency`` (default 0.5) is the share of peak the matmul kernels
    run at: an input, which the step's MFU falls below by the communication,
    bubble and recomputation the step adds (Korthikanti's 1T run at 56.3 % MFU
    needs matmuls at about 65 %). ``mfu=`` is its old name, accepted.

    - Compute: the stage's layers' model FLOPs (forward + backward, ``6·b·s·N``
      for the weights a token multiplies by, grouped-query attention's narrower
      k and v and a mixture's ``top_k`` experts included, plus attention's
      ``12·b·s²·h``: :func:`model_flops_per_token`'s count), divided by ``tp·cp``,
      at ``kernel_efficiency`` of the GPU's peak; the head's ``6·b·s·h·V/tp``;
      checkpointing adds :func:`recompute_time_overhead` (full: a forward, 39 %
      of a layer's time at Korthikanti's backward = 1.55 × forward; selective:
      the score matmuls and the memory-bound softmax and dropout passes at the
      GPU's HBM bandwidth). ``flops="megatron"``: chapter 04's textbook layer
      count instead, :func:`tp_layer_flops` with ``8h²`` of attention whatever
      the K/V heads and a gated MLP as a 1.5 × wider ``d_ff`` (what chapter 09's
      exercise asks for). Under cp (ring attention) no score matrix exists:
      selective recomputation costs nothing.
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
    eff = efficiency_input(kernel_efficiency, mfu)
    flops_kind = one_of("flops", flops, ("model", "megatron"))
    cluster = cluster.for_gpu(gpu)
    if not 0 <= dp_overlap <= 1:
        raise ValueError(f"dp_overlap must be in [0, 1], got {dp_overlap}")
    s = seq_len or spec.seq_len
    b, m, bpv = micro_batch_size, microbatches, value_bytes(precision)
    h, t = spec.d_model, par.tp
    key = schedule_name(schedule) if par.pp > 1 else "1f1b"
    v = chunks if key == "interleaved" else 1
    rate = gpu.peak_bf16_flops * eff
    layers = stage_layers(spec.n_layers, par.pp, 0)  # the most loaded stage
    # compute of one microbatch through this stage
    if flops_kind == "megatron":
        layer_flops = tp_layer_flops(b, s, h, _flops_d_ff(spec)) / (t * par.cp)
    else:
        block = matmul_params(spec)["block"]
        layer_flops = (6 * b * s * block + 12 * b * s * s * h) / (t * par.cp)
    checkpointing = one_of("checkpointing", checkpointing, CHECKPOINTING)
    # ring attention keeps no score matrix whatever the mode: selective
    # recomputation has nothing left to drop, and costs nothing more
    mode = "none" if (checkpointing == "selective" and par.cp > 1) else checkpointing
    recompute = recompute_time_overhead(
        mode,
        layer_flops=layer_flops,
        score_values=spec.n_heads * s * s * b / (t * par.cp),
        score_flops=4 * b * s * s * h / (t * par.cp),
        peak_flops=gpu.peak_bf16_flops,
        hbm_Bps=gpu.hbm_Bps,
        kernel_efficiency=eff,
        dropout=spec.dropout,
    )["recompute_s"]
    head = 6 * b * s * h * spec.vocab_size / (t * par.cp) / par.pp  # head, spread
    compute_mb = (layers * layer_flops + head) / rate + layers * recompute
    # communication on the critical path, per microbatch
    tokens = b * s // par.cp
    comm_mb = 0.0
    if t > 1:
        link = cluster.link(t)
        comm_mb += tp_step_time(
            layers, b, s // par.cp, h, t, link=link, peak_flops=gpu.peak_bf16_flops,
            mfu=eff, bytes_per_value=bpv, sequence_parallel=sequence_parallel,
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
    achieved = step_utilisation(
        spec, par.dp * m * b * s, total, par.world_size, gpu.peak_bf16_flops,
        seq_len=s,
    )  # fmt: skip
    return {
        "compute_s": compute,
        "comm_s": comm,
        "bubble_s": bubble,
        "step_s": total,
        "dp_comm_s": dp_s,
        "dp_exposed_s": exposed_dp,
        "recompute_s": m * layers * recompute,
        "kernel_efficiency": eff,
        **achieved,
    }


def efficiency_input(kernel_efficiency: float | None, mfu: float | None) -> float:
    """``kernel_efficiency``, or its old name ``mfu``; 0.5 when neither."""
    if kernel_efficiency is not None and mfu is not None:
        raise ValueError("give kernel_efficiency or its old name mfu, not both")
    name = "mfu" if mfu is not None else "kernel_efficiency"
    value = mfu if mfu is not None else kernel_efficiency
    value = 0.5 if value is None else value
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value}")
    return value

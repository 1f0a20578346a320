"""The analytic model: memory per device, bytes on the wire, time per step and per run.

Taught in chapter 00 (why distribute) and used by every later chapter to put a
prediction next to each measurement; it also answers questions for models far larger
than this machine ("does 70B fit on 8 x 80 GB with ZeRO-3?"). Chapter 09 assembles
the formulas into a planner: :func:`layout_memory` and :func:`layout_traffic` for one
dp x tp x pp (x cp x ep) layout, :func:`layout_step_time` for its step, and
:func:`plan` for every layout of a cluster.

Sources, cited where each formula appears:

- ZeRO: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (SC20). §3: model states of mixed-precision Adam are
  2Ψ + 2Ψ + KΨ bytes with K = 12; §5: what each stage divides by N_d.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", §4 and Table 2.
- Collectives: the ring algorithm's traffic (Patarasuk & Yuan 2009) and nccl-tests'
  bus bandwidth (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests).
- Time: one FLOP count, the matmuls of forward and backward with attention's
  (Narayanan et al. 2021, §5.1; PaLM's 6N + 12·l·h·s, Chowdhery et al. 2022,
  Appendix B), the numerator of model FLOPs utilisation, MFU; Kaplan et al. 2020's
  6·N·D for a bare parameter count (``training_time``).

Units: bytes, seconds, FLOP/s. "GB" in docstrings means 10^9 bytes, as in the ZeRO
paper (7.5B parameters x 16 bytes = 120 GB).

The formulas live in submodules, each importing only from those listed before
it: ``states`` (bytes per parameter, ZeRO's stages, ``GB``), ``activations``
(Korthikanti), ``models`` (parameter counts, presets, ``model_spec``), ``hardware``
(GPUs, memory per device), ``collectives`` (bytes on the wire, the α-β model;
chapter 01), ``training_time`` (model FLOPs, MFU, 6·N·D), ``data_parallel``
(DDP; chapter 02), ``pipeline`` (bubble, schedules; chapter 05),
``tensor_parallel`` (Megatron; chapter 04), ``zero`` (what dtlab.zero holds and
sends; chapter 03),
``context_parallel`` (ring attention and Ulysses; chapter 11), ``moe`` (expert
parallelism's all-to-alls, drops, imbalance; chapter 11), ``layouts``
(the slice and memory of a dp x tp x pp x cp x ep layout; chapter 09),
``traffic`` (its bytes on the wire),
``techniques`` (recomputation, offload; chapter 08), ``serving`` (weights, KV
cache; chapter 09), ``step_time`` (:func:`layout_step_time`, its MFU;
chapter 09) and ``planner`` (:func:`plan`; chapter 09). Every
public name is re-exported here: ``from dtlab.estimate import X`` works whichever
submodule defines X.
"""

# Every public name of the submodules is re-exported, so no import here is unused.
# ruff: noqa: F401

from __future__ import annotations

from dtlab.estimate.activations import (
    activation_bytes,
    activation_bytes_per_layer,
    dropout_mask_bytes,
    dtlab_saved_bytes_outside_layers,
    dtlab_saved_bytes_per_layer,
)
from dtlab.estimate.collectives import (
    COLLECTIVES,
    AlphaBeta,
    bus_bandwidth,
    bus_bandwidth_factor,
    collective_time,
    fit_alpha_beta,
    latency_steps,
    wire_bytes,
)
from dtlab.estimate.context_parallel import (
    cp_activation_bytes_per_layer,
    cp_bytes_per_layer,
    cp_bytes_per_step,
)
from dtlab.estimate.data_parallel import (
    ddp_bucket_assignment,
    ddp_bytes_per_step,
    ddp_overlap,
)
from dtlab.estimate.hardware import (
    GPU,
    GPUS,
    memory_per_device,
)
from dtlab.estimate.layouts import (
    Parallelism,
    as_parallelism,
    layout_memory,
    stage_params,
)
from dtlab.estimate.models import (
    CUSTOM_DEFAULTS,
    CUSTOM_REQUIRED,
    MODELS,
    MOE_MODELS,
    ModelPreset,
    active_params,
    matmul_params,
    model_params,
    model_spec,
)
from dtlab.estimate.moe import (
    COUNT_BYTES,
    dropped_assignments,
    ep_bytes_per_layer,
    ep_imbalance,
    ep_traffic_from_counts,
)
from dtlab.estimate.pipeline import (
    pipeline_bubble_fraction,
    pipeline_bubble_ratio,
    pipeline_in_flight,
    pipeline_step_time,
)
from dtlab.estimate.planner import (
    Plan,
    PlanRow,
    plan,
)
from dtlab.estimate.run import Run
from dtlab.estimate.serving import (
    kv_cache_bytes,
    serving_memory,
)
from dtlab.estimate.states import (
    GB,
    OPTIMIZERS,
    BytesPerParam,
    bytes_per_param,
    largest_model,
    zero_memory_per_device,
)
from dtlab.estimate.step_time import (
    ClusterSpec,
    gpu_link,
    layout_step_time,
)
from dtlab.estimate.techniques import (
    BACKWARD_RATIO,
    offload_bytes_per_step,
    recompute_overhead,
    recompute_time_overhead,
)
from dtlab.estimate.tensor_parallel import (
    LINKS,
    Link,
    tp_bytes_per_layer,
    tp_collectives_per_layer,
    tp_layer_flops,
    tp_params_per_rank,
    tp_step_time,
)
from dtlab.estimate.traffic import layout_traffic
from dtlab.estimate.training_time import (
    hardware_flops,
    model_flops_per_token,
    step_utilisation,
    train_time,
    training_flops,
)
from dtlab.estimate.zero import (
    hsdp_comm_per_step,
    hsdp_states_per_rank,
    zero_comm_per_step,
    zero_states_conventions,
    zero_states_per_rank,
)
from dtlab.events import STATE_PRECISIONS  # the storage regimes the states count

__all__ = [
    "Run",
    "STATE_PRECISIONS",
    "BytesPerParam",
    "bytes_per_param",
    "zero_memory_per_device",
    "largest_model",
    "zero_states_conventions",
    "activation_bytes_per_layer",
    "activation_bytes",
    "dtlab_saved_bytes_per_layer",
    "dtlab_saved_bytes_outside_layers",
    "dropout_mask_bytes",
    "model_params",
    "ModelPreset",
    "MODELS",
    "GPU",
    "GPUS",
    "memory_per_device",
    "COLLECTIVES",
    "wire_bytes",
    "latency_steps",
    "bus_bandwidth_factor",
    "bus_bandwidth",
    "collective_time",
    "AlphaBeta",
    "fit_alpha_beta",
    "training_flops",
    "train_time",
    "model_flops_per_token",
    "hardware_flops",
    "step_utilisation",
    "active_params",
    "matmul_params",
    "CUSTOM_DEFAULTS",
    "CUSTOM_REQUIRED",
    "GB",
    "ddp_bytes_per_step",
    "ddp_bucket_assignment",
    "ddp_overlap",
    "pipeline_bubble_fraction",
    "pipeline_bubble_ratio",
    "pipeline_step_time",
    "pipeline_in_flight",
    "Link",
    "tp_collectives_per_layer",
    "tp_bytes_per_layer",
    "tp_layer_flops",
    "tp_step_time",
    "tp_params_per_rank",
    "zero_states_per_rank",
    "zero_comm_per_step",
    "hsdp_states_per_rank",
    "hsdp_comm_per_step",
    "OPTIMIZERS",
    "LINKS",
    "MOE_MODELS",
    "Parallelism",
    "as_parallelism",
    "model_spec",
    "stage_params",
    "layout_memory",
    "layout_traffic",
    "kv_cache_bytes",
    "serving_memory",
    "ClusterSpec",
    "PlanRow",
    "Plan",
    "layout_step_time",
    "gpu_link",
    "recompute_time_overhead",
    "BACKWARD_RATIO",
    "plan",
    "cp_bytes_per_layer",
    "cp_bytes_per_step",
    "cp_activation_bytes_per_layer",
    "COUNT_BYTES",
    "ep_bytes_per_layer",
    "ep_traffic_from_counts",
    "ep_imbalance",
    "dropped_assignments",
]

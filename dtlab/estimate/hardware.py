"""GPUs: datasheet numbers, and the memory per device of a data-parallel job.

:data:`GPUS` holds the accelerators; :func:`memory_per_device` adds ZeRO's model
states and Korthikanti's activations for a preset.

Taught in chapter 00 (why distribute); chapters 03, 06, 07 and 09 reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.estimate.activations import activation_bytes
from dtlab.estimate.models import MODELS, ModelPreset
from dtlab.estimate.states import GB, zero_memory_per_device
from dtlab.events import state_precision


# ---- GPUs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """Datasheet numbers of one accelerator (dense, no sparsity).

    ``memory_bytes`` is the marketed capacity in 10^9 bytes; a few GB of it go to the
    CUDA context and allocator fragmentation in practice. ``nvlink_Bps`` is the
    datasheet's NVLink figure, both directions together (A100: NVLink 3, 600 GB/s;
    H100, H200: NVLink 4, 900 GB/s); the planner sends half of it each way
    (:func:`dtlab.estimate.gpu_link`).
    """

    name: str
    memory_bytes: float
    peak_bf16_flops: float
    hbm_Bps: float
    nvlink_Bps: float


GPUS: dict[str, GPU] = {
    "A100-40GB": GPU("A100 40GB SXM", 40 * GB, 312e12, 1.555e12, 600e9),
    "A100-80GB": GPU("A100 80GB SXM", 80 * GB, 312e12, 2.039e12, 600e9),
    "H100-80GB": GPU("H100 80GB SXM", 80 * GB, 989e12, 3.35e12, 900e9),
    "H200-141GB": GPU("H200 141GB SXM", 141 * GB, 989e12, 4.8e12, 900e9),
}


def memory_per_device(
    model: ModelPreset | str,
    *,
    world_size: int = 1,
    stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
    micro_batch: int = 1,
    seq_len: int | None = None,
    recompute: str = "none",
) -> dict[str, float]:
    """Model states (ZeRO, :func:`zero_memory_per_device`) plus activations
    (Korthikanti, :func:`activation_bytes`) per device of a data-parallel job.

    Activations are not sharded by ZeRO: every rank keeps those of its own microbatch.
    They are 2 bytes per value except under ``precision="fp32"`` (4).
    Returns ``{"params", "grads", "optimizer", "activations", "total"}`` in bytes.
    """
    preset = MODELS[model] if isinstance(model, str) else model
    states = zero_memory_per_device(
        preset.n_params, world_size, stage, precision, optimizer
    )
    fp32 = state_precision(precision) == "fp32"
    acts = activation_bytes(
        preset.n_layers,
        seq_len or preset.seq_len,
        micro_batch,
        preset.d_model,
        preset.n_heads,
        recompute=recompute,
        bytes_per_value=4 if fp32 else 2,
    )
    out = {k: states[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = acts
    out["total"] = states["total"] + acts
    return out

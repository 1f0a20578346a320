"""Model states: bytes per parameter, and how ZeRO divides them.

The weight, its gradient and the optimizer's share under each precision policy
(ZeRO §3), and what each ZeRO stage divides by the data-parallel degree (§5.1).
Also home of :data:`GB`, the ZeRO paper's gigabyte, and of the precision and
optimizer names the other modules check against.

Taught in chapter 00 (why distribute) and chapter 03 (ZeRO); chapter 06 (mixed
precision) compares the precision policies.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.checks import one_of, positive_int
from dtlab.events import state_precision

GB = 1e9  # the ZeRO paper's gigabyte

OPTIMIZERS = ("adam", "sgd_momentum", "sgd")
_OPTIMIZER_ALIASES = {"adamw": "adam", "sgd-momentum": "sgd_momentum"}


# ---- model states: bytes per parameter -----------------------------------------------
@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs in model states: the weight, its gradient, and the
    optimizer's share. In the ZeRO paper's notation the model states of Ψ parameters
    take ``(params + grads + K) * Ψ`` bytes, where ``K = optimizer``."""

    params: float
    grads: float
    optimizer: float

    @property
    def K(self) -> float:
        """The ZeRO paper's K: optimizer-state bytes per parameter (12 for mixed
        precision Adam: fp32 master weight, momentum and variance)."""
        return self.optimizer

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def bytes_per_param(precision: str = "mixed", optimizer: str = "adam") -> BytesPerParam:
    """Model-state bytes per parameter for a precision policy and an optimizer.

    ``precision``:

    - ``"fp32"``: weights, gradients and optimizer states in fp32. This is also what
      ``torch.autocast`` keeps in memory: it casts on the fly, the stored parameters
      and their gradients stay fp32.
    - ``"mixed"`` (ZeRO §3, Micikevicius et al. 2018), which is what a ``"bf16"`` or
      ``"fp16"`` run keeps: fp16/bf16 weights and gradients (2 + 2 bytes), and the
      optimizer keeps an fp32 *master copy* of the weights (4 bytes) besides its own
      states.
    - ``"pure_bf16"``: everything in bf16, no master copy (cheapest, but small
      updates can vanish in bf16's 8-bit mantissa).

    The names are :func:`dtlab.events.state_precision`'s: a run's precision
    (``fp32``, ``bf16``, ``fp16``) or a storage regime.

    ``optimizer``: ``"adam"`` (or ``"adamw"``; momentum + variance), ``"sgd_momentum"``
    (one buffer), ``"sgd"`` (none).

    ========= ======== ============= ======
    policy    adam     sgd_momentum  sgd
    ========= ======== ============= ======
    fp32      4+4+8=16 4+4+4=12      4+4+0=8
    mixed     2+2+12   2+2+8         2+2+4
    pure_bf16 2+2+4    2+2+2         2+2+0
    ========= ======== ============= ======
    """
    precision = state_precision(precision)
    optimizer = one_of("optimizer", optimizer, OPTIMIZERS, _OPTIMIZER_ALIASES)
    n_states = {"adam": 2, "sgd_momentum": 1, "sgd": 0}[optimizer]
    if precision == "fp32":
        return BytesPerParam(4, 4, 4 * n_states)
    if precision == "mixed":
        # the fp32 master copy (4) lives with the optimizer, states are fp32 too
        return BytesPerParam(2, 2, 4 + 4 * n_states)
    return BytesPerParam(2, 2, 2 * n_states)


def zero_memory_per_device(
    n_params: float,
    world_size: int,
    stage: int,
    precision: str = "mixed",
    optimizer: str = "adam",
) -> dict[str, float]:
    """Model-state bytes per data-parallel device under ZeRO ``stage`` (ZeRO §5.1).

    With Ψ parameters, N = ``world_size`` data-parallel devices and the bytes per
    parameter of :func:`bytes_per_param` (mixed-precision Adam: 2, 2, K = 12):

    - stage 0 (plain DP): ``2Ψ + 2Ψ + KΨ``              (everything replicated)
    - stage 1 (P_os):     ``2Ψ + 2Ψ + KΨ/N``            (optimizer states sharded)
    - stage 2 (P_os+g):   ``2Ψ + (2 + K)Ψ/N``           (+ gradients sharded)
    - stage 3 (P_os+g+p): ``(2 + 2 + K)Ψ/N``            (+ parameters sharded)

    Returns ``{"params", "grads", "optimizer", "total"}`` in bytes. Transient
    buffers (a gathered layer under stage 3, communication buckets) are not included.
    The paper's Figure 1 example: Ψ = 7.5B, N = 64 gives 120, 31.4, 16.6, 1.9 GB.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    positive_int("world_size", world_size)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage!r}: expected 0, 1, 2 or 3")
    b = bytes_per_param(precision, optimizer)
    n = world_size
    params = b.params * n_params / (n if stage >= 3 else 1)
    grads = b.grads * n_params / (n if stage >= 2 else 1)
    opt = b.optimizer * n_params / (n if stage >= 1 else 1)
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "total": params + grads + opt,
    }


def largest_model(
    memory_bytes: float,
    world_size: int,
    stage: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    model_parallel: int = 1,
) -> float:
    """The inverse question: the most parameters whose model states fit in
    ``memory_bytes`` per device under ZeRO ``stage`` over ``world_size``
    data-parallel devices, the model split ``model_parallel`` ways besides
    (:func:`zero_memory_per_device` solved for Ψ; activations and buffers left
    out, as the ZeRO paper's Table 2 leaves them). Mixed-precision Adam on a
    32 GB V100, 64 devices: 2B (DDP), 7.6B, 14.4B, 128B for stages 0-3."""
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
    positive_int("model_parallel", model_parallel)
    per_param = zero_memory_per_device(1.0, world_size, stage, precision, optimizer)
    return model_parallel * memory_bytes / per_param["total"]

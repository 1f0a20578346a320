"""Memory techniques: the price of recomputation and of offload.

The extra compute of activation checkpointing and the host <-> device bytes of
ZeRO-Offload.

Taught in chapter 08 (memory techniques).
"""

from __future__ import annotations

from dtlab.checks import one_of
from dtlab.estimate.activations import RECOMPUTE


# ---- memory techniques (chapter 08): the price of recomputation and offload --------
def recompute_overhead(
    mode: str, seq_len: int, d_model: int, *, early_stop: bool = False
) -> float:
    """Extra compute of activation checkpointing, as a fraction of a training step
    without it (Korthikanti et al. 2022, §4 and §5.3), in matmul FLOPs.

    A layer's forward costs ``F = 24·b·s·h² + 4·b·s²·h`` FLOPs (the linear layers,
    then ``QK^T`` and ``softmax·V``) and its backward ``2F``: a step is ``3F``.
    ``"full"`` runs the forward once more: ``F / 3F = 1/3``. ``"selective"`` re-runs
    ``QK^T`` and ``softmax·V``: ``4bs²h / 3F = s / (18h + 3s)``, a few per cent at
    ``s ≈ h``.

    ``early_stop=True`` counts what :func:`torch.utils.checkpoint.checkpoint` really
    re-runs: it stops once every tensor backward needs is rebuilt, so the last matmul
    of the checkpointed piece, whose output nobody saved, is skipped (``mlp.proj``,
    ``8bsh²``, under full; ``softmax·V``, ``2bs²h``, under selective). The
    embeddings, head and loss are left out (never recomputed). Softmax and masking
    are not FLOPs here; where they are memory-bound, selective recomputation costs
    more time than this share.
    """
    mode = one_of("recompute mode", mode, RECOMPUTE)
    if seq_len <= 0 or d_model <= 0:
        raise ValueError(f"seq_len and d_model must be positive: {seq_len}, {d_model}")
    s, h = seq_len, d_model
    forward = 24 * h + 4 * s  # F / (b·s·h)
    if mode == "full":
        extra = forward - (8 * h if early_stop else 0)
    elif mode == "selective":
        extra = 2 * s if early_stop else 4 * s
    else:
        extra = 0
    return extra / (3 * forward)


def offload_bytes_per_step(
    n_params: float, dp: int, *, grad_bytes: int = 4, param_bytes: int = 4
) -> dict[str, float]:
    """Host <-> device (PCIe) bytes one rank moves per optimizer step under ZeRO
    with CPU offload (ZeRO-Offload, Ren et al. 2021, §4.1): its ``1/dp`` slice of
    the gradients goes to the host, where the optimizer steps the fp32 master slice,
    and the updated slice of the weights comes back.

    ``{"to_host": Ψ/dp·grad_bytes, "to_device": Ψ/dp·param_bytes, "total": ...}``
    (use 2 for 16-bit gradients or weights). Divide by the link's bandwidth
    (PCIe 4.0 x16 ≈ 25 GB/s one way, 5.0 ≈ 50 GB/s) for the time it adds where the
    copies do not overlap with compute.
    """
    if n_params <= 0:
        raise ValueError(f"n_params must be positive, got {n_params}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if grad_bytes <= 0 or param_bytes <= 0:
        raise ValueError("grad_bytes and param_bytes must be positive")
    to_host = n_params / dp * grad_bytes
    to_device = n_params / dp * param_bytes
    return {"to_host": to_host, "to_device": to_device, "total": to_host + to_device}

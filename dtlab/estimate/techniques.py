"""Memory techniques: the price of recomputation and of offload.

The extra compute of activation checkpointing and the host <-> device bytes of
ZeRO-Offload.

Taught in chapter 08 (memory techniques).
"""

from __future__ import annotations

from dtlab.checks import one_of
from dtlab.events import CHECKPOINTING


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
    more time than this share. The time a step pays (the planner's price, checked
    against Korthikanti's Table 4) is :func:`recompute_time_overhead`'s.
    """
    mode = one_of("recompute mode", mode, CHECKPOINTING)
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


# Korthikanti et al. 2022, Table 4 (a 22B layer on A100s, tp 8): forward 7.7 ms,
# backward 11.9 ms. Backward runs twice forward's matmul FLOPs in 1.55x its time
# (its weight-gradient GEMMs are larger and run closer to peak), so re-running a
# forward costs 7.7 / 19.6 = 39 % of a step, not the FLOPs' 1/3.
BACKWARD_RATIO = 11.9 / 7.7
MEMORY_EFFICIENCY = 0.7  # share of HBM bandwidth an elementwise kernel streams at


def recompute_time_overhead(
    mode: str,
    *,
    layer_flops: float,
    score_values: float,
    score_flops: float,
    peak_flops: float,
    hbm_Bps: float,
    kernel_efficiency: float = 0.5,
    dropout: bool = True,
    backward_ratio: float = BACKWARD_RATIO,
    memory_efficiency: float = MEMORY_EFFICIENCY,
) -> dict[str, float]:
    """Time recomputation adds to one layer's training step, and its share.

    Stated model, per layer and microbatch on one rank: ``layer_flops`` (forward
    + backward matmul FLOPs) run at ``kernel_efficiency`` of ``peak_flops``; that
    is the step without recomputation, ``t``. Backward takes ``backward_ratio``
    times forward's time (default Korthikanti's measured 1.55; the FLOPs'
    2 gives 1/3):

    - ``"full"`` re-runs the forward: ``t / (1 + backward_ratio)``, 39 % of the
      step at 1.55 (Korthikanti's Table 4: +39 %);
    - ``"selective"`` re-runs the attention core: its matmuls, ``score_flops``
      (``QKᵀ`` and ``softmax·V``, 4·b·s²·h/t), at ``kernel_efficiency``, and the
      memory-bound passes over the ``score_values`` (a·s²·b/t) it rebuilds, at
      ``memory_efficiency`` of ``hbm_Bps``: softmax reads and writes 2 bytes a
      value (4), dropout reads 2, writes 2 and a 1-byte mask (5, when
      ``dropout``). FLOPs alone say +2 % for the 22B layer; the passes make it
      +6 % (Korthikanti's Table 4: +7 %).

    Returns ``{"step_s": t, "recompute_s", "overhead": recompute_s / t}``."""
    mode = one_of("recompute mode", mode, CHECKPOINTING)
    if peak_flops <= 0 or not 0 < kernel_efficiency <= 1:
        raise ValueError("peak_flops must be positive, kernel_efficiency in (0, 1]")
    if backward_ratio <= 0:
        raise ValueError(f"backward_ratio must be positive, got {backward_ratio}")
    rate = peak_flops * kernel_efficiency
    step = layer_flops / rate
    if mode == "full":
        extra = step / (1 + backward_ratio)
    elif mode == "selective":
        passes = (4 + (5 if dropout else 0)) * score_values
        memory = passes / (hbm_Bps * memory_efficiency) if hbm_Bps > 0 else 0.0
        extra = score_flops / rate + memory
    else:
        extra = 0.0
    return {"step_s": step, "recompute_s": extra, "overhead": extra / step}

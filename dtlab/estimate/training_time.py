"""Time to train: the 6·N·D FLOPs rule and a run's duration at a given MFU.

Taught in chapter 00 (why distribute); chapter 09's planner reports MFU with
:func:`training_flops`.
"""

from __future__ import annotations


# ---- time to train -------------------------------------------------------------------
def training_flops(n_params: float, tokens: float) -> float:
    """``6·N·D``: forward (2 FLOPs per parameter per token) plus backward (4)
    (Kaplan et al. 2020, §2.1); attention's s² term and recomputation are left out."""
    if n_params < 0 or tokens < 0:
        raise ValueError("n_params and tokens must be >= 0")
    return 6.0 * n_params * tokens


def train_time(
    n_params: float, tokens: float, n_gpus: int, peak_flops: float, mfu: float
) -> float:
    """Seconds to train on ``tokens`` tokens: ``6·N·D / (n_gpus · peak · MFU)``.

    MFU, model FLOPs utilisation, is the share of peak the job really sustains
    (Chowdhery et al. 2022): 35-55 % is typical of large dense runs.
    Example: 70B parameters, 2T tokens, 1024 H100s at 40 % -> about 24 days.
    """
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return training_flops(n_params, tokens) / (n_gpus * peak_flops * mfu)

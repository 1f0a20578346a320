"""The mistakes learners make in chapter 00's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises_ch00.py`` proves
it)."""

from __future__ import annotations

from dtlab.exercises import ch00_memory  # noqa: F401 - declares the exercises
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- zero2_bytes ---------------------------------------------------------------------
@mistake("zero2_bytes", expect="that is ZeRO-3")
def shards_the_weights_too(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """Divides everything by N: ZeRO-3's formula, not stage 2's."""
    return (bytes_param + bytes_grad + K) * n_params / n_gpus


@mistake("zero2_bytes", expect="that is ZeRO-1")
def keeps_the_full_gradients(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """Shards only the optimizer states: ZeRO-1's formula."""
    return (bytes_param + bytes_grad) * n_params + K * n_params / n_gpus


@mistake("zero2_bytes", expect="use the K argument")
def hard_codes_adams_k(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """Writes 12 for K: right for mixed-precision Adam only."""
    return bytes_param * n_params + (bytes_grad + 12) * n_params / n_gpus


@mistake("zero2_bytes", expect="grows with N")
def multiplies_by_n(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """Multiplies the sharded part by N instead of dividing."""
    return bytes_param * n_params + (bytes_grad + K) * n_params * n_gpus


@mistake("zero2_bytes", expect="are swapped")
def swaps_weight_and_gradient_bytes(
    n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12
):
    """Replicates the gradient's bytes and shards the weight's: right only when the
    two have the same width."""
    return bytes_grad * n_params + (bytes_param + K) * n_params / n_gpus


# ---- min_gpus ------------------------------------------------------------------------
def _states(n_params, n, stage, precision, optimizer):
    from dtlab import estimate as est

    return est.zero_memory_per_device(n_params, n, stage, precision, optimizer)["total"]


@mistake("min_gpus", expect="Return None")
def returns_max_gpus_when_nothing_fits(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Doubles until the budget runs out and returns the last number tried."""
    n = 1
    while n < max_gpus and _states(n_params, n, stage, precision, optimizer) > (
        gpu_bytes
    ):
        n *= 2
    return n


@mistake("min_gpus", expect="not a power of two")
def counts_one_gpu_at_a_time(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Adds one GPU at a time: the smallest integer, not the smallest power of two."""
    from dtlab import estimate as est

    b = est.bytes_per_param(precision, optimizer)
    replicated = {0: b.total, 1: b.params + b.grads, 2: b.params, 3: 0}[stage]
    room = gpu_bytes - replicated * n_params
    if room <= 0:
        return None
    n = max(1, -(-(b.total - replicated) * n_params // room))
    return int(n) if n <= max_gpus else None


@mistake("min_gpus", expect="Check the precision, optimizer and stage")
def ignores_the_precision_and_optimizer(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Always prices mixed-precision Adam, whatever it was asked."""
    n = 1
    while n <= max_gpus:
        if _states(n_params, n, stage, "mixed", "adam") <= gpu_bytes:
            return n
        n *= 2
    return None


@mistake("min_gpus", expect="already suffice")
def returns_the_first_power_past_the_fit(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Tests the fit after doubling, so it reports twice the fewest GPUs."""
    n = 1
    while n <= max_gpus:
        n *= 2
        if _states(n_params, n // 2, stage, precision, optimizer) <= gpu_bytes:
            return n
    return None


@mistake("min_gpus", expect="but the model states fit on")
def treats_stage_3_like_stage_2(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Keeps the weights replicated at stage 3 too, so 70B never fits."""
    n = 1
    while n <= max_gpus:
        if _states(n_params, n, min(stage, 2), precision, optimizer) <= gpu_bytes:
            return n
        n *= 2
    return None

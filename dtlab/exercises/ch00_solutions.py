"""Chapter 00's reference solutions: the model-state bytes one GPU holds under
ZeRO stage 2, and the fewest GPUs on which a model's states fit (Rajbhandari et al.
2020, "ZeRO", §3 and §5). ``dtlab.exercises.solution(name)`` shows each;
:mod:`.ch00_memory` checks a learner's against :mod:`dtlab.estimate`."""

from __future__ import annotations

__all__ = ["zero2_bytes_per_device", "min_gpus"]


def zero2_bytes_per_device(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """Model-state bytes on one of ``n_gpus`` data-parallel GPUs under ZeRO-2, for
    ``n_params`` parameters of ``bytes_param`` bytes of weight, ``bytes_grad`` of
    gradient and ``K`` of optimizer state each: ``bytes_param·Ψ + (bytes_grad +
    K)·Ψ/N`` (ZeRO §5.2, P_os+g)."""
    # every rank needs the full weights for its own forward and backward ...
    replicated = bytes_param * n_params
    # ... but owns only 1/N of the gradients and of the optimizer states
    sharded = (bytes_grad + K) * n_params / n_gpus
    return replicated + sharded


def min_gpus(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """The fewest data-parallel GPUs, a power of two no larger than ``max_gpus``, on
    which the model states of ``n_params`` parameters fit in ``gpu_bytes`` each
    under ZeRO ``stage`` (activations left out); ``None`` if no such number. What a
    stage replicates does not shrink with N: if it alone does not fit, more GPUs
    cannot help."""
    from dtlab import estimate as est

    b = est.bytes_per_param(precision, optimizer)
    # bytes per parameter that stay on every rank, whatever N is
    replicated = {0: b.total, 1: b.params + b.grads, 2: b.params, 3: 0}[stage]
    room = gpu_bytes - replicated * n_params  # what is left for the shards
    sharded = (b.total - replicated) * n_params
    if room < 0 or (room == 0 and sharded > 0):
        return None  # the replicated part alone does not fit
    n = 1
    while sharded / n > room and n <= max_gpus:
        n *= 2
    return n if n <= max_gpus else None

"""Data parallelism: DDP's bytes per step, its buckets, and their overlap.

The bytes DDP all-reduces per optimizer step, PyTorch DDP's bucketing rule, and
a model of how the bucket all-reduces overlap the backward pass.

Taught in chapter 02 (data parallel).
"""

from __future__ import annotations

from dtlab.estimate.collectives import collective_time, wire_bytes


# ---- data parallelism: DDP bytes, buckets and overlap (chapter 02) -------------------
def ddp_bytes_per_step(n_params: float, n: int, bytes_per_grad: float = 4) -> float:
    """Bytes each rank sends per optimizer step under DDP: one ring all-reduce of all
    Ψ gradients, ``2(N-1)/N · Ψ · bytes_per_grad``.

    This is the ZeRO paper's "data parallelism moves 2Ψ per step" (Rajbhandari et al.
    2020, §7.1): a reduce-scatter (Ψ) and an all-gather (Ψ), each scaled by (N-1)/N.
    Bucketing changes how many calls carry it, not the total. Gradient accumulation
    divides it per microbatch: ``no_sync`` skips the all-reduce on all but the last.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if bytes_per_grad <= 0:
        raise ValueError(f"bytes_per_grad must be positive, got {bytes_per_grad}")
    return wire_bytes("all_reduce", n_params * bytes_per_grad, n)


def ddp_bucket_assignment(sizes_bytes, cap_bytes: float) -> list[list[int]]:
    """PyTorch DDP's bucketing rule: walk the tensors in the order given, put each
    into the open bucket, and close the bucket as soon as it holds ``cap_bytes`` or
    more (so a bucket may overshoot the cap by its last tensor, and one tensor larger
    than the cap gets a bucket of its own). Returns lists of indices into
    ``sizes_bytes``.

    DDP passes its parameters in *reverse* registration order, the order in which
    backward usually produces their gradients, so the first bucket fills first.
    """
    if not cap_bytes > 0:
        raise ValueError(
            f"cap_bytes must be positive, got {cap_bytes}: a bucket needs room for at "
            "least one tensor"
        )
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0.0
    for i, size in enumerate(sizes_bytes):
        if size < 0:
            raise ValueError(f"tensor {i} has a negative size ({size} bytes)")
        current.append(i)
        filled += size
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0.0
    if current:
        buckets.append(current)
    return buckets


def ddp_overlap(
    bucket_bytes,
    n: int,
    backward_s: float,
    alpha_s: float,
    bandwidth_Bps: float,
) -> dict:
    """A model of DDP's overlap of gradient all-reduces with the backward pass.

    Assumptions: backward produces gradient bytes at a steady rate, so bucket i is
    ready at ``backward_s`` times the share of bytes in buckets 0..i; the all-reduces
    run one after another on one channel, each taking the α-β time of
    :func:`collective_time`; bucket i starts when it is ready and its predecessor is
    done (DDP launches buckets in order). What the step waits for after backward is
    the *exposed* communication::

        start_i = max(ready_i, end_{i-1}),  end_i = start_i + t_allreduce(bytes_i)
        exposed = max(0, end_last - backward_s)

    Few large buckets start late (the last one waits for the end of backward); many
    small ones pay the latency α each time: the bucket size trades one for the other.
    Returns ``{"calls", "ready", "start", "end", "comm_s", "exposed_s", "overlap"}``
    where ``overlap`` is the hidden share of communication time (1 = all hidden).
    """
    sizes = [float(b) for b in bucket_bytes]
    if backward_s < 0:
        raise ValueError(f"backward_s must be >= 0, got {backward_s}")
    if any(s < 0 for s in sizes):
        raise ValueError("bucket sizes must be >= 0 bytes")
    total = sum(sizes)
    ready, start, end = [], [], []
    filled, free_at = 0.0, 0.0
    for size in sizes:
        filled += size
        t_ready = backward_s * (filled / total if total else 1.0)
        t_start = max(t_ready, free_at)
        t_comm = collective_time("all_reduce", size, n, alpha_s, bandwidth_Bps)
        free_at = t_start + t_comm
        ready.append(t_ready)
        start.append(t_start)
        end.append(free_at)
    comm_s = sum(e - s for s, e in zip(start, end))
    exposed = max(0.0, (end[-1] if end else 0.0) - backward_s)
    return {
        "calls": len(sizes),
        "ready": ready,
        "start": start,
        "end": end,
        "comm_s": comm_s,
        "exposed_s": exposed,
        "overlap": 1.0 - exposed / comm_s if comm_s > 0 else 1.0,
    }

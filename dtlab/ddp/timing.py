"""What one DDP synchronization cost: how long buckets were in flight, how much of
that backward hid (the *overlap*), and the telemetry events chapter 02 plots (one
``ddp_bucket`` event per bucket, the ``B`` span of backward, the ``idle`` span of
waiting for the last buckets)."""

from __future__ import annotations

from dtlab import telemetry
from dtlab.events import Kind, Span, wire_bytes

__all__ = ["sync_summary", "emit_backward_span", "emit_sync"]


def sync_summary(pending, t_bwd_start, t_bwd_end, t_synced, payload, wire) -> dict:
    """Seconds and bytes of one synchronization. ``comm_s`` is the time at least one
    bucket was in flight; ``exposed_s`` the part of it after backward ended (what the
    step waited for); ``overlap`` the hidden share."""
    spans = sorted((e["t_launch"], e["t_done"]) for e in pending)
    busy, cursor = 0.0, float("-inf")
    for start, end in spans:  # length of the union of the intervals
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    exposed = max(0.0, t_synced - t_bwd_end)
    return {
        "buckets": len(pending),
        "payload_bytes": payload,
        "wire_bytes": wire,
        "backward_s": t_bwd_end - t_bwd_start,
        "comm_s": busy,
        "exposed_s": exposed,
        "overlap": max(0.0, 1.0 - exposed / busy) if busy > 0 else 1.0,
    }


def _shift(rec) -> float:
    """From DDP's perf-counter stamps to the recorder's time axis."""
    return rec.now() - telemetry.clock()


def emit_backward_span(rec, microbatch: int, t_start: float, t_end: float) -> None:
    shift = _shift(rec)
    rec.emit(
        Kind.SPAN,
        name=Span.B,
        stage=0,
        microbatch=microbatch,
        t_start=t_start + shift,
        t_end=t_end + shift,
    )


def emit_sync(rec, pending, world_size: int, t_bwd_end: float, t_synced: float):
    """One ``ddp_bucket`` event per bucket, then the ``idle`` span after backward."""
    shift = _shift(rec)
    for entry in pending:
        b = entry["bucket"]
        rec.emit(
            Kind.DDP_BUCKET,
            bucket=b.index,
            numel=b.numel,
            payload_bytes=b.nbytes,
            wire_bytes=wire_bytes("all_reduce", b.nbytes, world_size),
            t_start=entry["t_launch"] + shift,
            t_end=entry["t_done"] + shift,
            t_waited=entry["t_waited"] + shift,
        )
    rec.emit(
        Kind.SPAN,
        name=Span.IDLE,
        stage=0,
        microbatch=None,
        reason="ddp: waiting for gradient buckets",
        t_start=t_bwd_end + shift,
        t_end=t_synced + shift,
    )

"""Collectives: bytes on the wire, bus bandwidth and the α-β time model.

What each rank sends in a ring collective, nccl-tests' bus bandwidth, the
latency-bandwidth time of one op, and a least-squares fit of α and β.

Taught in chapter 01 (collectives); every later chapter counts its traffic with
:func:`wire_bytes` (:func:`dtlab.events.wire_bytes`, the one definition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# bytes on the wire: defined in dtlab.events, beside the comm events that record
# them (dtlab.comm needs the formula without importing the estimates); the
# estimates' own names for them
from dtlab.events import COLLECTIVES, wire_bytes  # noqa: F401
from dtlab.events import check_collective as _check_collective


def latency_steps(op: str, n: int) -> int:
    """Sequential message steps of the ring algorithm, the count the α term pays:
    all_reduce ``2(N-1)``; reduce_scatter, all_gather, all_to_all, broadcast, reduce
    (pipelined) and barrier (a ring of empty messages) ``N-1``; send/recv ``1``."""
    _check_collective(op, 0, n)
    if op in ("send", "recv"):
        return 1
    if op == "all_reduce":
        return 2 * (n - 1)
    return n - 1


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth (S / t) to *bus* bandwidth, the
    number comparable to the link's peak whatever N is: all_reduce ``2(N-1)/N``,
    reduce_scatter/all_gather/all_to_all ``(N-1)/N``, broadcast/reduce/send/recv ``1``.
    """
    _check_collective(op, 0, n)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "barrier":
        return 0.0
    return 1.0


def bus_bandwidth(op: str, payload_bytes: float, n: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s of one measured collective, as nccl-tests reports it:
    ``busbw = S / t · factor``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    _check_collective(op, payload_bytes, n)
    return payload_bytes / seconds * bus_bandwidth_factor(op, n)


def collective_time(
    op: str, payload_bytes: float, n: int, alpha_s: float, bandwidth_Bps: float
) -> float:
    """The α-β (latency-bandwidth, Hockney) model of one ring collective::

        t = steps(op, N) · α + wire_bytes(op, S, N) / bandwidth

    e.g. ring all-reduce: ``2(N-1)·α + 2(N-1)/N · S / B``. The first term dominates
    small messages, the second large ones; this is why DDP packs gradients into buckets.
    """
    if alpha_s < 0:
        raise ValueError(f"alpha_s must be >= 0, got {alpha_s}")
    if bandwidth_Bps <= 0:
        raise ValueError(f"bandwidth_Bps must be positive, got {bandwidth_Bps}")
    wire = wire_bytes(op, payload_bytes, n)
    return latency_steps(op, n) * alpha_s + wire / bandwidth_Bps


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted line ``t = alpha_s + beta_s_per_byte · size``."""

    alpha_s: float
    beta_s_per_byte: float

    @property
    def bandwidth_Bps(self) -> float:
        return math.inf if self.beta_s_per_byte <= 0 else 1.0 / self.beta_s_per_byte

    def predict(self, size: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * size


def fit_alpha_beta(sizes, times) -> AlphaBeta:
    """Least-squares fit of ``t = α + β·size`` to measured (size, time) pairs.

    Fit sizes in *wire bytes* of one op at a fixed N to read β as 1/bandwidth; α then
    holds that op's whole latency (all its ring steps together).
    """
    xs, ys = [float(s) for s in sizes], [float(t) for t in times]
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} sizes but {len(ys)} times")
    if len(xs) < 2:
        raise ValueError("need at least two (size, time) points to fit a line")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all sizes are equal: cannot separate alpha from beta")
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return AlphaBeta(alpha_s=my - beta * mx, beta_s_per_byte=beta)

"""How often to checkpoint: the Young–Daly interval (chapter 13, beside checkpoints
and fault-tolerant data parallelism).

A job that checkpoints every τ seconds of work, each checkpoint costing C seconds,
on a machine whose failures come every M seconds on average (the MTBF; a cluster of
n nodes each of MTBF m has M ≈ m / n), wastes, to first order, the fraction

    W(τ) = C / τ  +  τ / (2M)  (+ R / M with a restart cost R)

of its time: C/τ writing checkpoints, and on each failure (rate 1/M) half an
interval of work, on average, done again. Setting dW/dτ = 0 gives

    τ* = √(2 C M)        W(τ*) = √(2 C / M)  (+ R / M)

Young 1974 ("A first order approximation to the optimum checkpoint interval",
CACM 17(9)); Daly 2006 ("A higher order estimate of the optimum checkpoint
interval for restart dumps", FGCS 22(3)) derives the same first-order term and
corrections of order C/M (:func:`daly_interval`). Both assume C ≪ M.
"""

from __future__ import annotations

import math

__all__ = ["young_daly_interval", "daly_interval", "expected_waste", "cluster_mtbf"]


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    return float(value)


def young_daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """τ* = √(2 C M): the seconds of work between checkpoints that minimise the
    expected waste, for a checkpoint costing ``checkpoint_cost_s`` (C) and a mean
    time between failures ``mtbf_s`` (M)."""
    c = _positive("checkpoint_cost_s", checkpoint_cost_s)
    m = _positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * c * m)


def daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (2006):
    ``√(2CM)·[1 + ⅓·√(C/2M) + C/(18M)] − C`` for C < 2M, else M."""
    c = _positive("checkpoint_cost_s", checkpoint_cost_s)
    m = _positive("mtbf_s", mtbf_s)
    if c >= 2.0 * m:
        return m
    r = math.sqrt(c / (2.0 * m))
    return math.sqrt(2.0 * c * m) * (1.0 + r / 3.0 + c / (18.0 * m)) - c


def expected_waste(
    interval_s: float, checkpoint_cost_s: float, mtbf_s: float, restart_s: float = 0.0
) -> float:
    """The first-order fraction of time lost, ``C/τ + τ/(2M) + R/M``, checkpointing
    every ``interval_s`` (τ) seconds of work."""
    tau = _positive("interval_s", interval_s)
    c = _positive("checkpoint_cost_s", checkpoint_cost_s)
    m = _positive("mtbf_s", mtbf_s)
    if isinstance(restart_s, bool) or not restart_s >= 0:
        raise ValueError(f"restart_s must be >= 0 seconds, got {restart_s!r}")
    return c / tau + tau / (2.0 * m) + restart_s / m


def cluster_mtbf(node_mtbf_s: float, nodes: int) -> float:
    """The MTBF of ``nodes`` nodes that fail independently, each every
    ``node_mtbf_s`` on average: failures add, so M = m / n."""
    m = _positive("node_mtbf_s", node_mtbf_s)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
    return m / nodes

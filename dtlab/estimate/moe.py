"""Mixture of experts under expert parallelism: the all-to-all bytes, dropped
assignments and the imbalance factor.

Taught in chapter 11 (mixture of experts), checked against dtlab.moe's measured
bytes and routing. Per MoE layer and microbatch a rank of the ep group with
``tokens`` tokens and top-k routing has ``k·tokens`` assignments, of which the
capacity keeps some (GShard §2.2). The kept rows go to their expert's rank
(dispatch) and their outputs come back (combine), ``h`` values a row; backward runs
the transposes, so a rank sends the rows it dispatched twice (dispatch forward, the
combine's gradient) and the rows its experts received twice (combine forward, the
dispatch's gradient). Before them the ranks all-gather their ``(E,)`` row counts
(int64), so every rank knows the whole matrix.

Under uniform routing a rank keeps ``1/ep`` of its rows and sends the rest:
``4 · (ep-1)/ep · k·tokens·h`` values per layer (:func:`ep_bytes_per_layer`, the
term chapter 09's planner uses). Real routing is uneven: the rank of a hot expert
receives more rows than the others and computes longer; its share over the mean is
the *imbalance factor* (:func:`ep_imbalance`), and the capacity factor is what caps
it, by dropping (:func:`dropped_assignments`).
"""

from __future__ import annotations

from dtlab.checks import positive_int
from dtlab.estimate.collectives import wire_bytes

__all__ = [
    "COUNT_BYTES",
    "ep_bytes_per_layer",
    "ep_traffic_from_counts",
    "ep_imbalance",
    "dropped_assignments",
]

COUNT_BYTES = 8  # the row counts travel as int64


def _counts_bytes(n_experts: int, ep: int) -> float:
    """The all-gather of every rank's ``(E,)`` row counts."""
    return wire_bytes("all_gather", ep * n_experts * COUNT_BYTES, ep)


def ep_bytes_per_layer(
    tokens: int,
    d_model: int,
    ep: int,
    *,
    n_experts: int,
    top_k: int = 1,
    bytes_per_value: int = 4,
    kept_fraction: float = 1.0,
) -> dict[str, float]:
    """Wire bytes one ep rank sends for one MoE layer and microbatch of
    ``tokens`` tokens, *under uniform routing* (each expert gets the same rows):
    ``{"dispatch", "combine"}`` (each of the two forward; backward sends as much
    again, transposed), ``"counts"`` (the all-gather of row counts, forward only),
    ``"wire_bytes"`` (all of it). ``kept_fraction``: the assignments the capacity
    keeps."""
    for name, value in (("tokens", tokens), ("d_model", d_model), ("ep", ep)):
        positive_int(name, value)
    if not 0.0 <= kept_fraction <= 1.0:
        raise ValueError(f"kept_fraction must be in [0, 1], got {kept_fraction}")
    rows = kept_fraction * top_k * tokens  # the rank's kept assignments
    one = wire_bytes("all_to_all", rows * d_model * bytes_per_value, ep)
    counts = _counts_bytes(n_experts, ep) if ep > 1 else 0.0
    return {
        "dispatch": one,
        "combine": one,
        "counts": counts,
        "wire_bytes": 4 * one + counts,
    }


def ep_traffic_from_counts(
    counts, rank: int, d_model: int, *, bytes_per_value: int = 4
) -> dict[str, float]:
    """The exact wire bytes of rank ``rank`` for one MoE layer, forward and
    backward, from the routing: ``counts[s][e]`` = rows rank s sends to expert e
    (the ``(ep, E)`` matrix of kept assignments; experts split evenly, rank j
    owning ``j·E/ep ..``). Same keys as :func:`ep_bytes_per_layer`: ``dispatch``,
    the rows it sends to other ranks' experts (forward; the combine's gradient
    again backward); ``combine``, the rows other ranks sent its experts, returned
    (forward; the dispatch's gradient again backward)."""
    ep, E = len(counts), len(counts[0])
    if E % ep:
        raise ValueError(f"{E} experts do not split over ep={ep} ranks")
    if not 0 <= rank < ep:
        raise ValueError(f"rank {rank} is outside 0..{ep - 1}")
    mine = range(rank * (E // ep), (rank + 1) * (E // ep))  # its experts
    sent = sum(n for e, n in enumerate(counts[rank]) if e not in mine)
    received = sum(counts[s][e] for s in range(ep) if s != rank for e in mine)
    row_bytes = d_model * bytes_per_value
    counts_bytes = _counts_bytes(E, ep) if ep > 1 else 0.0
    dispatch, combine = float(sent * row_bytes), float(received * row_bytes)
    return {
        "dispatch": dispatch,
        "combine": combine,
        "counts": counts_bytes,
        "wire_bytes": 2 * (dispatch + combine) + counts_bytes,
    }


def ep_imbalance(tokens_per_expert, ep: int = 1) -> float:
    """The imbalance factor: the busiest ep rank's rows over the mean (1.0 =
    balanced). ``tokens_per_expert`` are rows per expert, summed over the ranks
    that send them; rank j owns experts ``j·E/ep ..``. With ``ep=1`` it is the
    hottest expert's load over the mean expert's."""
    loads = list(tokens_per_expert)
    positive_int("ep", ep)
    if len(loads) % ep:
        raise ValueError(f"{len(loads)} experts do not split over ep={ep} ranks")
    per = len(loads) // ep
    ranks = [sum(loads[j * per : (j + 1) * per]) for j in range(ep)]
    mean = sum(ranks) / ep
    return max(ranks) / mean if mean else 1.0


def dropped_assignments(routed, capacity: int) -> int:
    """Assignments over capacity: ``Σ_e max(0, routed_e - C)`` (GShard §2.2: the
    token skips that expert)."""
    return int(sum(max(0, int(n) - capacity) for n in routed))

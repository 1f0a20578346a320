"""What a sharded Muon step costs, from the matrices' shapes alone: who owns which
matrix, the bytes each rank sends, and the Newton–Schulz FLOPs each rank computes.

The same functions lay out :class:`dtlab.muon.ShardedMuon`'s buffers, so the
estimate and the run agree by construction on *what* is sent; the tests check that
the bytes dtlab's comm layer records equal :func:`muon_traffic` exactly.

Notation: M matrices of shapes (m_i, n_i), k_i = m_i·n_i elements, N ranks, b the
bytes of a parameter and of its gradient (4 in fp32), b_ns those of the NS input
(2: bfloat16). ``(N-1)/N·S`` is what one rank sends in a ring all-gather or
reduce-scatter of S bytes (:func:`dtlab.estimate.wire_bytes`).

- ``"naive"`` (ZeRO-1 with Muon: Liu et al. 2025's "Distributed Muon"): each
  matrix is cut into N equal slices of s_i = ceil(k_i/N) (the last padded); three
  collectives per matrix: reduce-scatter the gradient, all-gather the NS input,
  all-gather the updated parameter: ``Σ_i (N-1)·s_i·(2b + b_ns)`` bytes per rank,
  3M calls. Every rank runs NS on every matrix: N× the work.
- ``"owner"`` (owner-compute: each matrix orthogonalized once, by one rank): the
  matrices are dealt to owners (:func:`assign_owners`), each rank's segment padded
  to the largest load L; one reduce-scatter of gradients, one all-gather of updated
  parameters: ``2·(N-1)·L·b`` bytes per rank, 2 calls. With perfect balance
  L = Σk_i/N and the gather of the NS input is simply gone: ZeRO-1's 2Ψ, as for Adam.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.checks import one_of, positive_int
from dtlab.estimate import wire_bytes

__all__ = [
    "DESIGNS",
    "TAGS",
    "ns_flops",
    "slice_size",
    "assign_owners",
    "owner_layout",
    "OwnerLayout",
    "MuonTraffic",
    "muon_traffic",
    "muon_flops",
]

DESIGNS = ("naive", "owner")
TAGS = {
    "grads": "muon/rs-grads",  # gradients reduce-scattered (to slices or owners)
    "gather": "muon/gather",  # naive only: the NS input gathered whole on every rank
    "params": "muon/ag-params",  # the updated parameters gathered
}
"""The comm tags a sharded Muon step records, by role."""


def _shape(shape) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(
            f"Muon steps 2-D matrices; got shape {tuple(shape)}: route it to AdamW"
        )
    return int(shape[0]), int(shape[1])


def ns_flops(shape, steps: int = 5) -> int:
    """Matmul FLOPs of Newton–Schulz on one (m, n) matrix
    (:func:`~dtlab.muon.newton_schulz`): with p = min(m, n), q = max(m, n) (the Gram
    matrix is the smaller side), each iteration does XXᵀ (2p²q), b·A + c·A² (2p³)
    and a·X + BX (2p²q)::

        ns_flops = steps · (4·p²·q + 2·p³)

    A multiply-add counts 2, as :class:`torch.utils.flop_counter.FlopCounterMode`
    counts it; the normalization and the additions (O(pq) each) are left out. For a
    square d×d matrix: 6·steps·d³, i.e. 30·d³ at 5 steps."""
    p, q = sorted(_shape(shape))
    return steps * (4 * p * p * q + 2 * p**3)


def slice_size(numel: int, world_size: int) -> int:
    """Elements of each rank's slice of a matrix cut N ways: ceil(numel/N); the last
    slice is padded with zeros (``N·slice_size - numel`` of them, < N)."""
    return math.ceil(numel / world_size)


def assign_owners(numels, world_size: int) -> list[int]:
    """The owner rank of each matrix, balanced greedily by element count: largest
    matrix first, each to the rank holding the fewest elements so far (ties: lowest
    rank). This is Graham's LPT rule: the heaviest rank holds at most 4/3 of the best
    possible. Balancing elements balances bytes (each rank's segment is padded to the
    heaviest); the NS FLOPs, ~p²q, balance only roughly. Deterministic, so every
    rank computes the same assignment without talking.

    (Round-robin in parameter order, the other common choice, ignores sizes: with
    one big matrix per layer it can give one rank all the big ones.)"""
    positive_int("world_size", world_size)
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


@dataclass(frozen=True)
class OwnerLayout:
    """Where each matrix sits in the owner-compute buffers: rank r's segment is
    ``[r·segment, (r+1)·segment)`` and holds its own matrices, in parameter order,
    matrix i at ``offsets[i]`` inside its owner's segment."""

    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    segment: int  # L: the heaviest rank's elements; every segment is padded to it
    loads: tuple[int, ...]  # elements each rank owns


def owner_layout(numels, world_size: int) -> OwnerLayout:
    """The owner-compute layout of matrices of ``numels`` over ``world_size`` ranks
    (:func:`assign_owners`, then each owner's matrices packed in order)."""
    owners = assign_owners(numels, world_size)
    loads, offsets = [0] * world_size, []
    for k, r in zip(numels, owners):
        offsets.append(loads[r])
        loads[r] += k
    return OwnerLayout(tuple(owners), tuple(offsets), max(loads), tuple(loads))


@dataclass(frozen=True)
class MuonTraffic:
    """One sharded Muon step's communication per rank, by comm tag (:data:`TAGS`):
    ``calls`` collectives and ``wire_bytes`` sent (the same on every rank)."""

    design: str
    world_size: int
    calls: dict
    wire_bytes: dict

    @property
    def total_wire_bytes(self) -> float:
        return sum(self.wire_bytes.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


def muon_traffic(
    shapes, world_size: int, design: str, *, param_bytes: int = 4, ns_bytes: int = 2
) -> MuonTraffic:
    """Bytes each rank sends (and collectives it calls) in one step of
    :class:`dtlab.muon.ShardedMuon` with ``design`` over matrices of ``shapes``
    (the formulas are in this module's docstring). ``param_bytes``: a parameter's
    and a gradient's element size; ``ns_bytes``: the NS input's (bfloat16: 2)."""
    n = positive_int("world_size", world_size)
    design = one_of("design", design, DESIGNS)
    numels = [m * q for m, q in map(_shape, shapes)]
    if design == "naive":
        padded = [n * slice_size(k, n) for k in numels]
        per = {"grads": param_bytes, "gather": ns_bytes, "params": param_bytes}
        op = {"grads": "reduce_scatter", "gather": "all_gather"}
        wire = {
            TAGS[role]: sum(
                wire_bytes(op.get(role, "all_gather"), p * b, n) for p in padded
            )
            for role, b in per.items()
        }
        calls = {TAGS[role]: len(numels) for role in per}
    else:
        full = n * owner_layout(numels, n).segment * param_bytes
        wire = {
            TAGS["grads"]: wire_bytes("reduce_scatter", full, n),
            TAGS["params"]: wire_bytes("all_gather", full, n),
        }
        calls = {TAGS["grads"]: 1, TAGS["params"]: 1}
    return MuonTraffic(design, n, calls, wire)


def muon_flops(shapes, world_size: int, design: str, steps: int = 5) -> list[int]:
    """Newton–Schulz FLOPs each rank computes in one step, a list by rank.

    ``"naive"``: every rank orthogonalizes every matrix, ``Σ ns_flops`` each, so the
    cluster does N times one process's work; ``"owner"``: rank r only its own, and
    the ranks together do the work once."""
    n = positive_int("world_size", world_size)
    design = one_of("design", design, DESIGNS)
    flops = [ns_flops(s, steps) for s in shapes]
    if design == "naive":
        return [sum(flops)] * n
    owners = assign_owners([m * q for m, q in map(_shape, shapes)], n)
    per_rank = [0] * n
    for f, r in zip(flops, owners):
        per_rank[r] += f
    return per_rank

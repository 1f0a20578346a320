"""Chapter 12's third exercise: the owners of owner-compute sharded Muon
(:class:`dtlab.muon.ShardedMuon`, ``design="owner"``: each matrix orthogonalized
once, by one rank; Jordan et al. 2024 (Muon); Ahn et al. 2025 (Dion) for the
owner-compute design).

``assign_owners`` on four hidden sets of matrices (a GPT's skewed sizes, more ranks
than matrices, equal sizes, one huge matrix): every matrix has exactly one owner in
range, the caller's list comes back untouched, and the heaviest rank, which every
rank's segment is padded to, holds no more than under
:func:`dtlab.muon.estimate.assign_owners` (Graham's LPT rule; a better balance
passes). With those owners, the bytes each rank sends in the step
(:func:`dtlab.muon.muon_traffic`'s formula) and the Newton–Schulz FLOPs of the
busiest rank (:func:`dtlab.muon.ns_flops`) are reported beside the library's. The
FLOPs are not judged: the learner balances elements, as the library does, and NS
work grows faster than a matrix's size (``p²q``), so a better balance of elements
can leave a busier rank.

Which parameters come out is not judged either: any assignment of one owner per
matrix steps every matrix exactly once, which is the whole of ShardedMuon's
equality with single-process Muon (``tests/test_muon.py`` proves it for the
library's owners; ShardedMuon takes no owners of its own to run a learner's).
"""

from __future__ import annotations

import torch

from dtlab.estimate import wire_bytes
from dtlab.exercises.ch12_solutions import assign_owners
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.watch import Watch
from dtlab.muon import estimate as muon_estimate

__all__ = ["check_assign_owners"]


# ---- 3. the owners of owner-compute Muon -------------------------------------------
def _gpt_matrices(d=64, vocab=256, layers=2):
    """A GPT's matrices in parameter order: embedding, then per layer qkv, proj,
    fc, fc2, then the head."""
    per_layer = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    return [(vocab, d), *per_layer * layers, (vocab, d)]


OWNER_CASES = (  # (what, shapes of the matrices in parameter order, ranks)
    ("a GPT's matrices (skewed sizes) over 4 ranks", _gpt_matrices(), 4),
    ("3 matrices over 8 ranks", [(64, 32), (32, 32), (16, 32)], 8),
    ("6 equal matrices over 4 ranks", [(32, 32)] * 6, 4),
    (
        "one huge matrix among 7 small ones, 4 ranks",
        [(32, 32)] * 3 + [(512, 512)] + [(32, 32)] * 4,
        4,
    ),
)
PARAM_BYTES = 4  # fp32 parameters and gradients, ShardedMuon's buffers


def _loads(numels, owners, n) -> list[int]:
    load = [0] * n
    for k, r in zip(numels, owners):
        load[r] += k
    return load


def _step_bytes(heaviest: int, n: int) -> float:
    """Bytes each rank sends in one owner-compute step: the reduce-scatter of the
    gradients and the all-gather of the parameters, every segment padded to the
    heaviest rank's (the formula of :func:`dtlab.muon.muon_traffic`)."""
    full = n * heaviest * PARAM_BYTES
    return wire_bytes("reduce_scatter", full, n) + wire_bytes("all_gather", full, n)


def _as_owners(got, what, M, N) -> list[int]:
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    if not isinstance(got, list | tuple):
        raise ExerciseFailed(
            f"{what}: return a list of ranks, got {type(got).__name__}"
        )
    if len(got) != M:
        per_rank = " (that is one per rank)" if len(got) == N else ""
        raise ExerciseFailed(
            f"{what}: you returned {len(got)} entries{per_rank} for {M} matrices: "
            "one owner per matrix, owners[i] the rank that steps matrix i"
        )
    owners = []
    for i, r in enumerate(got):
        if isinstance(r, bool) or not hasattr(r, "__index__"):  # ints, numpy's
            raise ExerciseFailed(
                f"{what}: owners[{i}] is {r!r}: each entry is a rank, an int"
            )
        r = int(r)
        if not 0 <= r < N:
            raise ExerciseFailed(
                f"{what}: owner {r} of matrix {i} is not a rank of world_size {N}: "
                f"ranks are 0 … {N - 1}"
            )
        owners.append(r)
    return owners


def _owner_hint(owners, numels, N, want_max) -> str | None:
    """A mistake the owners match: all on rank 0, or owners in size order."""
    if N > 1 and set(owners) == {0}:
        return (
            f"every matrix is on rank 0: the other {N - 1} ranks orthogonalize "
            "nothing while rank 0 runs every Newton–Schulz; deal them out"
        )
    for descending in (True, False):
        sign = -1 if descending else 1
        order = sorted(range(len(numels)), key=lambda i: (sign * numels[i], i))
        realigned = [0] * len(numels)
        for j, i in enumerate(order):
            realigned[i] = owners[j]
        if max(_loads(numels, realigned, N)) <= want_max:
            return (
                "the owners come in size order, not in the order of numels: "
                "owners[i] must be the owner of numels[i] (matrix i of the "
                "parameters), however you sorted to decide"
            )
    return None


@exercise(
    "assign_owners",
    chapter=12,
    reference=assign_owners,
    local=True,
    measures=(
        "one owner in range per matrix; heaviest rank <= dtlab.muon's LPT on 4 "
        "hidden cases (skewed sizes, more ranks than matrices, equal sizes, one huge "
        "matrix); numels untouched; bytes and NS FLOPs of the owner step reported"
    ),
)
def check_assign_owners(solution, cluster=None):
    forbidden = {
        muon_estimate.assign_owners: "dtlab.muon.assign_owners",
        muon_estimate.owner_layout: "dtlab.muon.estimate.owner_layout",
    }
    report = []
    for what, shapes, N in OWNER_CASES:
        numels = [m * n for m, n in shapes]
        given = list(numels)
        with Watch(forbidden) as seen:
            got = attempt(solution, given, N)
        if seen.forbidden:
            raise ExerciseFailed(
                f"you called {', '.join(seen.forbidden)}: deal the matrices yourself"
            )
        if given != numels:
            raise ExerciseFailed(
                f"{what}: your function changed numels in place (sorted it?): the "
                "caller's list is in parameter order, the order the owners must "
                "follow; sort a list of indices instead"
            )
        owners = _as_owners(got, what, len(numels), N)
        want = assign_owners(numels, N)
        assert want == muon_estimate.assign_owners(numels, N), what  # dtlab's rule
        loads, want_max = _loads(numels, owners, N), max(_loads(numels, want, N))
        heaviest = max(loads)
        if heaviest > want_max:
            hint = _owner_hint(owners, numels, N, want_max)
            if hint:
                raise ExerciseFailed(f"{what}: {hint}")
            r = loads.index(heaviest)
            raise ExerciseFailed(
                f"{what}: the heaviest rank (rank {r}) holds {heaviest} elements; "
                f"a balanced dealing holds at most {want_max}. Every rank's segment "
                f"is padded to the heaviest, so each rank sends "
                f"{_step_bytes(heaviest, N):,.0f} bytes a step instead of "
                f"{_step_bytes(want_max, N):,.0f}, and all wait for its NS: take "
                "the largest matrices first, each to the rank holding least so far"
            )
        # the owner step's cost with these owners, beside the library's
        mine_bytes = _step_bytes(heaviest, N)
        assert _step_bytes(want_max, N) == (
            muon_estimate.muon_traffic(shapes, N, "owner").total_wire_bytes
        )
        flops = [0] * N
        for shape, r in zip(shapes, owners):
            flops[r] += muon_estimate.ns_flops(shape)
        lib_flops = max(muon_estimate.muon_flops(shapes, N, "owner"))
        report.append((what, heaviest, want_max, mine_bytes, max(flops), lib_flops))
    what, heaviest, want_max, sent, flops, lib_flops = report[0]
    return [
        "every matrix has one owner in range, numels untouched, on 4 hidden cases "
        "(skewed sizes, more ranks than matrices, equal sizes, one huge matrix)",
        "the heaviest rank holds no more than under dtlab.muon's LPT rule: "
        + ", ".join(f"{h} vs {w}" for _, h, w, *_ in report)
        + " elements",
        f"{what}: each rank sends {sent / 1e3:.0f} kB a step; the busiest rank "
        f"runs {flops / 1e6:.0f} MFLOP of Newton–Schulz (LPT's: "
        f"{lib_flops / 1e6:.0f})",
    ]

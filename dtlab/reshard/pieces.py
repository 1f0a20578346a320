"""Where a piece of a tensor sits in the full tensor, and where two pieces meet.

Taught in chapter 13 (checkpoints that reshard; :mod:`dtlab.reshard`). No process
group here: the geometry is pure arithmetic, testable on its own.

A rank holds a :class:`Piece` of each full (unsharded, GPT-named) tensor. Tensor
parallelism cuts a *box*: elements ``[start, stop)`` along one dimension, all of the
others (a column-parallel weight's rows, a row-parallel weight's columns, a
vocabulary slice of the embedding). ZeRO then flattens that box row-major and keeps
a *flat range* ``[lo, hi)`` of it. A tensor no axis cuts is the box of its whole
first dimension; a replica keeps the whole flat range.

Both are described by the same five numbers, so one routine compares any two pieces:
:meth:`Piece.runs` lists the piece as runs of consecutive elements of the full
tensor flattened row-major, and :func:`overlaps` walks two such lists together and
returns where they share elements, as offsets into each piece. For a box cut along
dimension 0 a flat range is one run; cut along dimension ``d`` it is one run per
index of the dimensions before ``d`` (a row-parallel weight's slice of columns is
one run per row).

torch.distributed.checkpoint describes a chunk as a box only (``offsets``,
``sizes``): FSDP2 shards dim 0 (``Shard(0)``), so its chunks are boxes. dtlab's ZeRO
flattens a unit and cuts the flat buffer, so a piece is a flat range *of* a box,
which is not a box: hence the runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Piece", "overlaps", "tp_piece"]


@dataclass(frozen=True)
class Piece:
    """Elements of a tensor of ``shape``: the box ``[start, stop)`` along ``dim``
    (every index of the other dimensions), flattened row-major, and of that the
    elements ``[lo, hi)``."""

    shape: tuple[int, ...]
    dim: int
    start: int
    stop: int
    lo: int
    hi: int

    def __post_init__(self):
        if not 0 <= self.dim < max(len(self.shape), 1):
            raise ValueError(
                f"dim {self.dim} is outside a tensor of shape {self.shape}"
            )
        extent = self.shape[self.dim] if self.shape else 1
        if not 0 <= self.start <= self.stop <= extent:
            raise ValueError(
                f"box [{self.start}, {self.stop}) is outside dim {self.dim} of "
                f"{self.shape}"
            )
        if not 0 <= self.lo <= self.hi <= self.box_numel:
            raise ValueError(
                f"flat range [{self.lo}, {self.hi}) is outside the box's "
                f"{self.box_numel} elements"
            )

    @classmethod
    def whole(cls, shape) -> Piece:
        """All of a tensor of ``shape``."""
        shape = tuple(shape)
        extent = shape[0] if shape else 1
        return cls(shape, 0, 0, extent, 0, math.prod(shape))

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def box_numel(self) -> int:
        return self._outer * (self.stop - self.start) * self._inner

    @property
    def _outer(self) -> int:  # P: the index count of the dimensions before dim
        return math.prod(self.shape[: self.dim])

    @property
    def _inner(self) -> int:  # Q: elements per index of dim
        return math.prod(self.shape[self.dim + 1 :])

    def runs(self) -> list[tuple[int, int, int]]:
        """``(offset in the full tensor, offset in the piece, length)`` of each run
        of consecutive full-tensor elements, in increasing order.

        With ``P`` indices before ``dim``, ``D`` along it and ``Q`` elements after,
        box element ``(p, j, q)`` is full element ``p·D·Q + (start + j)·Q + q``: a
        box row of ``(stop - start)·Q`` elements is one run."""
        if self.numel == 0:
            return []
        D = self.shape[self.dim] if self.shape else 1
        Q, row = self._inner, (self.stop - self.start) * self._inner
        out = []
        for p in range(self.lo // row, (self.hi - 1) // row + 1):
            a, b = max(self.lo, p * row), min(self.hi, (p + 1) * row)
            out.append((p * D * Q + self.start * Q + a - p * row, a - self.lo, b - a))
        return out

    def extent(self) -> tuple[int, int]:
        """The first full-tensor element of the piece and one past its last."""
        runs = self.runs()
        if not runs:
            return 0, 0
        return runs[0][0], runs[-1][0] + runs[-1][2]

    def to_dict(self) -> dict:
        return dict(
            dim=self.dim, start=self.start, stop=self.stop, lo=self.lo, hi=self.hi
        )

    @classmethod
    def from_dict(cls, shape, d: dict) -> Piece:
        return cls(tuple(shape), d["dim"], d["start"], d["stop"], d["lo"], d["hi"])


def overlaps(want: Piece, have: Piece) -> list[tuple[int, int, int]]:
    """Where ``have`` holds elements of ``want``: ``(offset in want, offset in have,
    length)`` triples, consecutive ones merged. Both pieces are of one tensor."""
    if want.shape != have.shape:
        raise ValueError(
            f"pieces of tensors of shapes {want.shape} and {have.shape} cannot meet"
        )
    (a0, a1), (b0, b1) = want.extent(), have.extent()
    if a1 <= b0 or b1 <= a0:
        return []
    A, B = want.runs(), have.runs()
    out: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(A) and j < len(B):  # both sorted, each without overlaps
        ga, la, na = A[i]
        gb, lb, nb = B[j]
        lo, hi = max(ga, gb), min(ga + na, gb + nb)
        if lo < hi:
            w, h, n = la + lo - ga, lb + lo - gb, hi - lo
            if out and out[-1][0] + out[-1][2] == w and out[-1][1] + out[-1][2] == h:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((w, h, n))
        if ga + na <= gb + nb:
            i += 1
        else:
            j += 1
    return out


def tp_piece(
    full_shape, local_shape, dim: int | None, index: int, lo: int, hi: int
) -> tuple[Piece, int]:
    """The piece of elements ``[lo, hi)`` of a tensor-parallel rank's local tensor
    (of ``local_shape``; cut along ``dim`` over the tp ranks, this being rank
    ``index``; ``dim=None``: not cut), and how many of those elements are padding.

    The vocabulary is padded to a multiple of tp (:func:`dtlab.topology.padded_vocab`),
    so the last ranks' slices of the embedding and the head end in rows that are no
    token: they belong to no full tensor. They trail the local tensor (the padding is
    along dim 0), so the real elements are a prefix of any flat range and the
    padding its suffix. Returns ``(piece, padding)``."""
    full_shape, local_shape = tuple(full_shape), tuple(local_shape)
    if dim is None:
        if full_shape != local_shape:
            raise ValueError(
                f"a tensor no tp rank cuts has its full shape {full_shape} on every "
                f"rank, not {local_shape}"
            )
        piece = Piece.whole(full_shape)
        return Piece(full_shape, 0, 0, piece.stop, lo, hi), 0
    length = local_shape[dim]
    start = min(index * length, full_shape[dim])
    stop = min(start + length, full_shape[dim])
    if stop - start < length and dim != 0:
        raise NotImplementedError(
            f"padding along dim {dim}: only the vocabulary (dim 0) is padded here"
        )
    real = math.prod(local_shape) // length * (stop - start)  # elements of the box
    r_hi = min(hi, real)
    r_lo = min(lo, r_hi)
    return Piece(full_shape, dim, start, stop, r_lo, r_hi), (hi - lo) - (r_hi - r_lo)

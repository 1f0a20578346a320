"""DDP's gradient buckets: which gradients are all-reduced together, as one flat
buffer, and in which order (Li et al. 2020, §3.2.3).

Backward produces gradients roughly in *reverse* registration order (the last layer
first), so the parameters are packed in that order into buckets of about
``bucket_cap_mb`` MiB (:func:`dtlab.estimate.ddp_bucket_assignment`), one dtype per
bucket, and bucket 0 (the last layers) is the first to be complete and launched.
Taught in chapter 02.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dtlab import comm
from dtlab.estimate import ddp_bucket_assignment
from dtlab.memory import nbytes

__all__ = ["MB", "Bucket", "make_buckets", "broadcast_flat"]

MB = 1024 * 1024  # PyTorch's bucket_cap_mb counts MiB


@dataclass
class Bucket:
    """Gradients all-reduced together, as one flat buffer.

    ``params`` are in the order they sit in the buffer (reverse registration order);
    ``offsets[i]`` is where ``params[i]`` starts.
    """

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    buffer: torch.Tensor | None = field(default=None, repr=False)
    views: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def allocate(self) -> torch.Tensor:
        """The flat buffer (allocated once, on the parameters' device) and, in
        :attr:`views`, each parameter's slice of it in the parameter's shape: what
        the parameters' ``.grad`` point at (PyTorch's ``gradient_as_bucket_view``)."""
        if self.buffer is None:
            device = self.params[0].device
            self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=device)
            self.views = [
                self.buffer[off : off + p.numel()].view_as(p)
                for p, off in zip(self.params, self.offsets)
            ]
        return self.buffer


def make_buckets(params, names: dict[int, str], bucket_cap_mb: float) -> list[Bucket]:
    """Buckets for ``params`` (in registration order; ``names`` by ``id``): reverse
    registration order, cut at ``bucket_cap_mb`` MiB, one dtype per bucket (PyTorch
    keeps one open bucket per dtype, so do we), numbered in launch order."""
    order = list(params)[::-1]
    cap = bucket_cap_mb * MB
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(order):
        by_dtype.setdefault(p.dtype, []).append(i)
    groups = []
    for idx in by_dtype.values():
        sizes = [nbytes(order[i]) for i in idx]
        groups += [[idx[j] for j in b] for b in ddp_bucket_assignment(sizes, cap)]
    groups.sort(key=lambda g: g[0])  # launch order: where the bucket starts
    buckets = []
    for k, members in enumerate(groups):
        ps = [order[i] for i in members]
        offsets, total = [], 0
        for p in ps:
            offsets.append(total)
            total += p.numel()
        buckets.append(
            Bucket(
                index=k,
                params=ps,
                names=[names[id(p)] for p in ps],
                offsets=offsets,
                numel=total,
                dtype=ps[0].dtype,
            )
        )
    return buckets


@torch.no_grad()
def broadcast_flat(tensors, group, tag: str) -> None:
    """Copy rank 0's values of ``tensors`` to every rank of ``group``: one flat
    broadcast per dtype instead of one call per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        comm.broadcast(flat, src=0, group=group, tag=tag)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

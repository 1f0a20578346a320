"""The communication of tensor parallelism: Megatron's f and g, and the sequence
parallel g and ḡ, as autograd functions.

Taught in chapter 04 (``notebooks/04_tensor_parallel.ipynb``, section 2 for f and g,
section 4 for sequence parallelism). The layers in :mod:`.layers` call these and
nothing else to cross ranks; every byte goes through :mod:`dtlab.comm`, tagged
``name:fwd`` or ``name:bwd`` after the layer (``blocks.0.mlp.proj:fwd``).

Megatron's conjugate operators (Shoeybi et al. 2019, §3 and Figure 3) join a
column-parallel layer to a row-parallel one:

======  ===========================  ==========================
 op      forward                      backward
======  ===========================  ==========================
 f       identity                     all-reduce  (sum of dX_i)
 g       all-reduce (sum of partial)  identity
======  ===========================  ==========================

Sequence parallelism (Korthikanti et al. 2022, §4.2.2 and Figure 5) keeps the
regions between the layers split along the sequence, so f and g become Korthikanti's
**g** (all-gather the sequence forward, reduce-scatter backward) and **ḡ**
(reduce-scatter forward, all-gather backward). An all-reduce *is* a reduce-scatter
followed by an all-gather: the bytes on the wire stay the same.

A tp group of one rank has nothing to exchange: each operator is then the identity,
with no autograd node, so tp=1 is the plain model bit for bit.

Activations are ``(B, T, C)``; the tensor-parallel ops split ``C`` (the last dim),
the sequence-parallel ones ``T`` (dim 1).
"""

from __future__ import annotations

import torch

from dtlab import comm

__all__ = [
    "split_along",
    "all_gather_along",
    "reduce_scatter_along",
    "CopyToTP",
    "ReduceFromTP",
    "GatherFromTP",
    "ScatterToTP",
    "GatherFromSP",
    "ReduceScatterToSP",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
]


# ---- moving a tensor between ranks along one dimension (no autograd) -----------------
def _check_splits(x: torch.Tensor, dim: int, axis) -> None:
    if x.shape[dim] % axis.size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split over "
            f"tp={axis.size} ranks: make it a multiple of tp"
        )


def split_along(x: torch.Tensor, dim: int, axis) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication)."""
    _check_splits(x, dim, axis)
    return x.chunk(axis.size, dim)[axis.index].contiguous()


def all_gather_along(x: torch.Tensor, dim: int, axis, tag: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    x = x.contiguous()
    t, d0 = axis.size, x.shape[0]
    # gloo and nccl gather along dim 0: (t*d0, ...), rank order
    out = torch.empty((t * d0, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group=axis, tag=tag)
    return torch.cat(out.split(d0), dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, axis, tag: str) -> torch.Tensor:
    """``x`` summed over the ranks, of which this rank keeps its slice along ``dim``."""
    _check_splits(x, dim, axis)
    # comm.reduce_scatter cuts dim 0: bring the t slices of `dim` to the front
    slices = torch.cat(x.chunk(axis.size, dim), dim=0)  # (t*d0, ...): slice i at i
    out = torch.empty_like(
        x.chunk(axis.size, dim)[0], memory_format=torch.contiguous_format
    )
    comm.reduce_scatter(out, slices, group=axis, tag=tag)
    return out


# ---- the conjugate operators (Megatron-LM §3) ----------------------------------------
class CopyToTP(torch.autograd.Function):
    """Megatron's **f** (Shoeybi et al. 2019, §3), in front of a column-parallel
    layer: identity forward; all-reduce of the input gradient backward, since rank
    i's ``dL/dX = dL/dY_i · A_iᵀ`` is one term of the sum over the column slices."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis, ctx.name = axis, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # comm sums in place: on a copy, never on the tensor autograd handed us
        dx = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(dx, group=ctx.axis, tag=f"{ctx.name}:bwd")  # Σ_i dX_i
        return dx, None, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's **g** (Shoeybi et al. 2019, §3), behind a row-parallel layer:
    all-reduce forward, ``Y = Σ_i X_i·A_i``; identity backward, since every rank
    holds the whole ``Y`` and so the whole ``dL/dY``."""

    @staticmethod
    def forward(ctx, partial, axis, name):
        # comm sums in place: on a copy, never on the tensor autograd handed us
        y = partial.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(y, group=axis, tag=f"{name}:fwd")  # Y = Σ_i X_i·A_i
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromTP(torch.autograd.Function):
    """All-gather the last dim forward (column slices -> the whole ``Y``); keep this
    rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis = axis
        return all_gather_along(x, -1, axis, f"{name}:fwd")

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, -1, ctx.axis), None, None


class ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward (a whole input -> the ``X_i``
    a row-parallel layer wants); all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis, ctx.name = axis, name
        return split_along(x, -1, axis)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, -1, ctx.axis, f"{ctx.name}:bwd"), None, None


# ---- sequence parallelism (Korthikanti et al. 2022, §4.2.2) --------------------------
class GatherFromSP(torch.autograd.Function):
    """Korthikanti's **g** (§4.2.2), from the sequence-parallel region into a
    column-parallel layer, in place of f: all-gather the sequence forward,
    ``(B, T/t, C) -> (B, T, C)``; reduce-scatter the gradient backward (each rank's
    ``dL/dX`` is a partial sum, of which each rank keeps its tokens)."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis, ctx.name = axis, name
        return all_gather_along(x, 1, axis, f"{name}:fwd")  # (B, T, C)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(grad, 1, ctx.axis, f"{ctx.name}:bwd"), None, None


class ReduceScatterToSP(torch.autograd.Function):
    """Korthikanti's **ḡ** (§4.2.2), from a row-parallel layer into the
    sequence-parallel region, in place of g: sum the partial outputs and keep this
    rank's tokens forward, ``(B, T, C) -> (B, T/t, C)``; all-gather backward."""

    @staticmethod
    def forward(ctx, partial, axis, name):
        ctx.axis, ctx.name = axis, name
        return reduce_scatter_along(partial, 1, axis, f"{name}:fwd")  # (B, T/t, C)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 1, ctx.axis, f"{ctx.name}:bwd"), None, None


# ---- the functions layers call -------------------------------------------------------
def _apply(fn, x, axis, name):
    # a tp group of one rank has nothing to exchange: the operator is the identity
    return x if axis.size == 1 else fn.apply(x, axis, name)


def copy_to_tp(x, axis, name="f"):
    """f: identity forward, all-reduce backward (the identity at tp=1)."""
    return _apply(CopyToTP, x, axis, name)


def reduce_from_tp(x, axis, name="g"):
    """g: all-reduce forward, identity backward (the identity at tp=1)."""
    return _apply(ReduceFromTP, x, axis, name)


def gather_from_tp(x, axis, name="gather"):
    """All-gather the last dim forward, split backward."""
    return _apply(GatherFromTP, x, axis, name)


def scatter_to_tp(x, axis, name="scatter"):
    """Split the last dim forward, all-gather backward."""
    return _apply(ScatterToTP, x, axis, name)


def gather_from_sp(x, axis, name="sp_gather"):
    """Sequence-parallel g: all-gather dim 1 forward, reduce-scatter backward."""
    return _apply(GatherFromSP, x, axis, name)


def reduce_scatter_to_sp(x, axis, name="sp_scatter"):
    """Sequence-parallel ḡ: reduce-scatter dim 1 forward, all-gather backward."""
    return _apply(ReduceScatterToSP, x, axis, name)

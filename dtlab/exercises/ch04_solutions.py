"""Chapter 04's reference solutions: the row-parallel linear with Megatron's g
(Shoeybi et al. 2019, §3), and an MLP converted to sequence parallelism, where
Korthikanti's g and ḡ (all-gather / reduce-scatter of the sequence) replace the
all-reduces (Korthikanti et al. 2022, §4.2.2). ``dtlab.exercises.solution(name)``
shows each; :mod:`.ch04_tensor_parallel` checks a learner's against them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["column_parallel_linear", "row_parallel_linear", "sequence_parallel_mlp"]


def column_parallel_linear(x, weight_shard, bias_shard, axis):
    """``Y_i = X·A_iᵀ + b_i`` with ``A`` split by output rows (Megatron §3, eq. 3):
    rank i holds ``weight_shard`` (out/t, in) and ``bias_shard`` (out/t) and needs
    the whole input. f runs in front of it: identity forward; all-reduce backward,
    since rank i's dL/dX = dL/dY_i·A_i is only one term of the sum over the column
    slices. The weight's and bias's gradients are complete on each rank."""
    from dtlab import comm

    class CopyToTP(torch.autograd.Function):  # Megatron's f
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            dx = grad.clone()  # all_reduce sums in place: never autograd's tensor
            comm.all_reduce(dx, group=axis)  # dL/dX = Σ_i dL/dY_i·A_i
            return dx

    return CopyToTP.apply(x) @ weight_shard.T + bias_shard  # (…, out/t)


def row_parallel_linear(x_shard, weight_shard, bias, axis):
    """``Y = X·Aᵀ + b`` with ``A`` split by rows of its input (Megatron §3, eq. 4):
    rank i holds ``weight_shard`` (out, in/t) and the matching slice ``x_shard``
    (…, in/t) of the input, and computes its share ``X_i·A_iᵀ`` of the sum. g sums
    the shares (all-reduce forward; identity backward, since every rank then holds
    the whole dL/dY), and the bias, replicated, is added once after the sum."""
    from dtlab import comm

    class ReduceFromTP(torch.autograd.Function):  # Megatron's g
        @staticmethod
        def forward(ctx, partial):
            y = partial.clone()  # all_reduce sums in place: never autograd's tensor
            comm.all_reduce(y, group=axis)  # Y = Σ_i X_i·A_iᵀ
            return y

        @staticmethod
        def backward(ctx, grad):
            return grad  # dL/dY is whole on every rank: nothing to send

    partial = x_shard @ weight_shard.T  # (…, out): this rank's share of the sum
    return ReduceFromTP.apply(partial) + bias


def sequence_parallel_mlp(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """An MLP ``proj(gelu(fc(x)))`` under sequence parallelism. ``x_shard`` (B,
    T/t, C) holds this rank's tokens; ``w_fc`` (H/t, C) and ``b_fc`` are fc's
    column-parallel shard, ``w_proj`` (C, H/t) proj's row-parallel one, ``b_proj``
    (C) is replicated. Korthikanti's g all-gathers the sequence in front of fc
    (reduce-scatter backward); ḡ reduce-scatters it behind proj (all-gather
    backward): the bytes of the two all-reduces they replace, and no weight ever
    moves. Returns this rank's tokens of the output, (B, T/t, C)."""
    from dtlab import comm

    t = axis.size

    def gather_sequence(x):  # (B, T/t, C) -> (B, T, C), ranks in order along T
        x = x.contiguous()
        out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        comm.all_gather(out, x, group=axis)  # collectives stack along dim 0
        return torch.cat(out.chunk(t), dim=1)

    def scatter_sequence(x):  # (B, T, C) summed over ranks -> my (B, T/t, C)
        pieces = torch.cat(x.chunk(t, dim=1), dim=0)  # piece i at rows i·B…
        out = torch.empty_like(
            x.chunk(t, dim=1)[0], memory_format=torch.contiguous_format
        )
        comm.reduce_scatter(out, pieces, group=axis)
        return out

    class G(torch.autograd.Function):  # in front of the column-parallel fc
        @staticmethod
        def forward(ctx, x):
            return gather_sequence(x)

        @staticmethod
        def backward(ctx, grad):  # each rank's dL/dX is a partial sum: scatter it
            return scatter_sequence(grad)

    class GBar(torch.autograd.Function):  # behind the row-parallel proj
        @staticmethod
        def forward(ctx, partial):
            return scatter_sequence(partial)

        @staticmethod
        def backward(ctx, grad):
            return gather_sequence(grad)

    h = F.gelu(G.apply(x_shard) @ w_fc.T + b_fc)  # (B, T, H/t)
    return GBar.apply(h @ w_proj.T) + b_proj  # (B, T/t, C)

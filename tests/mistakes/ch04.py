"""The mistakes learners make in chapter 04's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtlab.exercises import ch04_tensor_parallel  # noqa: F401 - declares the exercises
from dtlab.exercises.grading import mistake

__all__: list[str] = []


def _reduce(forward: bool, backward: bool, axis):
    """An autograd function that all-reduces in the directions asked for."""
    from dtlab import comm

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x.clone()
            if forward:
                comm.all_reduce(y, group=axis)
            return y

        @staticmethod
        def backward(ctx, grad):
            g = grad.clone()
            if backward:
                comm.all_reduce(g, group=axis)
            return g

    return Reduce.apply


# ---- column_parallel -----------------------------------------------------------------
@mistake("column_parallel", expect="never gathers its weight")
def gathers_the_weight_then_slices(x, weight_shard, bias_shard, axis):
    """All-gathers the whole weight, multiplies, keeps its columns: right numbers
    (the old checker passed it) for t times the memory and the work."""
    from dtlab import comm

    t = axis.size
    w = torch.empty(t * weight_shard.shape[0], weight_shard.shape[1])
    comm.all_gather(w, weight_shard.detach(), group=axis)
    y = x @ w.T
    return y.chunk(t, -1)[axis.index] + bias_shard + 0 * weight_shard.sum()


@mistake("column_parallel", expect="f all-reduces dL/dX once")
def forgets_f(x, weight_shard, bias_shard, axis):
    """No f in front: the output is right, but each rank's dL/dX is only its
    share of the sum."""
    return x @ weight_shard.T + bias_shard


@mistake("column_parallel", expect="f is the identity forward")
def uses_g_instead_of_f(x, weight_shard, bias_shard, axis):
    """Megatron's g where f belongs: all-reduces the input forward (t copies of X
    summed) and nothing backward."""
    return _reduce(True, False, axis)(x) @ weight_shard.T + bias_shard


@mistake("column_parallel", expect="dtlab.tensor_parallel.copy_to_tp")
def calls_the_library_f(x, weight_shard, bias_shard, axis):
    """dtlab's own f: right numbers, nothing written."""
    from dtlab.tensor_parallel import copy_to_tp

    return copy_to_tp(x, axis) @ weight_shard.T + bias_shard


# ---- row_parallel --------------------------------------------------------------------
@mistake("row_parallel", expect="carries the bias")
def adds_the_bias_before_the_sum(x_shard, weight_shard, bias, axis):
    """Adds the bias to every rank's partial output, then sums: t biases."""
    return _reduce(True, False, axis)(x_shard @ weight_shard.T + bias)


@mistake("row_parallel", expect="g all-reduces the partial outputs once")
def uses_f_instead_of_g(x_shard, weight_shard, bias, axis):
    """Megatron's f where g belongs: identity forward, all-reduce backward. Each
    rank returns only its share of Y."""
    return _reduce(False, True, axis)(x_shard @ weight_shard.T) + bias


@mistake("row_parallel", expect="g's backward is the identity")
def all_reduces_both_ways(x_shard, weight_shard, bias, axis):
    """All-reduces forward *and* backward: the gradients come out t times too big."""
    return _reduce(True, True, axis)(x_shard @ weight_shard.T) + bias


@mistake("row_parallel", expect="never gathers a weight")
def gathers_the_weight_and_the_input(x_shard, weight_shard, bias, axis):
    """All-gathers the input and the weight, and computes the whole layer on every
    rank: right output, t times the memory and the work."""
    from dtlab import comm

    t = axis.size
    w = torch.empty(t * weight_shard.shape[1], weight_shard.shape[0])
    comm.all_gather(w, weight_shard.detach().T.contiguous(), group=axis)
    x = torch.empty(t * x_shard.numel())
    comm.all_gather(x, x_shard.detach().reshape(-1), group=axis)
    x = torch.cat(x.view(t, *x_shard.shape).unbind(0), dim=-1)  # (…, in)
    return x @ w + bias


@mistake("row_parallel", expect="dtlab.tensor_parallel.reduce_from_tp")
def calls_the_library_g(x_shard, weight_shard, bias, axis):
    """dtlab's own g: right numbers, nothing written."""
    from dtlab.tensor_parallel import reduce_from_tp

    return reduce_from_tp(x_shard @ weight_shard.T, axis) + bias


# ---- sequence_parallel ---------------------------------------------------------------
def _sequence_ops(axis, *, dim=1, g_backward=True):
    """Korthikanti's g and ḡ along ``dim``; ``g_backward=False``: g's backward
    only slices, without the reduce-scatter."""
    from dtlab import comm

    t = axis.size

    def gather(x):
        x = x.contiguous()
        out = torch.empty((t * x.shape[0], *x.shape[1:]))
        comm.all_gather(out, x, group=axis)
        return torch.cat(out.chunk(t), dim=dim)

    def scatter(x):
        out = torch.empty_like(
            x.chunk(t, dim)[0], memory_format=torch.contiguous_format
        )
        comm.reduce_scatter(out, torch.cat(x.chunk(t, dim), dim=0), group=axis)
        return out

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return gather(x)

        @staticmethod
        def backward(ctx, grad):
            if g_backward:
                return scatter(grad)
            return grad.chunk(t, dim)[axis.index].contiguous()

    class GBar(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return scatter(x)

        @staticmethod
        def backward(ctx, grad):
            return gather(grad)

    return G.apply, GBar.apply


@mistake("sequence_parallel", expect="replaces each all-reduce by its halves")
def keeps_the_all_reduce(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """Gathers the sequence, then all-reduces the output as plain TP does and keeps
    its tokens: the all-reduce's bytes plus an all-gather's."""
    g, _ = _sequence_ops(axis)
    h = F.gelu(g(x_shard) @ w_fc.T + b_fc)
    y = _reduce(True, False, axis)(h @ w_proj.T)
    return y.chunk(axis.size, 1)[axis.index] + b_proj


@mistake("sequence_parallel", expect="a weight was gathered")
def gathers_the_weights(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """Gathers fc's and proj's shards and runs the whole MLP on this rank's tokens:
    no activation moves, every weight does (and all of it sits on every rank)."""
    from dtlab import comm

    t = axis.size
    fc_w = torch.empty(t * w_fc.shape[0], w_fc.shape[1])
    comm.all_gather(fc_w, w_fc.detach(), group=axis)
    fc_b = torch.empty(t * b_fc.shape[0])
    comm.all_gather(fc_b, b_fc.detach(), group=axis)
    proj_w = torch.empty(t * w_proj.shape[1], w_proj.shape[0])
    comm.all_gather(proj_w, w_proj.detach().T.contiguous(), group=axis)
    return F.gelu(x_shard @ fc_w.T + fc_b) @ proj_w + b_proj


@mistake("sequence_parallel", expect="sequence dimension (dim 1)")
def splits_the_batch(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """ḡ scatters along the batch (dim 0) instead of the sequence."""
    g, _ = _sequence_ops(axis)
    _, gbar_batch = _sequence_ops(axis, dim=0)
    h = F.gelu(g(x_shard) @ w_fc.T + b_fc)
    return gbar_batch(h @ w_proj.T) + b_proj


@mistake("sequence_parallel", expect="the backward ran")
def gathers_without_scattering_back(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """g's backward keeps this rank's slice of the gradient without summing: every
    rank's dL/dX is only a partial sum over its columns."""
    g, gbar = _sequence_ops(axis, g_backward=False)
    h = F.gelu(g(x_shard) @ w_fc.T + b_fc)
    return gbar(h @ w_proj.T) + b_proj


@mistake("sequence_parallel", expect="carries proj's bias")
def adds_the_bias_before_the_scatter(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """Adds proj's bias to the partial outputs, then reduce-scatters: t biases."""
    g, gbar = _sequence_ops(axis)
    h = F.gelu(g(x_shard) @ w_fc.T + b_fc)
    return gbar(h @ w_proj.T + b_proj)

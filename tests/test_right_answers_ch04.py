"""Chapter 04: right answers written differently from the references are
accepted by column_parallel, row_parallel and sequence_parallel, and a few wrong
answers a learner would write are rejected with a message that names the cause
(a gradient t times too small, a bias gradient missing, tokens in the wrong
place).

Each right answer was written from what the learner sees (the notebook's stub,
the section's markdown and the checker's ``measures=`` line) before the
reference or the checker's body was read. The catalogues' own wrong answers are
proven in tests/test_exercises.py. (Answers travel to the engines by value: each
imports what it uses.)"""

import pytest

from dtlab.exercises import (
    ExerciseFailed,
    check_column_parallel,
    check_row_parallel,
    check_sequence_parallel,
)
from dtlab.lab.kernel.shipping import ship_by_value

pytestmark = pytest.mark.cluster


# ---- ch04 column_parallel -----------------------------------------------------------
def column_identity_view_then_linear(x, weight_shard, bias_shard, axis):
    """f returns a view of x forward, all-reduces a copy backward; F.linear."""
    import torch
    import torch.nn.functional as F

    from dtlab import comm

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            total = grad.clone()
            comm.all_reduce(total, group=axis)
            return total

    return F.linear(Copy.apply(x), weight_shard, bias_shard)


def column_whole_layer_in_one_function(x, weight_shard, bias_shard, axis):
    """The linear layer and f in one Function, its backward written by hand: dX
    (all-reduced), dA_i and db_i from the flattened batch."""
    import torch

    from dtlab import comm

    class ColumnLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x, w)
            return x @ w.t() + b

        @staticmethod
        def backward(ctx, gy):
            x, w = ctx.saved_tensors
            dx = gy @ w
            comm.all_reduce(dx, group=axis)
            g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
            return dx, g2.t() @ x2, g2.sum(0)

    return ColumnLinear.apply(x, weight_shard, bias_shard)


def column_einsum_and_a_future(x, weight_shard, bias_shard, axis):
    """einsum for the product; f's backward all-reduces asynchronously and waits
    on the handle's future."""
    import torch

    from dtlab import comm

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            out = grad.contiguous().clone()
            comm.all_reduce(out, group=axis, async_op=True).get_future().wait()
            return out

    return torch.einsum("...i,oi->...o", F.apply(x), weight_shard) + bias_shard


def column_via_a_tensor_hook(x, weight_shard, bias_shard, axis):
    """No autograd.Function: f is a view of x whose gradient hook all-reduces a
    copy of dL/dX and returns it."""
    import torch.nn.functional as F

    from dtlab import comm

    x_f = x.view_as(x)

    def reduce(grad):
        total = grad.clone()
        comm.all_reduce(total, group=axis)
        return total

    x_f.register_hook(reduce)
    return F.linear(x_f, weight_shard, bias_shard)


def column_averages_dx(x, weight_shard, bias_shard, axis):
    """Wrong: f's backward divides the all-reduced dL/dX by t (an average, as in
    data parallelism)."""
    import torch
    import torch.nn.functional as F

    from dtlab import comm

    class Copy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            total = grad.clone()
            comm.all_reduce(total, group=axis)
            return total / axis.size

    return F.linear(Copy.apply(x), weight_shard, bias_shard)


# ---- ch04 row_parallel ---------------------------------------------------------
def row_g_then_bias(x_shard, weight_shard, bias, axis):
    """g all-reduces a copy of the partial product; the bias added after it."""
    import torch

    from dtlab import comm

    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            total = partial.clone()
            comm.all_reduce(total, group=axis)
            return total

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Sum.apply(x_shard @ weight_shard.t()) + bias


def row_whole_layer_in_one_function(x_shard, weight_shard, bias, axis):
    """The whole layer in one Function, backward by hand (no communication)."""
    import torch

    from dtlab import comm

    class RowLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            ctx.save_for_backward(x, w)
            y = torch.matmul(x, w.t())
            comm.all_reduce(y, group=axis)
            return y + b

        @staticmethod
        def backward(ctx, gy):
            x, w = ctx.saved_tensors
            g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
            return gy @ w, g2.t() @ x2, g2.sum(0)

    return RowLinear.apply(x_shard, weight_shard, bias)


def row_process_group_and_future(x_shard, weight_shard, bias, axis):
    """The axis's process group passed instead of the Axis, the all-reduce waited
    through its future, torch.add for the bias."""
    import torch
    import torch.nn.functional as F

    from dtlab import comm

    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            out = partial.detach().clone()
            comm.all_reduce(out, group=axis.group, async_op=True).get_future().wait()
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad

    return torch.add(Sum.apply(F.linear(x_shard, weight_shard)), bias)


def row_bias_on_rank_zero(x_shard, weight_shard, bias, axis):
    """Wrong: the bias added before the sum, on the first rank of the group only:
    the output is right, but the other ranks' bias gets no gradient."""
    import torch

    from dtlab import comm

    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            total = partial.clone()
            comm.all_reduce(total, group=axis)
            return total

        @staticmethod
        def backward(ctx, grad):
            return grad

    partial = x_shard @ weight_shard.t()
    if axis.index == 0:
        partial = partial + bias
    return Sum.apply(partial)


def row_bias_split_t_ways(x_shard, weight_shard, bias, axis):
    """Wrong: bias/t added on every rank before the sum: the output is right, the
    bias's gradient t times too small."""
    import torch

    from dtlab import comm

    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, partial):
            total = partial.clone()
            comm.all_reduce(total, group=axis)
            return total

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Sum.apply(x_shard @ weight_shard.t() + bias / axis.size)


# ---- ch04 sequence_parallel --------------------------------------------------------
def sp_sequence_first(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """The sequence dimension moved to the front with transpose, gathered or
    scattered along dim 0, moved back."""
    import torch
    import torch.nn.functional as F

    from dtlab import comm

    t = axis.size

    def gather_seq(a):  # (B, T/t, C) -> (B, T, C)
        a = a.transpose(0, 1).contiguous()
        out = a.new_empty((t * a.shape[0], *a.shape[1:]))
        comm.all_gather(out, a, group=axis)
        return out.transpose(0, 1)

    def scatter_seq(a):  # (B, T, C) summed over ranks -> (B, T/t, C)
        a = a.transpose(0, 1).contiguous()
        out = a.new_empty((a.shape[0] // t, *a.shape[1:]))
        comm.reduce_scatter(out, a, group=axis)
        return out.transpose(0, 1)

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return gather_seq(a)

        @staticmethod
        def backward(ctx, g):
            return scatter_seq(g)

    class GBar(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return scatter_seq(a)

        @staticmethod
        def backward(ctx, g):
            return gather_seq(g)

    h = F.gelu(F.linear(G.apply(x_shard), w_fc, b_fc))
    return GBar.apply(F.linear(h, w_proj)) + b_proj


def sp_batch_blocks_rearranged(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """No transpose of the activations: gathered along the batch (t·B, T/t, C) and
    rearranged with view/permute; the reduce-scatter's input built as t blocks of
    this rank's (B, T/t, C) token ranges; async ops waited on their handles."""
    import torch
    import torch.nn.functional as F

    from dtlab import comm

    t = axis.size

    def gather(a):
        b, s, c = a.shape
        out = a.new_empty(t * b, s, c)
        comm.all_gather(out, a.contiguous(), group=axis, async_op=True).wait()
        return out.view(t, b, s, c).permute(1, 0, 2, 3).reshape(b, t * s, c)

    def scatter(a):
        b, full, c = a.shape
        s = full // t
        blocks = a.reshape(b, t, s, c).permute(1, 0, 2, 3).reshape(t * b, s, c)
        out = a.new_empty(b, s, c)
        comm.reduce_scatter(out, blocks, group=axis, async_op=True).wait()
        return out

    class Gsp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return gather(a)

        @staticmethod
        def backward(ctx, g):
            return scatter(g)

    class GbarSp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return scatter(a)

        @staticmethod
        def backward(ctx, g):
            return gather(g)

    hidden = F.gelu(Gsp.apply(x_shard) @ w_fc.t() + b_fc)
    return GbarSp.apply(hidden @ w_proj.t()) + b_proj


def sp_scatters_the_batch(x_shard, w_fc, b_fc, w_proj, b_proj, axis):
    """Wrong: the sequence dimension never moved to the front: the reduce-scatter
    splits the batch, and its (B/t, T, C) is reshaped into (B, T/t, C)."""
    import torch
    import torch.nn.functional as F

    from dtlab import comm

    t = axis.size

    def gather(a):
        a = a.transpose(0, 1).contiguous()
        out = a.new_empty((t * a.shape[0], *a.shape[1:]))
        comm.all_gather(out, a, group=axis)
        return out.transpose(0, 1)

    def scatter(a):
        b, s, c = a.shape
        out = a.new_empty(b // t, s, c)
        comm.reduce_scatter(out, a.contiguous(), group=axis)
        return out.reshape(b, s // t, c)

    class G(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return gather(a)

        @staticmethod
        def backward(ctx, g):
            return scatter(g)

    class GBar(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return scatter(a)

        @staticmethod
        def backward(ctx, g):
            return gather(g)

    h = F.gelu(F.linear(G.apply(x_shard), w_fc, b_fc))
    return GBar.apply(F.linear(h, w_proj)) + b_proj


for _answer in (
    column_identity_view_then_linear,
    column_whole_layer_in_one_function,
    column_einsum_and_a_future,
    column_via_a_tensor_hook,
    column_averages_dx,
    row_g_then_bias,
    row_whole_layer_in_one_function,
    row_process_group_and_future,
    row_bias_on_rank_zero,
    row_bias_split_t_ways,
    sp_sequence_first,
    sp_batch_blocks_rearranged,
    sp_scatters_the_batch,
):
    ship_by_value(_answer)


@pytest.mark.parametrize(
    "answer",
    [
        column_identity_view_then_linear,
        column_whole_layer_in_one_function,
        column_einsum_and_a_future,
        column_via_a_tensor_hook,
    ],
)
def test_column_parallel_accepts_other_right_answers(answer, lab_cluster):
    assert check_column_parallel(answer, lab_cluster(4)).passed


def test_column_parallel_names_an_averaged_dx(lab_cluster):
    with pytest.raises(
        ExerciseFailed, match=r"dL/dX is off by .* It is 1/2 of the right one"
    ):
        check_column_parallel(column_averages_dx, lab_cluster(4))


@pytest.mark.parametrize(
    "answer",
    [row_g_then_bias, row_whole_layer_in_one_function, row_process_group_and_future],
)
def test_row_parallel_accepts_other_right_answers(answer, lab_cluster):
    assert check_row_parallel(answer, lab_cluster(4)).passed


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (row_bias_on_rank_zero, r"dL/dbias is missing \(None\)\. b is whole"),
        (row_bias_split_t_ways, r"dL/dbias is off by .* It is 1/2 of the right one"),
    ],
)
def test_row_parallel_names_the_bias_gradient(answer, cause, lab_cluster):
    with pytest.raises(ExerciseFailed, match=cause):
        check_row_parallel(answer, lab_cluster(4))


@pytest.mark.parametrize("answer", [sp_sequence_first, sp_batch_blocks_rearranged])
def test_sequence_parallel_accepts_other_right_answers(answer, lab_cluster):
    assert check_sequence_parallel(answer, lab_cluster(4)).passed


def test_sequence_parallel_names_the_scattered_dimension(lab_cluster):
    with pytest.raises(ExerciseFailed, match="right output, but of other tokens"):
        check_sequence_parallel(sp_scatters_the_batch, lab_cluster(4))

"""Chapter 03: right answers written differently from the references are
accepted by zero2_hooks and fsdp_unit, and a few wrong answers a learner would
write are rejected with a message that names the cause.

Each right answer was written from what the learner sees (the notebook's stub,
the exercise's markdown and the checker's ``measures=`` line) before the
reference or the checker's body was read. The catalogues' own wrong answers are
proven in tests/test_exercises_ch03.py. (Answers travel to the engines by value:
each imports what it uses.)"""

import pytest

from dtlab.exercises import ExerciseFailed, check_fsdp_unit, check_zero2_hooks
from dtlab.lab.kernel.shipping import ship_by_value

pytestmark = pytest.mark.cluster


# ---- ch03 zero2_hooks ---------------------------------------------------------------
def zero2_padded_by_hand(model, grad_shards):
    """A zero buffer of N·S, the gradient copied in, divided, reduce-scattered."""
    import torch

    from dtlab import comm

    n = comm.group_size()

    def hook_for(i):
        def hook(p):
            shard = grad_shards[i]
            padded = torch.zeros(n * shard.numel(), dtype=p.grad.dtype)
            padded[: p.numel()] = p.grad.reshape(-1)
            padded.div_(n)
            comm.reduce_scatter(shard, padded)
            p.grad = None

        return hook

    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(hook_for(i))


def zero2_pad_then_divide_the_slice(model, grad_shards):
    """F.pad for the padding, the division on the slice after the sum, an async
    reduce-scatter waited at once on its handle (gloo's reduce-scatter has no
    future: ``Work::getFuture not implemented``)."""
    import torch.nn.functional as F

    from dtlab import comm

    n = comm.group_size()
    index = {id(p): i for i, p in enumerate(model.parameters())}

    def hook(p):
        shard = grad_shards[index[id(p)]]
        flat = p.grad.detach().flatten()
        flat = F.pad(flat, (0, n * shard.numel() - flat.numel()))
        p.grad = None
        comm.reduce_scatter(shard, flat, async_op=True).wait()
        shard.div_(n)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def zero2_reduces_the_sum(model, grad_shards):
    """Wrong: the slices hold the sum over ranks, never divided by N."""
    import torch

    from dtlab import comm

    n = comm.group_size()
    for i, p in enumerate(model.parameters()):

        def hook(q, shard=grad_shards[i]):
            padded = torch.zeros(n * shard.numel())
            padded[: q.numel()] = q.grad.reshape(-1)
            comm.reduce_scatter(shard, padded)
            q.grad = None

        p.register_post_accumulate_grad_hook(hook)


# ---- ch03 fsdp_unit ---------------------------------------------------------------
def fsdp_gradient_returned_to_autograd(x, shard, compute):
    """An autograd.Function whose backward returns the shard's gradient, so
    autograd itself puts it in shard.grad; the input re-run under enable_grad."""
    import torch

    from dtlab import comm

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            n = comm.group_size()
            full = shard.new_empty(n * shard.numel())
            comm.all_gather(full, shard.detach())
            out = compute(full, x)
            ctx.save_for_backward(x, shard)
            return out

        @staticmethod
        def backward(ctx, grad_out):
            x, shard = ctx.saved_tensors
            n = comm.group_size()
            full = shard.new_empty(n * shard.numel())
            comm.all_gather(full, shard.detach())
            full.requires_grad_()
            x_in = x.detach().requires_grad_(ctx.needs_input_grad[0])
            with torch.enable_grad():
                out = compute(full, x_in)
            torch.autograd.backward(out, grad_out)
            grad_full = full.grad
            del full, out
            grad_full.div_(n)
            grad_shard = torch.empty_like(shard)
            comm.reduce_scatter(grad_shard, grad_full)
            return (x_in.grad if ctx.needs_input_grad[0] else None), grad_shard

    return Unit.apply(x, shard)


def fsdp_sets_shard_grad_with_autograd_grad(x, shard, compute):
    """shard.grad assigned (or added to) by hand, torch.autograd.grad for the
    re-run, the gathers launched async and waited through their handles."""
    import torch

    from dtlab import comm

    n = comm.group_size()

    def gather():
        full = torch.empty(n * shard.numel(), dtype=shard.dtype)
        comm.all_gather(full, shard.detach(), async_op=True).wait()
        return full

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, _shard):
            ctx.save_for_backward(x)
            return compute(gather(), x)

        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            full = gather().requires_grad_()
            xin = x.detach().requires_grad_()
            with torch.enable_grad():
                out = compute(full, xin)
                g_full, g_x = torch.autograd.grad(
                    out, (full, xin), grad_out, allow_unused=True
                )
            del full, out
            mine = torch.empty_like(shard)
            comm.reduce_scatter(mine, g_full / n)
            del g_full
            if shard.grad is None:
                shard.grad = mine
            else:
                shard.grad += mine
            return g_x, None

    return Unit.apply(x, shard)


def fsdp_storage_freed_and_refilled(x, shard, compute):
    """FSDP1's way, no autograd.Function: one full flat leaf whose storage is freed
    (resize_(0)) after forward and refilled by a hook on the unit's output when
    backward reaches the unit; the gather writes through ``.data`` so the saved
    views' version counter stays valid; a post-accumulate hook reduce-scatters."""
    import torch

    from dtlab import comm

    n = comm.group_size()
    full = torch.empty(n * shard.numel(), dtype=shard.dtype)
    comm.all_gather(full, shard.detach())
    full.requires_grad_()
    nbytes = full.untyped_storage().nbytes()

    def regather(grad):
        full.untyped_storage().resize_(nbytes)
        comm.all_gather(full.data, shard.detach())

    def reduce(p):
        mine = torch.empty_like(shard)
        comm.reduce_scatter(mine, p.grad / n)
        p.grad = None
        p.untyped_storage().resize_(0)
        shard.grad = mine if shard.grad is None else shard.grad + mine

    full.register_post_accumulate_grad_hook(reduce)
    out = compute(full, x)
    full.untyped_storage().resize_(0)
    if out.requires_grad:
        out.register_hook(regather)
    return out


def fsdp_regathers_only_when_unpacked(x, shard, compute):
    """As above, but the storage is refilled only when backward unpacks a saved
    view of it (saved_tensors_hooks): a unit whose backward does not need its
    weights (the first, whose input needs no gradient) is never gathered again."""
    import torch

    from dtlab import comm

    n = comm.group_size()
    full = torch.empty(n * shard.numel(), dtype=shard.dtype)
    comm.all_gather(full, shard.detach())
    full.requires_grad_()
    nbytes, ptr = full.untyped_storage().nbytes(), full.untyped_storage().data_ptr()
    gathered = [True]

    def pack(t):
        return t.untyped_storage().data_ptr() == ptr, t

    def unpack(packed):
        ours, t = packed
        if ours and not gathered[0]:
            full.untyped_storage().resize_(nbytes)
            comm.all_gather(full.data, shard.detach())
            gathered[0] = True
        return t

    def reduce(p):
        mine = torch.empty_like(shard)
        comm.reduce_scatter(mine, p.grad / n)
        p.grad = None
        p.untyped_storage().resize_(0)
        shard.grad = mine if shard.grad is None else shard.grad + mine

    full.register_post_accumulate_grad_hook(reduce)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = compute(full, x)
    full.untyped_storage().resize_(0)
    gathered[0] = False
    return out


def fsdp_keeps_the_gather_for_backward(x, shard, compute):
    """Wrong: the gathered parameters are saved for backward instead of gathered
    again, so every unit's full parameters stay alive until its backward."""
    import torch

    from dtlab import comm

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            n = comm.group_size()
            full = shard.new_empty(n * shard.numel())
            comm.all_gather(full, shard.detach())
            ctx.save_for_backward(x, full)
            return compute(full, x)

        @staticmethod
        def backward(ctx, grad_out):
            x, full = ctx.saved_tensors
            n = comm.group_size()
            full = full.detach().requires_grad_()
            x_in = x.detach().requires_grad_()
            with torch.enable_grad():
                torch.autograd.backward(compute(full, x_in), grad_out)
            mine = torch.empty(full.numel() // n)
            comm.reduce_scatter(mine, full.grad / n)
            return x_in.grad, mine

    return Unit.apply(x, shard)


for _answer in (
    zero2_padded_by_hand,
    zero2_pad_then_divide_the_slice,
    zero2_reduces_the_sum,
    fsdp_gradient_returned_to_autograd,
    fsdp_sets_shard_grad_with_autograd_grad,
    fsdp_storage_freed_and_refilled,
    fsdp_regathers_only_when_unpacked,
    fsdp_keeps_the_gather_for_backward,
):
    ship_by_value(_answer)


@pytest.mark.parametrize(
    "answer", [zero2_padded_by_hand, zero2_pad_then_divide_the_slice]
)
def test_zero2_hooks_accepts_other_right_answers(answer, lab_cluster):
    assert check_zero2_hooks(answer, lab_cluster(4)).passed


def test_zero2_hooks_names_a_sum_for_an_average(lab_cluster):
    with pytest.raises(
        ExerciseFailed, match="the sum of the ranks' gradients, not their average"
    ):
        check_zero2_hooks(zero2_reduces_the_sum, lab_cluster(4))


@pytest.mark.parametrize(
    "answer",
    [
        fsdp_gradient_returned_to_autograd,
        fsdp_sets_shard_grad_with_autograd_grad,
        fsdp_storage_freed_and_refilled,
    ],
)
def test_fsdp_unit_accepts_other_right_answers(answer, lab_cluster):
    assert check_fsdp_unit(answer, lab_cluster(4)).passed


def test_fsdp_unit_names_a_gather_kept_for_backward(lab_cluster):
    with pytest.raises(ExerciseFailed, match="re-gather in backward"):
        check_fsdp_unit(fsdp_keeps_the_gather_for_backward, lab_cluster(4))


def test_fsdp_unit_accepts_a_lazy_regather(lab_cluster):
    assert check_fsdp_unit(fsdp_regathers_only_when_unpacked, lab_cluster(4)).passed

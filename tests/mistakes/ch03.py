"""The mistakes learners make in chapter 03's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it;
``tests/test_exercises_ch03.py`` for ``fully_shard``)."""

from __future__ import annotations

import torch

from dtlab.exercises import ch03_fsdp2, ch03_zero  # noqa: F401 - declare the exercises
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- zero1_step ----------------------------------------------------------------------
def _adamw_slice(p, g, state, lr, betas, eps, weight_decay, *, decoupled=True):
    """AdamW on one slice, shared by the mistakes below (each wrong elsewhere)."""
    if not state:
        state.update(
            step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
        )
    b1, b2 = betas
    state["step"] += 1
    t = state["step"]
    if decoupled:
        p.mul_(1 - lr * weight_decay)
    else:
        g = g + weight_decay * p  # Adam's L2 penalty, rescaled by the moments
    state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt().add_(eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**t))


@mistake("zero1_step", expect="no reduce-scatter")
def steps_with_its_own_gradient(
    flat_param, flat_grad, state, lr, betas, eps, weight_decay
):
    """Slices its *own* gradient: with identical gradients on every rank (the old
    exercise's data) nobody noticed; with the ranks' own gradients they diverge."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    p = flat_param[r * S : (r + 1) * S].clone()
    _adamw_slice(p, flat_grad[r * S : (r + 1) * S], state, lr, betas, eps, weight_decay)
    comm.all_gather(flat_param, p)


@mistake("zero1_step", expect="Reduce-scatter instead")
def all_reduces_the_gradient(
    flat_param, flat_grad, state, lr, betas, eps, weight_decay
):
    """All-reduces the whole gradient to use one slice of it: right numbers, twice
    the traffic, and a full gradient buffer on every rank."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    g = flat_grad.clone()
    comm.all_reduce(g)
    p = flat_param[r * S : (r + 1) * S].clone()
    _adamw_slice(p, g[r * S : (r + 1) * S] / n, state, lr, betas, eps, weight_decay)
    comm.all_gather(flat_param, p)


def _zero1(
    flat_param,
    flat_grad,
    state,
    lr,
    betas,
    eps,
    weight_decay,
    *,
    mean=True,
    decoupled=True,
    full_state=False,
):
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    g = torch.empty(S)
    comm.reduce_scatter(g, flat_grad.clone())
    if mean:
        g /= n
    p = flat_param[r * S : (r + 1) * S].clone()
    if full_state:  # moments for all Ψ, of which only the slice is ever used
        if not state:
            state.update(
                step=0, exp_avg=torch.zeros(n * S), exp_avg_sq=torch.zeros(n * S)
            )
        view = {
            "step": state["step"],
            "exp_avg": state["exp_avg"][r * S : (r + 1) * S],
            "exp_avg_sq": state["exp_avg_sq"][r * S : (r + 1) * S],
        }
        _adamw_slice(p, g, view, lr, betas, eps, weight_decay)
        state["step"] = view["step"]
    else:
        _adamw_slice(p, g, state, lr, betas, eps, weight_decay, decoupled=decoupled)
    comm.all_gather(flat_param, p)


@mistake("zero1_step", expect="sum of the ranks' gradients")
def sums_the_gradients(flat_param, flat_grad, state, lr, betas, eps, weight_decay):
    """Reduce-scatters and forgets to divide by N."""
    _zero1(flat_param, flat_grad, state, lr, betas, eps, weight_decay, mean=False)


@mistake("zero1_step", expect="weight decay is missing")
def forgets_the_weight_decay(
    flat_param, flat_grad, state, lr, betas, eps, weight_decay
):
    """The old exercise had weight_decay=0, so its update rule never decayed."""
    _zero1(flat_param, flat_grad, state, lr, betas, eps, 0.0)


@mistake("zero1_step", expect="Adam's L2 penalty")
def adds_l2_to_the_gradient(flat_param, flat_grad, state, lr, betas, eps, weight_decay):
    """Adds λ·θ to the gradient (Adam's weight_decay), not AdamW's decoupled decay."""
    _zero1(flat_param, flat_grad, state, lr, betas, eps, weight_decay, decoupled=False)


@mistake("zero1_step", expect="optimizer-state values")
def keeps_the_whole_state(flat_param, flat_grad, state, lr, betas, eps, weight_decay):
    """Right update, but moments for all Ψ on every rank: nothing saved."""
    _zero1(flat_param, flat_grad, state, lr, betas, eps, weight_decay, full_state=True)


@mistake("zero1_step", expect="slices of larger buffers")
def keeps_the_moments_as_slices_of_full_buffers(
    flat_param, flat_grad, state, lr, betas, eps, weight_decay
):
    """Allocates each moment for all Ψ and keeps only its slice, a view: the state
    shows S values per moment, but each view keeps its Ψ-sized buffer allocated."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    if not state:
        mine = slice(r * S, (r + 1) * S)
        state.update(
            step=0,
            exp_avg=torch.zeros(n * S)[mine],
            exp_avg_sq=torch.zeros(n * S)[mine],
        )
    _zero1(flat_param, flat_grad, state, lr, betas, eps, weight_decay)


# ---- zero2_hooks ---------------------------------------------------------------------
def _zero2(
    model,
    grad_shards,
    *,
    reduce="scatter",
    free=True,
    mean=True,
    pad=True,
    at_the_end=False,
):
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}  # tensors compare elementwise
    ready = []

    def reduce_one(param, shard):
        flat = torch.zeros(shard.numel() * n) if pad else param.grad.reshape(-1).clone()
        flat[: param.numel()] = param.grad.reshape(-1)
        if reduce == "scatter":
            comm.reduce_scatter(shard, flat)
        else:
            comm.all_reduce(flat)
            shard.copy_(flat.chunk(n)[r])
        if mean:
            shard.div_(n)
        if free:
            param.grad = None

    def hook(param):
        if not at_the_end:
            reduce_one(param, grad_shards[index[id(param)]])
            return
        ready.append(param)
        if len(ready) == len(params):  # the last gradient: now reduce them all
            for q in ready:
                reduce_one(q, grad_shards[index[id(q)]])
            ready.clear()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


@mistake("zero2_hooks", expect="all-reduced a gradient")
def all_reduces_then_slices(model, grad_shards):
    """All-reduces each gradient and keeps its slice: the traffic of DDP and, while
    it runs, a full averaged gradient on every rank."""
    _zero2(model, grad_shards, reduce="all")


@mistake("zero2_hooks", expect="still holds the full gradient")
def never_frees_the_gradient(model, grad_shards):
    """Reduce-scatters but keeps p.grad: ZeRO-2's saving never happens."""
    _zero2(model, grad_shards, free=False)


@mistake("zero2_hooks", expect="not all at the end")
def reduces_everything_at_the_end(model, grad_shards):
    """Waits for the last gradient, then reduce-scatters and frees them all: every
    full gradient was alive at once."""
    _zero2(model, grad_shards, at_the_end=True)


@mistake("zero2_hooks", expect="not their average")
def sums_the_slices(model, grad_shards):
    """Reduce-scatters and forgets to divide by N."""
    _zero2(model, grad_shards, mean=False)


@mistake("zero2_hooks", expect="reduce_scatter: input has")
def forgets_the_padding(model, grad_shards):
    """Reduce-scatters the gradient as it is: a bias of 30 does not cut into 4."""
    _zero2(model, grad_shards, pad=False)


@mistake("zero2_hooks", expect="p.grad is None, yet")
def keeps_a_view_of_each_gradient(model, grad_shards):
    """Reduce-scatters and frees p.grad, but keeps this rank's slice of its local
    gradient for a norm later, as ``grad.view(-1)[lo:hi]`` without a clone: a few
    elements shown, the whole gradient kept allocated."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    local = {}
    for i, (p, shard) in enumerate(zip(model.parameters(), grad_shards)):

        def hook(param, i=i, shard=shard):
            g = param.grad.view(-1)
            flat = torch.zeros(shard.numel() * n)
            flat[: g.numel()] = g
            comm.reduce_scatter(shard, flat)
            shard.div_(n)
            local[i] = g[r * shard.numel() : (r + 1) * shard.numel()]  # a view
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


@mistake("zero2_hooks", expect="buffers you reduced")
def keeps_a_padded_buffer_per_parameter(model, grad_shards):
    """One padded buffer allocated per parameter and kept for the next step (as
    DDP's buckets are): p.grad is freed, but the copies hold every gradient."""
    from dtlab import comm

    n = comm.group_size()
    buffers = [torch.zeros(s.numel() * n) for s in grad_shards]
    for p, shard, flat in zip(model.parameters(), grad_shards, buffers):

        def hook(param, shard=shard, flat=flat):
            flat.zero_()
            flat[: param.numel()] = param.grad.reshape(-1)
            comm.reduce_scatter(shard, flat)
            shard.div_(n)
            param.grad = None

        p.register_post_accumulate_grad_hook(hook)


# ---- fsdp_unit -----------------------------------------------------------------------
def _gather(shard):
    from dtlab import comm

    full = torch.empty(shard.numel() * comm.group_size())
    comm.all_gather(full, shard.detach())
    return full


@mistake("fsdp_unit", expect="re-gather in backward")
def gathers_through_autograd(x, shard, compute):
    """An all-gather whose backward reduce-scatters, then the plain forward:
    autograd saves the gathered weights for backward, so every unit stays whole."""
    from dtlab import comm

    class AllGather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard):
            return _gather(shard)

        @staticmethod
        def backward(ctx, grad_full):
            g = torch.empty(grad_full.numel() // comm.group_size())
            comm.reduce_scatter(g, grad_full.contiguous())
            return g / comm.group_size()

    return compute(AllGather.apply(shard), x)


def _unit(
    x, shard, compute, *, save_full=False, reduce="scatter", mean=True, input_grad=True
):
    from dtlab import comm

    n = comm.group_size()

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            full = _gather(shard)
            if save_full:  # the mistake: autograd keeps the whole unit alive
                ctx.save_for_backward(x, full)
            else:
                ctx.save_for_backward(x)
            return compute(full, x)

        @staticmethod
        def backward(ctx, grad_y):
            x = ctx.saved_tensors[0].detach().requires_grad_()
            full = _gather(shard).requires_grad_()
            with torch.enable_grad():
                y = compute(full, x)
            grad_x, grad_full = torch.autograd.grad(y, (x, full), grad_y)
            if reduce == "scatter":
                g = torch.empty_like(shard)
                comm.reduce_scatter(g, grad_full)
            else:
                comm.all_reduce(grad_full)
                g = grad_full.chunk(n)[comm.group_rank()].clone()
            return (grad_x if input_grad else None), (g / n if mean else g)

    return Unit.apply(x, shard)


@mistake("fsdp_unit", expect="do not save them for backward")
def keeps_the_gathered_weights(x, shard, compute):
    """Saves the gathered parameters for backward (and gathers them again there
    anyway): all four units are whole at the end of the forward."""
    return _unit(x, shard, compute, save_full=True)


@mistake("fsdp_unit", expect="all-reduced the gradient")
def all_reduces_the_unit_gradient(x, shard, compute):
    """All-reduces the unit's gradient and keeps its slice."""
    return _unit(x, shard, compute, reduce="all")


@mistake("fsdp_unit", expect="not the average")
def forgets_to_average(x, shard, compute):
    """Reduce-scatters the gradient and forgets to divide by N."""
    return _unit(x, shard, compute, mean=False)


@mistake("fsdp_unit", expect="return the input's gradient")
def drops_the_input_gradient(x, shard, compute):
    """Returns None for the input's gradient: the earlier units get nothing."""
    return _unit(x, shard, compute, input_grad=False)


@mistake("fsdp_unit", expect="nor a view or slice of them")
def keeps_a_view_of_the_gathered_weight(x, shard, compute):
    """Gathers again in backward, but keeps the forward's weight matrix for the
    input's gradient, as a detached view ``full.detach()[:W·W].view(W, W)``: the
    gathered tensor itself dies, its storage (the whole unit) does not."""
    from dtlab import comm

    n = comm.group_size()

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            full = _gather(shard)
            width = x.shape[-1]
            ctx.weight = full.detach()[: width * width].view(width, width)
            ctx.save_for_backward(x)
            return compute(full, x)

        @staticmethod
        def backward(ctx, grad_y):
            x = ctx.saved_tensors[0].detach().requires_grad_()
            full = _gather(shard).requires_grad_()
            with torch.enable_grad():
                y = compute(full, x)
            (grad_full,) = torch.autograd.grad(y, (full,), grad_y)
            grad_x = (grad_y * (1 - y.detach() ** 2)) @ ctx.weight
            g = torch.empty_like(shard)
            comm.reduce_scatter(g, grad_full)
            return grad_x, g / n

    return Unit.apply(x, shard)


# ---- fully_shard ---------------------------------------------------------------------
def _policy(reduce_dtype=torch.float32):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)


@mistake("fully_shard", expect="Only the root is a unit")
def wraps_only_the_root(model, mesh):
    """One fully_shard on the whole model: every weight is sharded between steps,
    but the root is one unit, gathered whole before the first layer runs."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh, mp_policy=_policy())
    return model


@mistake("fully_shard", expect="MixedPrecisionPolicy(param_dtype=torch.bfloat16)")
def forgets_the_precision_policy(model, mesh):
    """Blocks and root wrapped, no policy: FSDP2 gathers and computes in fp32,
    twice the bytes on the wire and in the gathered weights."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@mistake("fully_shard", expect="reshard_after_forward=True")
def keeps_the_blocks_gathered(model, mesh):
    """reshard_after_forward=False: one all-gather per unit instead of two (2Ψ of
    traffic), but every block stays whole from its forward to its backward."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=_policy(), reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=_policy(), reshard_after_forward=False)
    return model


@mistake("fully_shard", expect="call fully_shard(model, ...) on the root too")
def forgets_the_root(model, mesh):
    """The blocks only: the embeddings and the final norm stay whole on every
    rank, their gradients never averaged (and, with a bf16 policy on the blocks
    alone, the fp32 head would meet bf16 activations)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=_policy())
    return model


@mistake("fully_shard", expect="finer than the transformer blocks")
def wraps_every_linear(model, mesh):
    """Every Linear its own unit: less gathered at once, but four times the
    collectives, each paying its latency."""
    from torch.distributed.fsdp import fully_shard

    for module in model.blocks.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh, mp_policy=_policy())
    fully_shard(model, mesh=mesh, mp_policy=_policy())
    return model


@mistake("fully_shard", expect="reduce_dtype=torch.float32")
def reduces_in_bf16(model, mesh):
    """param_dtype alone: reduce_dtype defaults to it, so the gradients are summed
    over the ranks in bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model

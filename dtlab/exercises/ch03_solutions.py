"""Chapter 03's reference solutions: ZeRO's three stages, one mechanism each
(Rajbhandari et al. 2020, "ZeRO", §5; Zhao et al. 2023, "PyTorch FSDP", §3).

- stage 1: the sharded optimizer step (reduce-scatter, AdamW on the slice,
  all-gather);
- stage 2: gradient hooks that reduce-scatter each gradient into this rank's slice
  and free the full gradient at once;
- stage 3: an FSDP unit that gathers its parameters for the forward, frees them,
  and gathers them again for the backward;
- the real thing: PyTorch's FSDP2, ``fully_shard`` per transformer block and then
  on the root, with a ``MixedPrecisionPolicy``, so that memory and traffic fit a
  budget.

``dtlab.exercises.solution(name)`` shows each; :mod:`.ch03_zero` checks a
learner's against them.
"""

from __future__ import annotations

import torch

__all__ = ["sharded_adamw_step", "attach_zero2_hooks", "fsdp_unit", "shard_gpt"]


def sharded_adamw_step(
    flat_param,
    flat_grad,
    state,
    lr=1e-2,
    betas=(0.9, 0.95),
    eps=1e-8,
    weight_decay=0.1,
):
    """ZeRO-1's step (ZeRO §5.1). ``flat_param`` (Ψ, padded to a multiple of N) is
    the same on every rank; ``flat_grad`` is *this rank's* gradient. Average the
    gradients and keep this rank's slice (reduce-scatter), run AdamW on the slice
    with ``state`` for the slice only, and all-gather the updated slices into
    ``flat_param`` on every rank."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n  # this rank owns elements [r·S, (r+1)·S)
    g = torch.empty(S)
    comm.reduce_scatter(g, flat_grad.clone())  # the sum over ranks of slice r
    g /= n
    p = flat_param[r * S : (r + 1) * S].clone()  # (S,)
    if not state:  # AdamW's moments, of the slice only: the saving
        state.update(step=0, exp_avg=torch.zeros(S), exp_avg_sq=torch.zeros(S))
    b1, b2 = betas
    state["step"] += 1
    t = state["step"]
    p.mul_(1 - lr * weight_decay)  # decoupled decay (Loshchilov & Hutter): θ shrinks
    state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)  # m ← β₁m + (1−β₁)g
    state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)  # v ← β₂v + (1−β₂)g²
    denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt().add_(eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1**t))
    comm.all_gather(flat_param, p)  # every rank gets every updated slice


def attach_zero2_hooks(model, grad_shards):
    """ZeRO-2's gradient hooks (ZeRO §5.2). ``grad_shards[i]`` is this rank's slice
    (``ceil(numel/N)`` elements) of parameter i's flattened, zero-padded gradient.
    As soon as a parameter's gradient is ready, reduce-scatter it (the average)
    into its slice and free the full gradient, so that no more than about one
    gradient is ever held whole."""
    from dtlab import comm

    n = comm.group_size()
    for p, shard in zip(model.parameters(), grad_shards):

        def reduce(param, shard=shard):
            flat = torch.zeros(shard.numel() * n)  # padded to N slices
            flat[: param.numel()] = param.grad.reshape(-1)
            comm.reduce_scatter(shard, flat)  # this rank's slice of the sum
            shard.div_(n)
            param.grad = None  # the full gradient is freed at once

        p.register_post_accumulate_grad_hook(reduce)


def fsdp_unit(x, shard, compute):
    """ZeRO-3 / FSDP's unit (ZeRO §5.3, FSDP §3.2): ``compute(flat, x)`` needs the
    unit's full flat parameters, of which this rank holds ``shard`` (S elements).
    Gather them for the forward and free them after it; gather them again for the
    backward; reduce-scatter the parameters' gradient (the average) into
    ``shard.grad`` and free again. Between the two, only the shard remains."""
    from dtlab import comm

    n = comm.group_size()

    def gather():
        full = torch.empty(shard.numel() * n)  # (N·S,)
        comm.all_gather(full, shard.detach())
        return full

    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard):
            y = compute(gather(), x)  # the full parameters die with this line
            ctx.save_for_backward(x)  # the input only, never the parameters
            return y

        @staticmethod
        def backward(ctx, grad_y):
            (x,) = ctx.saved_tensors
            full = gather().requires_grad_()  # gathered again
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                y = compute(full, x)
            grad_x, grad_full = torch.autograd.grad(y, (x, full), grad_y)
            grad_shard = torch.empty_like(shard)
            comm.reduce_scatter(grad_shard, grad_full)  # this rank's slice of the sum
            return grad_x, grad_shard / n

    return Unit.apply(x, shard)


def shard_gpt(model, mesh):
    """FSDP2 on dtlab's GPT, within the chapter's budget (FSDP §3.2, its units;
    torch's ``fully_shard``). Each transformer block becomes its own unit, gathered
    just before it runs, freed after its forward (``reshard_after_forward=True``)
    and gathered again for its backward, so at most the root and about two blocks
    are ever whole; the root call shards what no block owns (the embeddings, the
    tied head, the final norm). The weights travel and compute in bf16 while the
    optimizer steps the fp32 shards; gradients are reduce-scattered in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,  # what is all-gathered and computed with
        reduce_dtype=torch.float32,  # what the gradients are summed in
    )
    for block in model.blocks:  # the blocks first: one unit each
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # then the root, last
    return model

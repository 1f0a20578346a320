"""The cross-entropy of logits split by vocabulary, without ever gathering them.

Taught in chapter 04 (section 5). The column-parallel head of
:class:`~dtlab.tensor_parallel.TensorParallelStage` leaves rank i with the logits of
its ``V'/t`` tokens (Shoeybi et al. 2019, §3, "output embedding"); an all-gather of
``b·s·V`` numbers would undo the memory the split saved, so the loss is computed
from the shards with three all-reduces of one number per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtlab import comm

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy"]


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary (Megatron's
    ``vocab_parallel_cross_entropy``). For one token with logits ``z``:
    ``loss = log Σ_v exp(z_v − m) − (z_target − m)``, ``m = max_v z_v``. Three
    all-reduces of one number per token (max, sum of exps, target logit) replace an
    all-gather of ``V`` numbers per token; backward is local:
    ``dL/dz = softmax(z) − onehot(target)``."""

    @staticmethod
    def forward(ctx, logits, targets, axis, vocab_size, name):
        N, V_local = logits.shape  # (N, V'/t)
        start = axis.index * V_local
        cols = torch.arange(start, start + V_local, device=logits.device)
        if vocab_size is not None and start + V_local > vocab_size:
            # padding columns are no tokens: they must take no probability
            logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
        m = logits.max(dim=-1).values  # (N,)
        if axis.size > 1:
            comm.all_reduce(m, op=comm.ReduceOp.MAX, group=axis, tag=f"{name}:fwd")
        shifted = logits - m.unsqueeze(-1)  # (N, V'/t), all <= 0
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # (N,)
        mine = (targets >= start) & (targets < start + V_local)  # (N,)
        local_t = (targets - start).clamp(0, V_local - 1)
        z_t = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1)  # (N,)
        z_t = torch.where(mine, z_t, torch.zeros_like(z_t))
        if axis.size > 1:
            comm.all_reduce(sum_exp, group=axis, tag=f"{name}:fwd")
            comm.all_reduce(z_t, group=axis, tag=f"{name}:fwd")
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine)
        return sum_exp.log() - z_t  # (N,) per-token loss

    @staticmethod
    def backward(ctx, grad):  # grad: (N,)
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax.clone()  # (N, V'/t)
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    axis,
    vocab_size: int | None = None,
    *,
    name: str = "loss",
) -> torch.Tensor:
    """Mean cross-entropy of ``(..., V'/t)`` logit shards against ``(...)`` targets,
    equal to ``F.cross_entropy`` on the whole logits, which no rank ever holds.
    ``vocab_size`` masks the padding columns of the last rank(s)."""
    V_local = local_logits.shape[-1]
    if targets.shape != local_logits.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} do not match logits "
            f"{tuple(local_logits.shape)} without their last (vocab) dim"
        )
    # in fp32 whatever the logits' dtype (Megatron upcasts them too, unless
    # --fp16-lm-cross-entropy): a 16-bit loss times fp16's scale overflows
    local_logits = local_logits.float()
    if axis.size == 1:  # nothing is split: the plain loss, bit for bit
        z = local_logits[..., :vocab_size] if vocab_size else local_logits
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1))
    losses = VocabParallelCrossEntropy.apply(
        local_logits.reshape(-1, V_local), targets.reshape(-1), axis, vocab_size, name
    )
    return losses.mean()

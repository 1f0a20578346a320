"""Expert parallelism: each rank of the ep group owns ``E/ep`` experts; tokens
travel to their expert's rank by an all-to-all and come back by another.

Taught in chapter 11 (mixture of experts). Lepikhin et al. 2020, "GShard", §2.2
and §3.1: the experts are sharded over devices while everything else is
replicated, and the token exchange is an all-to-all (dispatch), the experts' compute,
and the all-to-all back (combine). Fedus et al. 2021, §2.2 and Figure 3: each rank
routes its own tokens with its own capacity.

The ep ranks are data-parallel ranks as well (ep is folded into dp): each routes a
different microbatch. Per MoE layer a rank

1. tells every rank how many rows it sends to each expert (an all-gather of its
   ``(E,)`` counts; every rank then knows the whole ``(ep, E)`` matrix, so the
   all-to-alls need no other handshake);
2. **dispatches**: its rows for rank j's experts go to rank j
   (:func:`dtlab.comm.all_to_all_single` with uneven splits);
3. runs each of its experts once, over the rows of every source rank together;
4. **combines**: the outputs go back where they came from (the same all-to-all,
   transposed). Backward runs the two all-to-alls again, the other way.

Wire bytes per layer: the rows it dispatches to other ranks and the rows its experts
received from them, each twice (forward, and the other all-to-all's gradient
backward), plus the counts
(:func:`dtlab.estimate.ep_bytes_per_layer`).
A hot expert makes its rank receive, and compute, more than the others: the
imbalance factor (:func:`dtlab.estimate.ep_imbalance`).

Gradients (:func:`average_gradients`): the replicated weights (router, attention,
embeddings) get each rank's own tokens' gradient, averaged over ep like dp's; an
expert's gradient already sums every rank's tokens (their output gradients came back
through the all-to-all), so it is divided by ep.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import comm
from dtlab.gradsync import all_reduce_flat
from dtlab.moe.layer import MoE

__all__ = [
    "AllToAll",
    "ExpertParallelDispatch",
    "expert_parallel",
    "expert_parallel_gpt",
    "average_gradients",
]


def _exchange(x, send_rows, recv_rows, group, tag):
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group, tag=tag)
    return out


class AllToAll(torch.autograd.Function):
    """Rows to the other ranks: ``send_rows[j]`` of ``x`` to rank j,
    ``recv_rows[i]`` from rank i, in rank order. Backward sends the gradients back
    the same way, transposed."""

    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group, tag):
        ctx.args = (send_rows, recv_rows, group, tag)
        return _exchange(x, send_rows, recv_rows, group, f"{tag}:fwd")

    @staticmethod
    def backward(ctx, dy):
        send_rows, recv_rows, group, tag = ctx.args
        dx = _exchange(dy, recv_rows, send_rows, group, f"{tag}:bwd")
        return dx, None, None, None, None


class ExpertParallelDispatch:
    """Step 3 of :class:`~dtlab.moe.MoE` across the ep group: rank r holds experts
    ``r·E/ep .. (r+1)·E/ep - 1``."""

    def __init__(self, group, n_experts: int) -> None:
        ep = comm.group_size(group)
        if n_experts % ep:
            raise ValueError(
                f"expert parallelism gives each of ep={ep} ranks n_experts / ep "
                f"experts: n_experts={n_experts} is not a multiple of {ep}"
            )
        self.group, self.ep, self.n_experts = group, ep, n_experts
        per = n_experts // ep
        first = comm.group_rank(group) * per
        self.local = list(range(first, first + per))

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: torch.Tensor):
        ep, E, me = self.ep, self.n_experts, comm.group_rank(self.group)
        per = E // ep
        # 1. the (ep, E) matrix: row s = what rank s sends to each expert
        matrix = counts.new_empty(ep * E)
        comm.all_gather(matrix, counts, self.group, tag=f"{moe.name}.counts")
        matrix = matrix.view(ep, E)
        send = matrix[me].view(ep, per).sum(1).tolist()  # rows to each rank
        mine = matrix[:, self.local]  # (ep, E/ep): from each rank, per local expert
        recv = mine.sum(1).tolist()
        # 2. dispatch: (R, C), by source rank, then expert, then queue order
        arrived = AllToAll.apply(rows, send, recv, self.group, f"{moe.name}.dispatch")
        pieces = arrived.split(mine.flatten().tolist())  # [source * per + local]
        outs = [None] * len(pieces)
        # 3. each local expert once, over the rows of every source
        for i, e in enumerate(self.local):
            which = [s * per + i for s in range(ep)]
            y = moe.experts[str(e)](torch.cat([pieces[j] for j in which]))
            for j, part in zip(which, y.split([len(pieces[j]) for j in which])):
                outs[j] = part
        # 4. combine: back to the ranks the rows came from, in their order
        tag = f"{moe.name}.combine"
        back = AllToAll.apply(torch.cat(outs), recv, send, self.group, tag)
        row_bytes = rows.shape[1] * rows.element_size()
        return back, {"send_bytes": [n * row_bytes for n in send]}


def expert_parallel(moe: MoE, group) -> MoE:
    """Shard ``moe``'s experts over the ep group ``group`` (an Axis, a process
    group or None), in place: this rank keeps its ``E/ep`` experts (the others'
    modules are dropped) and dispatches by all-to-all. Its expert parameters are
    marked ``param.expert_parallel = True``. ep = 1 leaves it as it is."""
    if not isinstance(moe, MoE):
        raise ValueError(f"expert_parallel needs a dtlab.moe.MoE, got {type(moe)}")
    if comm.group_size(group) == 1:
        return moe
    dispatch = ExpertParallelDispatch(group, moe.n_experts)
    for key in list(moe.experts):
        if int(key) not in dispatch.local:
            del moe.experts[key]
    for p in moe.experts.parameters():
        p.expert_parallel = True
    moe.dispatch = dispatch
    return moe


def expert_parallel_gpt(model: nn.Module, group) -> nn.Module:
    """Every MoE layer of a :class:`dtlab.model.GPT` through
    :func:`expert_parallel` (each named after its block, ``blocks.0.mlp``, for its
    events and tags): the entry point for composing ep with the other axes."""
    layers = [(i, b.mlp) for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)]
    if not layers:
        raise ValueError(
            "the model has no MoE layers to shard: build it with "
            "GPTConfig(n_experts=E) for E > 1"
        )
    for i, moe in layers:
        moe.name = f"blocks.{i}.mlp"
        expert_parallel(moe, group)
    return model


def average_gradients(model: nn.Module, group, *, tag: str = "ep/grads") -> None:
    """After ``backward()`` on every ep rank: the gradient of the mean of the ranks'
    losses. The replicated parameters' gradients are averaged over ep (one
    all-reduce of one flat buffer); an expert's already sums every rank's tokens,
    so it is divided by ep."""
    ep = comm.group_size(group)
    if ep == 1:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    replicated = [p.grad for p in params if not getattr(p, "expert_parallel", False)]
    for p in params:
        if getattr(p, "expert_parallel", False):
            p.grad /= ep
    all_reduce_flat(replicated, group, tag=tag, divide_by=ep)

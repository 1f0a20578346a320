"""The global gradient norm on any layout: what gradient clipping and every step's
record measure, each gradient element counted once however the model is spread.

Taught in chapter 07. The rule (:func:`dtlab.parallelize.parallelize` passes the
function this module builds to :class:`dtlab.amp.MixedPrecisionOptimizer`):
tp shards count on every tp rank, tp-replicated parameters on tp index 0 only, a
tied head copy only on the first stage; the squares are summed over tp and pp (and
over dp under ZeRO, where the dp ranks hold disjoint slices; over ep for a mixture
of experts' experts). A plain replica measures it as ``clip_grad_norm_`` does.
"""

from __future__ import annotations

import torch

from dtlab import comm

__all__ = ["global_norm_fn"]


def _counted(parts, module, param) -> bool:
    """Whether this rank counts ``param``'s gradient in the global norm."""
    tp, pp = parts.topo.axis("tp"), parts.topo.axis("pp")
    if getattr(param, "tensor_parallel_dim", None) is None and tp.index:
        return False  # replicated over tp: tp index 0 counts it
    tied_copy = (  # (with pp > 1 the modules are stages: they know their place)
        pp.size > 1
        and parts.config.model.tied_head
        and module.last
        and not module.first
        and param is module.head.weight
    )
    return not tied_copy  # the first stage counts the tied embedding


def _expert_parallel_norm_fn(parts):
    """Every rank holds the dense gradients whole, and its own experts': the
    squares of the experts' are summed over the ep group (the other ep groups
    hold the same experts), the dense ones counted once."""
    ep = parts.topo.axis("ep")
    # in the optimizer's order: the wrappers' trainable parameters
    params = [p for w in parts.wrapped for p in w.parameters() if p.requires_grad]
    expert = [getattr(p, "expert_parallel", False) for p in params]

    def norm_fn(grads) -> float:
        dense = torch.zeros((), dtype=torch.float64, device=parts.device)
        mine = torch.zeros((), dtype=torch.float64, device=parts.device)
        for g, is_expert in zip(grads, expert):
            if g is not None:
                sq = g.detach().double().pow(2).sum()
                if is_expert:
                    mine += sq
                else:
                    dense += sq
        comm.all_reduce(mine, group=ep, tag="grad_norm")
        return float((dense + mine).sqrt())

    return norm_fn


def global_norm_fn(parts):
    """The norm of the gradient spread over this rank's axes: ``None`` for a plain
    replica (the optimizer measures it as ``clip_grad_norm_`` does); under ZeRO over
    dp alone, the wrapper's own norm of its shards; else the squares of the elements
    this rank counts, summed in float64 over every axis that splits them."""
    layout = parts.topo.layout
    if layout.tp == 1 and layout.pp == 1:
        if parts.zero_stage is None and layout.ep > 1:
            return _expert_parallel_norm_fn(parts)
        if parts.zero_stage is None:
            return None
        wrapper = parts.wrapped[0]
        return lambda grads: float(wrapper.clip_grad_norm_(None))
    if parts.zero_stage is None:
        weights = []
        for module in parts.modules:
            seen = set()
            for p in module.parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    weights.append(1.0 if _counted(parts, module, p) else 0.0)
        axes = ("tp", "pp")
    else:
        weights = []  # per local shard: 1 where this rank counts it
        for module, wrapper in zip(parts.modules, parts.wrapped):
            for shard in wrapper.local_shards():
                if shard.tensor.requires_grad:  # what the optimizer steps
                    weights.append(1.0 if _counted(parts, module, shard.param) else 0.0)
        axes = ("shard", "tp", "pp")
    # under ZeRO the shards' group (dp, or HSDP's shard group: its replicas hold
    # the same slices and are not summed again)
    groups = [parts.shard_group if a == "shard" else parts.topo.axis(a) for a in axes]

    def norm_fn(grads) -> float:
        sq = torch.zeros((), dtype=torch.float64, device=parts.device)
        for g, w in zip(grads, weights):
            if g is None:
                continue
            g2 = g.detach().double().pow(2)
            sq += (g2 * w).sum() if torch.is_tensor(w) else w * g2.sum()
        for axis in groups:
            if axis.size > 1:
                comm.all_reduce(sq, group=axis, tag="grad_norm")
        return float(sq.sqrt())

    return norm_fn

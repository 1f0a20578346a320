"""Chapter 13's reference solutions: the DiLoCo meeting, and the read plan of a
checkpoint loaded at another layout. ``dtlab.exercises.solution(name)`` shows each;
:mod:`.ch13_resilience` checks a learner's against them (and against
:class:`dtlab.ft.DiLoCo` and :func:`dtlab.reshard.overlaps`, which they restate)."""

from __future__ import annotations

import torch

from dtlab import comm

__all__ = ["diloco_sync", "load_plan"]


def diloco_sync(params, global_params, outer, group=None):
    """One DiLoCo meeting after H inner steps (Douillard et al. 2023, "DiLoCo:
    Distributed Low-Communication Training of Language Models", Algorithm 1):
    average the pseudo-gradients θ_global − θ_r over the replicas with ONE
    all-reduce of Ψ fp32 values, step ``outer`` (SGD, Nesterov momentum) on
    ``global_params`` with that average as their gradient, and start every replica
    from the new global parameters. The inner optimizer's state never travels."""
    # Δ_r = θ_global − θ_r: how far this replica's H inner steps took it, flat (Ψ,)
    delta = torch.cat(
        [(g - p.detach()).reshape(-1) for p, g in zip(params, global_params)]
    )
    comm.all_reduce(delta, group=group)  # one message of Ψ values: Σ_r Δ_r
    delta /= comm.group_size(group)  # the average, Δ
    offset = 0
    for g in global_params:  # Δ is the global parameters' gradient
        g.grad = delta[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()
    outer.step()  # θ_global ← Nesterov-SGD(θ_global, Δ): once per meeting
    with torch.no_grad():  # params are a model's leaves: no autograd history here
        for p, g in zip(params, global_params):
            p.copy_(g)  # in place: the caller's tensors, not a new list


def load_plan(want, saved):
    """The reads that fill this rank's flat range ``want = (lo, hi)`` of one tensor
    from pieces ``saved`` (half-open ranges of the full tensor, in file order):
    ``(index into saved, offset in that piece, offset in want, length)`` per
    overlap, sorted by offset in want. Raises ValueError when the saved pieces do
    not cover ``want`` (the planning step of a resharding load; dtlab's general
    case, pieces of boxes, is :func:`dtlab.reshard.overlaps`)."""
    lo, hi = want
    if lo > hi:
        raise ValueError(f"want = ({lo}, {hi}) ends before it starts: lo <= hi")
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)  # the overlap [a, b), half-open
        if a < b:  # offsets count from each range's own start
            reads.append((i, a - s_lo, a - lo, b - a))
    reads.sort(key=lambda read: read[2])
    # every element was written once, so the reads do not overlap: walk them and
    # the first element no read starts at is a hole
    filled = 0
    for _, _, at, n in reads:
        if at != filled:
            break
        filled += n
    if filled != hi - lo:
        raise ValueError(
            f"the saved pieces do not cover element {lo + filled} of want "
            f"[{lo}, {hi}): the checkpoint is incomplete"
        )
    return reads

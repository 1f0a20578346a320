"""Chapter 12's reference solutions: the update of FP8 delayed scaling, the
zero-bubble split of a backward pass into B and W, and the balanced owners of
owner-compute sharded Muon. ``dtlab.exercises.solution(name)`` shows each;
:mod:`.ch12_frontier` checks a learner's against them."""

from __future__ import annotations

import torch

__all__ = ["delayed_scaling_update", "split_backward", "assign_owners"]


def delayed_scaling_update(history, scale, amax, fp8_max, margin=0.0):
    """One step of FP8 delayed scaling, after the cast that used ``scale``.
    ``history`` ``(L,)`` fp32: the amaxes of the last L tensors, newest last;
    ``amax``: this tensor's. Return ``(new_history, next_scale)``: the history with
    the oldest amax dropped and ``amax`` appended, and the scale the NEXT cast uses,
    ``fp8_max / (max(new_history) · 2^margin)`` (``scale`` kept if that max is 0)
    (Micikevicius et al. 2022, §4.3; Transformer Engine's rule)."""
    # a new tensor: the caller's history is someone's state (do not write into it)
    new_history = torch.cat([history[1:], amax.reshape(1)])  # oldest out, newest in
    peak = new_history.max()  # the largest amax of the window: nothing in it saturates
    if peak == 0:  # every tensor of the window was zero: any scale is exact
        return new_history, scale
    return new_history, fp8_max / (peak * 2.0**margin)  # 2^margin of headroom


def split_backward(op, out, grad, inp, weights):
    """The zero-bubble split of one microbatch-chunk's backward (Qi et al. 2023,
    "Zero Bubble Pipeline Parallelism", §2), from ``out`` with ``grad`` =
    dL/d(out) (``None`` when ``out`` is the loss). ``op == "B"``: only
    dL/d(inp), into ``inp.grad`` (``inp`` is ``None`` on the first stage: nothing
    to do), keeping the graph for W. ``op == "W"``: only dL/d(weights), added into
    each weight's ``.grad``."""
    if op == "B":
        if inp is not None:  # the stage before waits for this gradient
            # inputs=[inp]: stop at the input, leave the weights for W;
            # retain_graph: W walks the same graph again
            torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
    else:  # W: nobody waits for it; the graph may go afterwards
        torch.autograd.backward(out, grad, inputs=weights)


def assign_owners(numels, world_size):
    """The owner rank of each matrix for owner-compute sharded Muon, balanced by
    element count: take the matrices largest first and give each to the rank
    holding the fewest elements so far (ties: the lowest rank). Graham's LPT rule:
    the heaviest rank holds at most 4/3 of the best possible load. Returns one rank
    per matrix, in the order of ``numels``."""
    load = [0] * world_size  # elements each rank owns so far
    owners = [0] * len(numels)
    largest_first = sorted(range(len(numels)), key=lambda i: (-numels[i], i))
    for i in largest_first:  # sort the indices, so owners[i] stays matrix i's
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners

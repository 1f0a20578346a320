"""Right answers written differently from the reference are accepted, chapter 13:
the DiLoCo meeting (Douillard et al. 2023, Algorithm 1) and the load plan of a
checkpoint read back at another layout. Each answer was written from the stub's
docstring alone, before the reference, the catalogue of mistakes or the
checkers' bodies were read, and the answers of one exercise differ in idiom.

DiLoCo: one flat buffer made by torch.cat and split back; a preallocated buffer
filled through views; torch's own flatten/unflatten helpers; the parameters
vectorised by torch.nn.utils with an async all-reduce. They also differ in where
the 1/N goes (after the sum, before it as a multiply, or on the averaged
parameters) and in what is reduced: the pseudo-gradients θ_global − θ_r, or the
replicas' parameters, whose mean gives Δ = θ_global − mean(θ_r), the same
average formed in another order (the checker's tolerance, ATOL, allows for it).
Every one sends Ψ fp32 values in one all-reduce through dtlab.comm.

Load plan: a sweep over the pieces sorted by offset; each piece's overlap then a
sort, coverage checked by counting; one read per element (adjacent reads never
merged); a binary search over the sorted starts with the empty range returned
early, each read a named tuple.

The DiLoCo checker runs on 3 fresh ranks it spawns itself (no cluster): about 3 s
an answer on two cores, 11 s for the first (the ranks' imports); the load-plan
checker runs in this process. About 21 s in all on a quiet machine.
"""

import bisect
from collections import namedtuple

import pytest
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from dtlab import comm
from dtlab.exercises import check_diloco_sync, check_load_plan


# ---- ch13 diloco_sync: the meeting of the replicas --------------------------------
def sync_by_cat_and_split(params, global_params, outer, group=None):
    """Δ_r flattened by torch.cat, one all-reduce, the sum divided by N after it,
    split back into the parameters' shapes."""
    n = comm.group_size(group)
    with torch.no_grad():
        deltas = [(g - p).reshape(-1) for g, p in zip(global_params, params)]
        flat = torch.cat(deltas).float()  # (Ψ,)
        comm.all_reduce(flat, group=group)
        flat.div_(n)
        pieces = flat.split([g.numel() for g in global_params])
        for g, d in zip(global_params, pieces):
            g.grad = d.view_as(g).clone()
    outer.step()
    with torch.no_grad():
        for p, g in zip(params, global_params):
            p.copy_(g)


def sync_into_a_preallocated_buffer(params, global_params, outer, group=None):
    """An empty buffer of Ψ values, each Δ_r written into its view by torch.sub
    with out=; each Δ_r multiplied by 1/N before the sum, so the all-reduce
    hands back the average itself."""
    n = comm.group_size(group)
    psi = sum(g.numel() for g in global_params)
    buf = torch.empty(psi, dtype=torch.float32)
    views, start = [], 0
    for g in global_params:
        views.append(buf[start : start + g.numel()].view(g.shape))
        start += g.numel()
    with torch.no_grad():
        for v, g, p in zip(views, global_params, params):
            torch.sub(g, p, out=v)
            v.mul_(1.0 / n)
    comm.all_reduce(buf, op=comm.ReduceOp.SUM, group=group)
    for v, g in zip(views, global_params):
        if g.grad is None:
            g.grad = torch.zeros_like(g)
        g.grad.copy_(v)
    outer.step()
    with torch.no_grad():
        for p, g in zip(params, global_params):
            p.data.copy_(g.data)


def sync_by_averaging_the_replicas(params, global_params, outer, group=None):
    """torch's flatten/unflatten helpers on the replicas' parameters: their mean
    θ̄ = 1/N Σ θ_r gives Δ = θ_global − θ̄, the same average as 1/N Σ (θ_global −
    θ_r) rounded in another order; then the outer step as always."""
    n = comm.group_size(group)
    flat = _flatten_dense_tensors([p.detach() for p in params]).clone()
    comm.all_reduce(flat, group=group)
    mean = _unflatten_dense_tensors(flat / n, [p.detach() for p in params])
    with torch.no_grad():
        for g, m in zip(global_params, mean):
            g.grad = g.detach() - m
    outer.step()
    outer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, g in zip(params, global_params):
            p.copy_(g)


def sync_with_a_vector_and_async(params, global_params, outer, group=None):
    """torch.nn.utils.parameters_to_vector for θ_global and θ_r, an async
    all-reduce waited on, the division as a multiply by 1/N, then
    vector_to_parameters to put the new globals into the replica."""
    n = comm.group_size(group)
    with torch.no_grad():
        delta = parameters_to_vector(global_params) - parameters_to_vector(params)
    handle = comm.all_reduce(delta, group=group, async_op=True)
    handle.wait()
    delta *= 1.0 / n
    offset = 0
    for g in global_params:
        k = g.numel()
        g.grad = delta[offset : offset + k].reshape(g.shape).clone()
        offset += k
    outer.step()
    with torch.no_grad():
        vector_to_parameters(parameters_to_vector(global_params).clone(), params)


@pytest.mark.parametrize(
    "answer",
    [
        sync_by_cat_and_split,
        sync_into_a_preallocated_buffer,
        sync_by_averaging_the_replicas,
        sync_with_a_vector_and_async,
    ],
)
def test_diloco_sync_accepts_other_right_answers(answer):
    assert check_diloco_sync(answer).passed


# ---- ch13 load_plan: which saved bytes fill a rank's range ------------------------
def plan_by_a_sweep(want, saved):
    """The pieces in offset order, a cursor walking from lo to hi: the piece
    holding the cursor is read up to its end or hi, whichever comes first."""
    lo, hi = want
    order = sorted(range(len(saved)), key=lambda i: saved[i][0])
    reads, at = [], lo
    for i in order:
        s_lo, s_hi = saved[i]
        if at >= hi:
            break
        if s_hi <= at:  # wholly before the cursor (or empty)
            continue
        if s_lo > at:
            raise ValueError(f"no saved piece holds element {at} of [{lo}, {hi})")
        end = min(s_hi, hi)
        reads.append((i, at - s_lo, at - lo, end - at))
        at = end
    if at < hi:
        raise ValueError(f"no saved piece holds elements [{at}, {hi})")
    return reads


def plan_by_overlaps_then_sort(want, saved):
    """Each piece's overlap with want, then sorted by offset in want; covered
    when the overlaps' lengths add up to want's (the pieces never overlap)."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a - s_lo, a - lo, b - a))
    reads.sort(key=lambda r: r[2])
    if sum(r[3] for r in reads) != hi - lo:
        raise ValueError(f"the saved pieces {saved} do not cover [{lo}, {hi})")
    return reads


def plan_one_element_at_a_time(want, saved):
    """A read of length 1 per element, looked up in the piece that holds it:
    adjacent reads from one piece are never merged."""
    lo, hi = want
    reads = []
    for j in range(lo, hi):
        owner = next(
            (i for i, (s_lo, s_hi) in enumerate(saved) if s_lo <= j < s_hi), None
        )
        if owner is None:
            raise ValueError(f"element {j} is in no saved piece")
        reads.append((owner, j - saved[owner][0], j - lo, 1))
    return reads


Read = namedtuple("Read", "piece piece_offset want_offset length")


def plan_by_binary_search(want, saved):
    """The empty range returned early; the piece holding each next element found
    by bisect over the sorted starts, each read a named tuple."""
    lo, hi = want
    if lo == hi:
        return []
    nonempty = sorted((s[0], s[1], i) for i, s in enumerate(saved) if s[0] < s[1])
    starts = [s for s, _, _ in nonempty]
    reads, at = [], lo
    while at < hi:
        k = bisect.bisect_right(starts, at) - 1  # the last piece starting ≤ at
        if k < 0 or nonempty[k][1] <= at:
            raise ValueError(f"element {at} of [{lo}, {hi}) was saved by no rank")
        s_lo, s_hi, i = nonempty[k]
        n = min(s_hi, hi) - at
        reads.append(Read(i, at - s_lo, at - lo, n))
        at += n
    return reads


@pytest.mark.parametrize(
    "answer",
    [
        plan_by_a_sweep,
        plan_by_overlaps_then_sort,
        plan_one_element_at_a_time,
        plan_by_binary_search,
    ],
)
def test_load_plan_accepts_other_right_answers(answer):
    assert check_load_plan(answer).passed

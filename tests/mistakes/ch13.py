"""The mistakes learners make in chapter 13's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it on
the shared cluster; ``tests/test_exercises_ch13.py`` proves the load plan's here,
in this process)."""

from __future__ import annotations

import torch

from dtlab import comm
from dtlab.exercises import ch13_resilience, ch13_saved_pieces  # noqa: F401 - declare
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- diloco_sync -------------------------------------------------------------------
def _pseudo_gradient(params, global_params):
    """Δ_r = θ_global − θ_r, flat (Ψ,)."""
    return torch.cat(
        [(g - p.detach()).reshape(-1) for p, g in zip(params, global_params)]
    )


def _set_grads(global_params, flat) -> None:
    offset = 0
    for g in global_params:
        g.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def _reset(params, global_params) -> None:
    with torch.no_grad():
        for p, g in zip(params, global_params):
            p.copy_(g)


def _averaged(params, global_params, group=None):
    delta = _pseudo_gradient(params, global_params)
    comm.all_reduce(delta, group=group)
    return delta / comm.group_size(group)


@mistake("diloco_sync", expect="steps away from where the replicas went")
def reverses_the_pseudo_gradient(params, global_params, outer, group=None):
    """Takes θ_r − θ_global, the direction the replicas went, as the gradient: the
    outer step, which descends, moves the globals the other way."""
    delta = -_pseudo_gradient(params, global_params)
    comm.all_reduce(delta, group=group)
    _set_grads(global_params, delta / comm.group_size(group))
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="that is LocalSGD")
def averages_the_parameters(params, global_params, outer, group=None):
    """Averages the replicas' parameters and starts from the average: LocalSGD,
    the outer optimizer (and its momentum) never used."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    comm.all_reduce(flat, group=group)
    flat /= comm.group_size(group)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


@mistake("diloco_sync", expect="not averaged")
def sums_without_dividing(params, global_params, outer, group=None):
    """Steps with the all-reduced sum of the pseudo-gradients: N times the
    average."""
    delta = _pseudo_gradient(params, global_params)
    comm.all_reduce(delta, group=group)
    _set_grads(global_params, delta)
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="not reset")
def rebinds_instead_of_copying(params, global_params, outer, group=None):
    """Steps the globals right, then rebinds the name ``params`` to copies of them:
    the caller's replica keeps its own inner steps."""
    _set_grads(global_params, _averaged(params, global_params, group))
    outer.step()
    params = [g.clone() for g in global_params]  # noqa: F841 - the mistake


@mistake("diloco_sync", expect="outer.step() was not called")
def forgets_the_outer_step(params, global_params, outer, group=None):
    """Sets the gradients and resets the replicas, but never steps: the globals,
    and so every replica, go back to where the meeting started."""
    _set_grads(global_params, _averaged(params, global_params, group))
    _reset(params, global_params)


@mistake("diloco_sync", expect="stepped twice")
def steps_twice(params, global_params, outer, group=None):
    """Calls outer.step() twice (once 'to apply the momentum'): twice the step,
    and the momentum advanced twice."""
    _set_grads(global_params, _averaged(params, global_params, group))
    outer.step()
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="a second all-reduce")
def all_reduces_the_parameters_too(params, global_params, outer, group=None):
    """Averages the pseudo-gradients AND the parameters (two all-reduces of Ψ),
    though every replica then starts from the globals anyway."""
    _set_grads(global_params, _averaged(params, global_params, group))
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    comm.all_reduce(flat, group=group)
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="one all-reduce per tensor")
def all_reduces_each_tensor(params, global_params, outer, group=None):
    """The right arithmetic, one all-reduce per parameter tensor: Ψ values, but
    in as many messages as tensors (each paying the latency)."""
    n = comm.group_size(group)
    for p, g in zip(params, global_params):
        delta = g - p.detach()
        comm.all_reduce(delta, group=group)
        g.grad = delta / n
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="(2Ψ)")
def sends_parameters_with_the_deltas(params, global_params, outer, group=None):
    """Packs the parameters beside the pseudo-gradients in one buffer: one
    all-reduce, of 2Ψ values."""
    delta = _pseudo_gradient(params, global_params)
    flat = torch.cat([delta, torch.cat([p.detach().reshape(-1) for p in params])])
    comm.all_reduce(flat, group=group)
    _set_grads(global_params, flat[: delta.numel()] / comm.group_size(group))
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="send fp32")
def sends_bfloat16(params, global_params, outer, group=None):
    """Casts the pseudo-gradients to bf16 to halve the bytes: the average loses
    bits the exercise's meeting keeps."""
    delta = _pseudo_gradient(params, global_params).to(torch.bfloat16)
    comm.all_reduce(delta, group=group)
    _set_grads(global_params, delta.float() / comm.group_size(group))
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="torch.distributed.all_reduce")
def calls_torch_directly(params, global_params, outer, group=None):
    """torch.distributed.all_reduce itself: right values, and no bytes recorded."""
    import torch.distributed as dist

    delta = _pseudo_gradient(params, global_params)
    dist.all_reduce(delta, group=group)
    _set_grads(global_params, delta / dist.get_world_size(group))
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="no all-reduce")
def keeps_its_own_pseudo_gradient(params, global_params, outer, group=None):
    """Steps the globals with this replica's own pseudo-gradient: no meeting at
    all, and the replicas drift apart."""
    _set_grads(global_params, _pseudo_gradient(params, global_params))
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="dtlab.comm.broadcast")
def broadcasts_the_new_globals(params, global_params, outer, group=None):
    """Right meeting, then rank 0 broadcasts the new globals 'to be sure': Ψ more
    values on the wire, though every replica computed the same ones."""
    _set_grads(global_params, _averaged(params, global_params, group))
    outer.step()
    for g in global_params:
        comm.broadcast(g, src=0, group=group)
    _reset(params, global_params)


@mistake("diloco_sync", expect="kept the previous meeting's")
def adds_into_the_gradient(params, global_params, outer, group=None):
    """Adds the average into each global's .grad, which nobody zeroes: from the
    second meeting on, the gradient carries every past meeting's."""
    delta = _averaged(params, global_params, group)
    offset = 0
    for g in global_params:
        share = delta[offset : offset + g.numel()].view_as(g)
        g.grad = share.clone() if g.grad is None else g.grad + share
        offset += g.numel()
    outer.step()
    _reset(params, global_params)


@mistake("diloco_sync", expect="by hand")
def steps_by_hand(params, global_params, outer, group=None):
    """θ_global ← θ_global − lr·Δ, written out: plain SGD, the Nesterov momentum
    that the outer optimizer carries left out."""
    delta = _averaged(params, global_params, group)
    lr = outer.param_groups[0]["lr"]
    offset = 0
    with torch.no_grad():
        for g in global_params:
            g -= lr * delta[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
    _reset(params, global_params)


@mistake("diloco_sync", expect="before outer.step()")
def resets_before_the_step(params, global_params, outer, group=None):
    """Copies the globals into the replicas, then steps: the replicas start from
    the old globals."""
    _set_grads(global_params, _averaged(params, global_params, group))
    _reset(params, global_params)
    outer.step()


@mistake("diloco_sync", expect="torch.no_grad()")
def copies_without_no_grad(params, global_params, outer, group=None):
    """Copies into the model's parameters with autograd on: torch refuses an
    in-place write into a leaf that requires grad."""
    _set_grads(global_params, _averaged(params, global_params, group))
    outer.step()
    for p, g in zip(params, global_params):
        p.copy_(g)


@mistake("diloco_sync", expect="share storage")
def shares_the_global_tensors(params, global_params, outer, group=None):
    """Points each parameter at its global tensor (``p.data = g``): right now, but
    the next inner steps move the globals too."""
    _set_grads(global_params, _averaged(params, global_params, group))
    outer.step()
    for p, g in zip(params, global_params):
        p.data = g


# ---- load_plan ---------------------------------------------------------------------
def _cover_or_raise(reads, want) -> None:
    if sum(n for *_, n in reads) != want[1] - want[0]:
        raise ValueError(f"the saved pieces do not cover {want}")


def _sorted_reads(reads):
    return sorted(reads, key=lambda read: read[2])


@mistake("load_plan", expect="half-open")
def takes_the_ends_as_inclusive(want, saved):
    """Counts an overlap's length as b − a + 1, as if hi were inside the range."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a <= b:
            reads.append((i, a - s_lo, a - lo, b - a + 1))
    return _sorted_reads(reads)


@mistake("load_plan", expect="relative to the full tensor")
def offsets_from_the_full_tensor(want, saved):
    """Gives the offset in the saved piece as the element's place in the full
    tensor, not in the piece."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a, a - lo, b - a))
    _cover_or_raise(reads, want)
    return _sorted_reads(reads)


@mistake("load_plan", expect="raise ValueError when")
def never_reports_a_hole(want, saved):
    """Right reads, no cover check: a hole in the checkpoint is loaded as whatever
    the buffer held."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a - s_lo, a - lo, b - a))
    return _sorted_reads(reads)


@mistake("load_plan", expect="whole saved piece")
def reads_whole_pieces(want, saved):
    """Reads every saved piece that touches want from its first element to its
    last: DCP reads whole items, but places only the overlap; this places all."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        if max(lo, s_lo) < min(hi, s_hi):
            reads.append((i, 0, s_lo - lo, s_hi - s_lo))
    return _sorted_reads(reads)


@mistake("load_plan", expect="not sorted by offset in want")
def keeps_file_order(want, saved):
    """The right reads, in the order of the saved pieces, not of want."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a - s_lo, a - lo, b - a))
    _cover_or_raise(reads, want)
    return reads


@mistake("load_plan", expect="lo == hi")
def refuses_an_empty_want(want, saved):
    """Raises when no saved piece overlaps want, even when want is empty (a rank
    that holds nothing of this tensor)."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a - s_lo, a - lo, b - a))
    if not reads:
        raise ValueError(f"no saved piece overlaps {want}")
    _cover_or_raise(reads, want)
    return _sorted_reads(reads)


@mistake("load_plan", expect="file order: you numbered")
def numbers_the_sorted_pieces(want, saved):
    """Sorts the saved pieces by offset first and gives each read its index in
    the sorted list, not in saved."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(sorted(saved)):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a - s_lo, a - lo, b - a))
    _cover_or_raise(reads, want)
    return _sorted_reads(reads)


@mistake("load_plan", expect="in place")
def sorts_saved_in_place(want, saved):
    """Sorts the caller's list to walk it in offset order, and indexes into it:
    the caller's file order is gone."""
    saved.sort()
    return numbers_the_sorted_pieces(want, saved)


@mistake("load_plan", expect="come in any order")
def expects_the_pieces_in_offset_order(want, saved):
    """Walks the saved pieces in file order and calls any jump a hole: pieces
    listed out of offset order look like gaps."""
    lo, hi = want
    reads, end = [], None
    for i, (s_lo, s_hi) in enumerate(saved):
        if end is not None and s_lo != end:
            raise ValueError(f"piece {i} starts at {s_lo}, not at {end}: a hole")
        end = s_hi
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a - s_lo, a - lo, b - a))
    _cover_or_raise(reads, want)
    return _sorted_reads(reads)


@mistake("load_plan", expect="not AssertionError")
def asserts_the_cover(want, saved):
    """Checks the cover with assert: an AssertionError (gone under python -O),
    not the ValueError bad input deserves."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            reads.append((i, a - s_lo, a - lo, b - a))
    assert sum(n for *_, n in reads) == hi - lo, "hole"
    return _sorted_reads(reads)


@mistake("load_plan", expect="read 0 times")
def takes_only_pieces_starting_inside(want, saved):
    """Reads the pieces whose first element lies in want: a piece that starts
    before lo and reaches into want is skipped."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        if lo <= s_lo < hi:
            reads.append((i, 0, s_lo - lo, min(hi, s_hi) - s_lo))
    return _sorted_reads(reads)

"""The mistakes learners make in chapter 12's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` and
``tests/test_exercises_ch12.py`` prove it)."""

from __future__ import annotations

import torch

from dtlab.exercises import ch12_frontier, ch12_muon  # noqa: F401 - declare them
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- delayed_scaling_update --------------------------------------------------------
def _next_scale(peak, scale, fp8_max, margin):
    """The right rule for the scale, on whatever window a mistake picked."""
    return scale if peak == 0 else fp8_max / (peak * 2.0**margin)


def _rolled(history, amax):
    return torch.cat([history[1:], amax.reshape(1)])


@mistake("delayed_scaling_update", expect="current scaling")
def scales_from_this_tensor_only(history, scale, amax, fp8_max, margin=0.0):
    """Rolls the history right but scales from this tensor's own amax: current
    scaling, one cast late, blind to the rest of the window."""
    return _rolled(history, amax), _next_scale(amax, scale, fp8_max, margin)


@mistake("delayed_scaling_update", expect="drop the oldest")
def appends_without_dropping(history, scale, amax, fp8_max, margin=0.0):
    """Appends this amax but never drops the oldest: the history grows every step
    and the window is the whole run."""
    new = torch.cat([history, amax.reshape(1)])
    return new, _next_scale(new.max(), scale, fp8_max, margin)


@mistake("delayed_scaling_update", expect="dropped the newest")
def drops_the_newest(history, scale, amax, fp8_max, margin=0.0):
    """Drops the last entry (the newest amax) instead of the first (the oldest)."""
    new = torch.cat([history[:-1], amax.reshape(1)])
    return new, _next_scale(new.max(), scale, fp8_max, margin)


@mistake("delayed_scaling_update", expect="mean amax")
def takes_the_mean(history, scale, amax, fp8_max, margin=0.0):
    """Scales from the mean of the window: the larger amaxes in it saturate."""
    new = _rolled(history, amax)
    return new, _next_scale(new.mean(), scale, fp8_max, margin)


@mistake("delayed_scaling_update", expect="headroom")
def flips_the_margin(history, scale, amax, fp8_max, margin=0.0):
    """Multiplies the scale by 2^margin instead of dividing: the margin removes
    headroom instead of leaving it."""
    new = _rolled(history, amax)
    peak = new.max()
    return new, scale if peak == 0 else fp8_max * 2.0**margin / peak


@mistake("delayed_scaling_update", expect="keep the scale you were given")
def divides_by_a_zero_window(history, scale, amax, fp8_max, margin=0.0):
    """Divides by the window's max even when every amax in it is 0: an inf scale
    after a run of all-zero tensors."""
    new = _rolled(history, amax)
    return new, fp8_max / (new.max() * 2.0**margin)


@mistake("delayed_scaling_update", expect="before this tensor's amax went in")
def scales_from_the_old_history(history, scale, amax, fp8_max, margin=0.0):
    """Takes the max of the history it was given, before the roll: the scale of
    THIS cast again, not the next one's."""
    return _rolled(history, amax), fp8_max / (history.max() * 2.0**margin)


@mistake("delayed_scaling_update", expect="in place")
def rolls_in_place(history, scale, amax, fp8_max, margin=0.0):
    """Shifts the caller's history in place and returns it: whoever held that
    tensor (the previous step's record) now sees this step's."""
    history[:-1] = history[1:].clone()
    history[-1] = amax
    return history, _next_scale(history.max(), scale, fp8_max, margin)


# ---- split_backward ----------------------------------------------------------------
@mistake("split_backward", expect="B computed the weights' gradients")
def b_computes_everything(op, out, grad, inp, weights):
    """B runs the whole backward (input and weight gradients), then W adds the
    weight gradients again: doubled, and nothing deferred."""
    if op == "B":
        torch.autograd.backward(out, grad, retain_graph=True)
    else:
        torch.autograd.backward(out, grad, inputs=weights)


@mistake("split_backward", expect="keep the graph")
def b_frees_the_graph(op, out, grad, inp, weights):
    """B stops at the input but without retain_graph: autograd frees the graph's
    saved tensors, and W cannot walk it again."""
    if op == "B":
        if inp is not None:
            torch.autograd.backward(out, grad, inputs=[inp])
    else:
        torch.autograd.backward(out, grad, inputs=weights)


@mistake("split_backward", expect="W computed the input's gradients")
def w_also_reaches_the_input(op, out, grad, inp, weights):
    """W runs the whole backward: the weights get theirs, and the input's gradient,
    already sent upstream, gets a second copy added."""
    if op == "B":
        if inp is not None:
            torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
    else:
        torch.autograd.backward(out, grad)


@mistake("split_backward", expect="inp is None")
def b_forgets_the_first_stage(op, out, grad, inp, weights):
    """B asks for the input's gradient even on the first stage, which has no
    input (``inp`` is None)."""
    if op == "B":
        torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
    else:
        torch.autograd.backward(out, grad, inputs=weights)


@mistake("split_backward", expect="left the weights' .grad unchanged")
def w_never_stores_the_gradients(op, out, grad, inp, weights):
    """W computes the weight gradients with torch.autograd.grad, which returns
    them, and never adds them into ``.grad``: the optimizer sees none."""
    if op == "B":
        if inp is not None:
            torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
    else:
        torch.autograd.grad(out, weights, grad)


# ---- assign_owners -----------------------------------------------------------------
def _largest_first(numels):
    return sorted(range(len(numels)), key=lambda i: (-numels[i], i))


@mistake("assign_owners", expect="the heaviest rank")
def deals_round_robin(numels, world_size):
    """Matrix i to rank i mod N, in parameter order: blind to sizes, so one rank
    can collect the big ones."""
    return [i % world_size for i in range(len(numels))]


@mistake("assign_owners", expect="on rank 0")
def puts_everything_on_rank_0(numels, world_size):
    """Every matrix to rank 0: one rank does all of Newton–Schulz."""
    return [0] * len(numels)


@mistake("assign_owners", expect="is not a rank")
def counts_ranks_from_1(numels, world_size):
    """The balanced dealing, with ranks numbered 1 … N."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in _largest_first(numels):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i], load[r] = r + 1, load[r] + numels[i]
    return owners


@mistake("assign_owners", expect="one owner per matrix")
def returns_matrices_per_rank(numels, world_size):
    """Returns, per rank, the matrices it owns (a list per rank), not the owner of
    each matrix."""
    load = [0] * world_size
    mine = [[] for _ in range(world_size)]
    for i in _largest_first(numels):
        r = min(range(world_size), key=lambda r: (load[r], r))
        mine[r].append(i)
        load[r] += numels[i]
    return mine


@mistake("assign_owners", expect="size order")
def returns_owners_in_size_order(numels, world_size):
    """Deals the matrices largest first, and returns the owners in that order:
    owners[j] belongs to the j-th largest matrix, not to matrix j."""
    load = [0] * world_size
    owners = []
    for k in sorted(numels, reverse=True):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners.append(r)
        load[r] += k
    return owners


@mistake("assign_owners", expect="in place")
def sorts_numels_in_place(numels, world_size):
    """Sorts the caller's list to deal largest first: the caller's parameter order
    is lost, and the owners follow the sorted list."""
    numels.sort(reverse=True)
    load = [0] * world_size
    owners = []
    for k in numels:
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners.append(r)
        load[r] += k
    return owners

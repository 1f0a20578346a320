"""Right answers written differently from the reference are accepted, chapter 12:
one step of FP8 delayed scaling, the split backward of a zero-bubble schedule
(B then W), and the owner ranks of sharded Muon. Each answer was written from the
stub's docstring alone, before the reference, the catalogue of mistakes, the
library's own version or the checker's body was read, and the answers of one
exercise differ in idiom (tensor ops, Python lists, autograd's three entry points,
heaps, argsorts, an exhaustive search) and in how they break ties. The wrong
answers are slips a learner makes, each proven rejected with a message that names
its cause. Three of them passed the first checkers (a zero test on this amax
instead of the window's, 1 + margin for 2**margin, a B that computes the weights'
gradients and restores .grad): the checkers gained the cases that catch them.
These checkers run in this process: no cluster is needed."""

import heapq
import itertools

import numpy as np
import pytest
import torch

from dtlab.exercises import (
    ExerciseFailed,
    check_assign_owners,
    check_delayed_scaling_update,
    check_split_backward,
)


# ---- ch12 delayed_scaling_update: the amax history and the next scale ----------------
def scaling_by_cat(history, scale, amax, fp8_max, margin=0.0):
    """The oldest sliced off, the newest concatenated on; an early return for 0."""
    new = torch.cat([history[1:], amax.reshape(1).to(history.dtype)])
    top = new.max()
    if top == 0:
        return new, scale
    return new, fp8_max / (top * 2.0**margin)


def scaling_by_roll_and_where(history, scale, amax, fp8_max, margin=0.0):
    """torch.roll (a copy) moves the oldest to the end, where amax overwrites
    it; torch.where picks the old scale when the window holds only zeros."""
    new = torch.roll(history, shifts=-1)  # [h1, …, h_{L-1}, h0]
    new[-1] = amax
    top = torch.amax(new)
    candidate = fp8_max / (top * 2**margin)  # inf when top is 0, never picked
    return new, torch.where(top > 0, candidate, scale)


def scaling_as_python_lists(history, scale, amax, fp8_max, margin=0.0):
    """A round trip through Python floats: the scale computed in double and
    rounded once to fp32."""
    window = history.tolist()[1:] + [float(amax)]
    top = max(window)
    new = torch.tensor(window, dtype=torch.float32)
    if top == 0.0:
        return new, scale
    return new, torch.tensor(fp8_max / top / 2**margin, dtype=torch.float32)


def scaling_into_a_fresh_buffer(history, scale, amax, fp8_max, margin=0.0):
    """An empty buffer filled by slices; the margin applied with torch.ldexp
    (x · 2**e), the zero case by a mask rather than a branch."""
    new = torch.empty_like(history)
    new[:-1] = history[1:]
    new[-1] = amax
    top = new.abs().max()  # amaxes are magnitudes already: abs() changes nothing
    scaled = torch.ldexp(top, torch.tensor(float(margin)))
    ok = scaled > 0
    safe = torch.where(ok, scaled, torch.ones_like(scaled))
    return new, torch.where(ok, fp8_max / safe, scale.to(new.dtype))


@pytest.mark.parametrize(
    "answer",
    [
        scaling_by_cat,
        scaling_by_roll_and_where,
        scaling_as_python_lists,
        scaling_into_a_fresh_buffer,
    ],
)
def test_delayed_scaling_accepts_other_right_answers(answer):
    assert check_delayed_scaling_update(answer).passed


def scaling_in_place(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: the right numbers, written into the caller's history."""
    history[:-1] = history[1:].clone()
    history[-1] = amax
    top = history.max()
    return history, scale if top == 0 else fp8_max / (top * 2.0**margin)


def scaling_from_the_old_window(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: the next scale from the history before amax joined it."""
    new = torch.cat([history[1:], amax.reshape(1)])
    top = history.max()
    return new, scale if top == 0 else fp8_max / (top * 2.0**margin)


def scaling_drops_the_newest(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: amax put first and the newest dropped, so the window never forgets
    the old amaxes it holds (its max this step can still be right)."""
    new = torch.cat([amax.reshape(1), history[:-1]])
    top = new.max()
    return new, scale if top == 0 else fp8_max / (top * 2.0**margin)


def scaling_margin_inverted(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: the margin multiplies the scale instead of dividing it."""
    new = torch.cat([history[1:], amax.reshape(1)])
    top = new.max()
    return new, scale if top == 0 else fp8_max / top * 2.0**margin


def scaling_from_this_amax(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: the next scale from this tensor's amax alone (current scaling)."""
    new = torch.cat([history[1:], amax.reshape(1)])
    return new, scale if amax == 0 else fp8_max / (amax * 2.0**margin)


def scaling_clamps_zero(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: a zero window guarded by a tiny floor, giving a huge scale rather
    than the old one."""
    new = torch.cat([history[1:], amax.reshape(1)])
    top = new.max().clamp_min(1e-12)
    return new, fp8_max / (top * 2.0**margin)


@pytest.mark.parametrize(
    "wrong, names",
    [
        (scaling_in_place, r"changed the caller's history in place"),
        (scaling_from_the_old_window, r"history before this tensor's amax went in"),
        (scaling_drops_the_newest, r"drop the oldest amax \(the first entry\)"),
        (scaling_from_this_amax, r"current scaling.*largest amax of the whole"),
        (scaling_margin_inverted, r"margin .*you multiplied the scale by it"),
        (scaling_clamps_zero, r"every amax in the window is 0.*keep the scale you"),
    ],
)
def test_delayed_scaling_rejects_wrong_answers(wrong, names):
    with pytest.raises(ExerciseFailed, match=names):
        check_delayed_scaling_update(wrong)


def scaling_zero_checked_on_amax(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: the old scale kept whenever THIS amax is 0, though the window may
    still hold others. From [5, 1, 0, 0] and amax 0 the window becomes [1, 0, 0,
    0], so the next scale is fp8_max / 1, not the fp8_max / 5 it was cast with."""
    new = torch.cat([history[1:], amax.reshape(1)])
    if amax == 0:
        return new, scale
    return new, fp8_max / (new.max() * 2.0**margin)


def scaling_margin_as_one_plus(history, scale, amax, fp8_max, margin=0.0):
    """Wrong: the headroom taken as (1 + margin) rather than 2**margin; the two
    agree at margins 0 and 1 only (at margin 3: 4 against 8)."""
    new = torch.cat([history[1:], amax.reshape(1)])
    top = new.max()
    return new, scale if top == 0 else fp8_max / (top * (1 + margin))


def test_delayed_scaling_rejects_a_zero_test_on_amax():
    with pytest.raises(ExerciseFailed, match=r"(?i)window|max\(new_history\)"):
        check_delayed_scaling_update(scaling_zero_checked_on_amax)


def test_delayed_scaling_rejects_a_margin_of_one_plus():
    with pytest.raises(ExerciseFailed, match=r"margin"):
        check_delayed_scaling_update(scaling_margin_as_one_plus)


# ---- ch12 split_backward: B then W ---------------------------------------------------
def split_with_autograd_backward(op, out, grad, inp, weights):
    """torch.autograd.backward with inputs=: B keeps the graph, W frees it."""
    if op == "B":
        if inp is not None:
            torch.autograd.backward(out, grad, retain_graph=True, inputs=[inp])
    elif op == "W":
        torch.autograd.backward(out, grad, inputs=list(weights))
    else:
        raise ValueError(f"op must be 'B' or 'W', not {op!r}")
    return None


def split_with_autograd_grad(op, out, grad, inp, weights):
    """torch.autograd.grad, then each gradient added into .grad by hand; a
    weight the output does not reach gets None and is skipped."""
    if op == "B" and inp is None:
        return None
    targets = [inp] if op == "B" else list(weights)
    grads = torch.autograd.grad(
        out, targets, grad_outputs=grad, retain_graph=op == "B", allow_unused=True
    )
    for t, g in zip(targets, grads):
        if g is None:
            continue
        t.grad = g.clone() if t.grad is None else t.grad + g
    return None


def split_with_out_backward(op, out, grad, inp, weights):
    """Tensor.backward with inputs=, picked from a table; the graph kept after
    both passes (freed when the caller drops out)."""
    wanted = {
        "B": [] if inp is None else [inp],
        "W": [w for w in weights if w.requires_grad],
    }[op]
    if wanted:
        out.backward(gradient=grad, inputs=wanted, retain_graph=True)


def split_through_a_detached_copy(op, out, grad, inp, weights):
    """W as autograd.grad into fresh tensors, accumulated with add_ under
    no_grad; B as autograd.backward on a one-element list of outputs."""
    if op == "B":
        if inp is None:
            return
        grads = None if grad is None else [grad]
        torch.autograd.backward([out], grads, retain_graph=True, inputs=(inp,))
        return
    params = tuple(weights)
    found = torch.autograd.grad(
        [out], params, None if grad is None else [grad], allow_unused=True
    )
    with torch.no_grad():
        for p, g in zip(params, found):
            if g is not None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.add_(g)


@pytest.mark.parametrize(
    "answer",
    [
        split_with_autograd_backward,
        split_with_autograd_grad,
        split_with_out_backward,
        split_through_a_detached_copy,
    ],
)
def test_split_backward_accepts_other_right_answers(answer):
    assert check_split_backward(answer).passed


def split_b_frees_the_graph(op, out, grad, inp, weights):
    """Wrong: B does not keep the graph, so W finds it freed."""
    if op == "B" and inp is not None:
        torch.autograd.backward(out, grad, inputs=[inp])
    elif op == "W":
        torch.autograd.backward(out, grad, inputs=list(weights))


def split_b_does_everything(op, out, grad, inp, weights):
    """Wrong: B runs the whole backward, so W adds the weights' grads twice."""
    if op == "B":
        out.backward(grad, retain_graph=True)
    else:
        out.backward(grad, inputs=list(weights))


def split_w_overwrites(op, out, grad, inp, weights):
    """Wrong: W sets each weight's .grad, losing what earlier microbatches
    added."""
    if op == "B":
        if inp is not None:
            out.backward(grad, inputs=[inp], retain_graph=True)
        return
    params = list(weights)
    for p, g in zip(params, torch.autograd.grad(out, params, grad)):
        p.grad = g


def split_w_touches_the_input(op, out, grad, inp, weights):
    """Wrong: W runs backward with no inputs=, adding into inp.grad again."""
    if op == "B":
        if inp is not None:
            out.backward(grad, inputs=[inp], retain_graph=True)
    else:
        out.backward(grad)


def split_w_adds_into_none(op, out, grad, inp, weights):
    """Wrong: W adds with +=, which fails on a weight whose .grad is still None."""
    if op == "B":
        if inp is not None:
            out.backward(grad, inputs=[inp], retain_graph=True)
        return
    params = list(weights)
    for p, g in zip(params, torch.autograd.grad(out, params, grad)):
        p.grad += g


def split_b_forgets_the_first_stage(op, out, grad, inp, weights):
    """Wrong: B always runs, with an empty inputs= on the first stage."""
    if op == "B":
        inputs = [] if inp is None else [inp]
        torch.autograd.backward(out, grad, retain_graph=True, inputs=inputs)
    else:
        torch.autograd.backward(out, grad, inputs=list(weights))


@pytest.mark.parametrize(
    "wrong, names",
    [
        (split_b_frees_the_graph, r"B's backward freed the graph W has to walk"),
        (split_b_does_everything, r"B computed the weights' gradients"),
        (split_w_overwrites, r"accumulate, never replace"),
        (split_w_adds_into_none, r"W of chunk .*TypeError.*NoneType"),
        (split_w_touches_the_input, r"W computed the input's gradients"),
        (split_b_forgets_the_first_stage, r"inp is None: the first stage has no"),
    ],
)
def test_split_backward_rejects_wrong_answers(wrong, names):
    with pytest.raises(ExerciseFailed, match=names):
        check_split_backward(wrong)


def split_b_does_w_then_undoes_it(op, out, grad, inp, weights):
    """Wrong: B runs the whole backward, then puts the weights' .grad back as it
    found it. The numbers come out right, but B did W's work (and W does it
    again), so the schedule's B costs as much as B + W and its bubble is not
    filled."""
    params = list(weights)
    if op == "B":
        if inp is None:
            return
        kept = [None if p.grad is None else p.grad.clone() for p in params]
        out.backward(grad, retain_graph=True)
        for p, g in zip(params, kept):
            p.grad = g
        return
    out.backward(grad, inputs=params)


def test_split_backward_rejects_a_b_that_does_w_work():
    with pytest.raises(ExerciseFailed, match=r"(?i)B .*weight"):
        check_split_backward(split_b_does_w_then_undoes_it)


# ---- ch12 assign_owners: the owners of sharded Muon ----------------------------------
def owners_with_a_heap(numels, world_size):
    """A heap of (load, rank); the matrices largest first, ties by index."""
    heap = [(0, r) for r in range(world_size)]
    owners = [None] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + numels[i], rank))
    return owners


def owners_with_a_load_list(numels, world_size):
    """A running load per rank; (numel, index) pairs sorted in reverse, so equal
    matrices go later index first, and equal loads go to the highest rank."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for n, i in sorted(zip(numels, range(len(numels))), reverse=True):
        rank = min(reversed(range(world_size)), key=load.__getitem__)
        owners[i] = rank
        load[rank] += n
    return owners


def owners_with_torch(numels, world_size):
    """torch.argsort descending (not stable) and argmin on a load tensor."""
    sizes = torch.tensor(numels, dtype=torch.int64)
    load = torch.zeros(world_size, dtype=torch.int64)
    owners = torch.empty(len(numels), dtype=torch.int64)
    for i in torch.argsort(sizes, descending=True):
        rank = torch.argmin(load)
        owners[i] = rank
        load[rank] += sizes[i]
    return owners.tolist()


def owners_with_numpy(numels, world_size):
    """A stable numpy argsort of the negated sizes; the least-loaded rank found
    from the far end of the load array, then made a Python int."""
    sizes = np.asarray(numels, dtype=np.int64)
    load = np.zeros(world_size, dtype=np.int64)
    owners = np.zeros(len(sizes), dtype=np.int64)
    for i in np.argsort(-sizes, kind="stable"):
        rank = world_size - 1 - int(np.argmin(load[::-1]))
        owners[i] = rank
        load[rank] += sizes[i]
    return [int(r) for r in owners]


def owners_by_exhaustive_search(numels, world_size):
    """For a few matrices, every assignment tried and the one whose heaviest
    rank is lightest kept (never heavier than the greedy's); the greedy for
    more."""
    if world_size ** len(numels) > 200_000:
        return owners_with_a_heap(numels, world_size)
    best, best_peak = None, None
    for owners in itertools.product(range(world_size), repeat=len(numels)):
        load = [0] * world_size
        for n, r in zip(numels, owners):
            load[r] += n
        if best_peak is None or max(load) < best_peak:
            best, best_peak = list(owners), max(load)
    return best


@pytest.mark.parametrize(
    "answer",
    [
        owners_with_a_heap,
        owners_with_a_load_list,
        owners_with_torch,
        owners_with_numpy,
    ],
)
def test_assign_owners_accepts_other_right_answers(answer):
    assert check_assign_owners(answer).passed


def test_assign_owners_accepts_an_exhaustive_optimum():
    assert check_assign_owners(owners_by_exhaustive_search).passed


def owners_round_robin_by_size(numels, world_size):
    """Wrong: largest first, but dealt out in turn, whatever each rank holds."""
    order = sorted(range(len(numels)), key=lambda i: -numels[i])
    owners = [0] * len(numels)
    for turn, i in enumerate(order):
        owners[i] = turn % world_size
    return owners


def owners_smallest_first(numels, world_size):
    """Wrong: the greedy, but the smallest matrix placed first."""
    load = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: numels[i]):
        rank = load.index(min(load))
        owners[i] = rank
        load[rank] += numels[i]
    return owners


def owners_by_count_of_matrices(numels, world_size):
    """Wrong: each matrix to the rank holding the fewest matrices, not elements."""
    held = [0] * world_size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = held.index(min(held))
        owners[i] = rank
        held[rank] += 1
    return owners


def owners_in_sorted_order(numels, world_size):
    """Wrong: the greedy's ranks listed largest matrix first, not in parameter
    order."""
    load = [0] * world_size
    owners = []
    for n in sorted(numels, reverse=True):
        rank = load.index(min(load))
        owners.append(rank)
        load[rank] += n
    return owners


def owners_by_zeroing_the_taken(numels, world_size):
    """Wrong: the greedy, the largest left found by max() and marked taken in
    the caller's own list."""
    sizes = numels  # not a copy
    load = [0] * world_size
    owners = [0] * len(numels)
    for _ in range(len(numels)):
        i = sizes.index(max(sizes))
        rank = load.index(min(load))
        owners[i] = rank
        load[rank] += sizes[i]
        sizes[i] = -1
    return owners


# the message for an unbalanced dealing: the heaviest rank's load against LPT's
_HEAVIEST = r"heaviest rank \(rank \d+\) holds \d+ elements; a balanced dealing"


@pytest.mark.parametrize(
    "wrong, names",
    [
        (owners_round_robin_by_size, _HEAVIEST),
        (owners_smallest_first, _HEAVIEST),
        (owners_by_count_of_matrices, _HEAVIEST),
        (owners_in_sorted_order, r"owners come in size order.*owner of numels\[i\]"),
        (owners_by_zeroing_the_taken, r"changed numels in place"),
    ],
)
def test_assign_owners_rejects_wrong_answers(wrong, names):
    with pytest.raises(ExerciseFailed, match=names):
        check_assign_owners(wrong)

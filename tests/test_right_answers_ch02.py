"""Chapter 02: right answers written differently from the references are accepted
by grad_hooks, bucketed_hooks and no_sync_accumulation, and a few wrong answers a
learner would write are rejected with a message that names the cause.

Each right answer was written from what the learner sees (the notebook's stub,
the step's markdown and the checker's ``measures=`` line) before the reference
or the checker's body was read. The catalogues' own wrong answers are proven in
tests/test_exercises_ch02.py; the overlapped step's futures answers in
tests/test_exercise_waits.py. (Answers travel to the engines by value: each
imports what it uses.)"""

import pytest

from dtlab.exercises import (
    ExerciseFailed,
    check_bucketed_hooks,
    check_grad_hooks,
    check_no_sync_accumulation,
)
from dtlab.lab.kernel.shipping import ship_by_value

pytestmark = pytest.mark.cluster


# ---- grad_hooks ----------------------------------------------------------------------
def hooks_divide_first(model):
    """Divides before the sum (as PyTorch's DDP does), over named_parameters."""
    from dtlab import comm

    n = comm.group_size()

    def average(p):
        p.grad.mul_(1.0 / n)
        comm.all_reduce(p.grad)

    for _, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average)
    return model


def hooks_on_the_gradient_tensor(model):
    """A tensor hook on each parameter (``register_hook``): it receives the gradient
    before accumulation and returns the averaged one, all-reduced on a copy."""
    from dtlab import comm

    n = comm.group_size()

    def average(grad):
        total = grad.clone()
        comm.all_reduce(total)
        return total / n

    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(average)
    return model


def hooks_replace_the_grad(model):
    """All-reduces a copy and assigns a new tensor to ``.grad`` (out of place),
    the world group named explicitly."""
    import torch.distributed as dist

    from dtlab import comm

    world = dist.group.WORLD
    n = comm.group_size(world)

    def average(p):
        total = p.grad.detach().clone()
        comm.all_reduce(total, group=world)
        p.grad = total / n

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average)
    return model


def hooks_async_waited_at_once(model):
    """An async all-reduce waited at once in the hook: blocking, written the
    overlapped step's way."""
    from dtlab import comm

    n = comm.group_size()

    def average(p):
        comm.all_reduce(p.grad, async_op=True).wait()
        p.grad.div_(n)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    return model


def hooks_sum_without_dividing(model):
    """Wrong: the sum, never divided by N."""
    from dtlab import comm

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: comm.all_reduce(q.grad))
    return model


def hooks_on_the_first_parameter_only(model):
    """Wrong: ``next(model.parameters())``: one parameter averaged, the rest not."""
    from dtlab import comm

    n = comm.group_size()
    p = next(iter(model.parameters()))

    def average(q):
        comm.all_reduce(q.grad)
        q.grad.div_(n)

    p.register_post_accumulate_grad_hook(average)
    return model


# ---- bucketed_hooks ---------------------------------------------------------------
def buckets_counted_and_launched_in_order(model, cap_bytes):
    """Counts the ready gradients per bucket; a pointer launches complete buckets
    in index order; finish() waits, divides and splits back."""
    import torch

    from dtlab import comm

    n = comm.group_size()
    buckets, current, size = [], [], 0
    for p in reversed([q for q in model.parameters() if q.requires_grad]):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    where = {id(p): b for b, ps in enumerate(buckets) for p in ps}
    state = {"ready": [0] * len(buckets), "next": 0, "flight": []}

    def ready(p):
        state["ready"][where[id(p)]] += 1
        while state["next"] < len(buckets) and state["ready"][state["next"]] == len(
            buckets[state["next"]]
        ):
            ps = buckets[state["next"]]
            flat = torch.cat([q.grad.reshape(-1) for q in ps])
            state["flight"].append((ps, flat, comm.all_reduce(flat, async_op=True)))
            state["next"] += 1

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(ready)

    def finish():
        for ps, flat, handle in state["flight"]:
            handle.wait()
            flat.div_(n)
            for q, piece in zip(ps, flat.split([q.numel() for q in ps])):
                q.grad.copy_(piece.view_as(q.grad))
        state.update(ready=[0] * len(buckets), next=0, flight=[])

    return finish


def buckets_with_futures_and_flatten_utils(model, cap_bytes):
    """Sets of pending parameters per bucket, torch's flatten/unflatten helpers, the
    division chained on each future with ``then``; finish() is one ``wait_all``."""
    import torch
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from dtlab import comm

    n = comm.group_size()
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = []
    for p in params[::-1]:
        if not buckets or sum(q.numel() * q.element_size() for q in buckets[-1]) >= (
            cap_bytes
        ):
            buckets.append([])
        buckets[-1].append(p)
    pending = [set() for _ in buckets]
    futures = []
    launched = [0]

    def reset():
        for i, ps in enumerate(buckets):
            pending[i] = {id(q) for q in ps}
        launched[0] = 0
        futures.clear()

    def copy_back(ps, flat):
        def done(fut):
            avg = fut.value()[0].div_(n)
            for q, piece in zip(
                ps, _unflatten_dense_tensors(avg, [q.grad for q in ps])
            ):
                q.grad.copy_(piece)

        return done

    def ready(p):
        for ids in pending:
            ids.discard(id(p))
        while launched[0] < len(buckets) and not pending[launched[0]]:
            ps = buckets[launched[0]]
            flat = _flatten_dense_tensors([q.grad for q in ps])
            fut = comm.all_reduce(flat, async_op=True).get_future()
            futures.append(fut.then(copy_back(ps, flat)))
            launched[0] += 1

    reset()
    for p in params:
        p.register_post_accumulate_grad_hook(ready)

    def finish():
        torch.futures.wait_all(list(futures))
        reset()

    return finish


def buckets_forward_order(model, cap_bytes):
    """Wrong: buckets filled in registration order, not reversed."""
    import torch

    from dtlab import comm

    n = comm.group_size()
    buckets, current, size = [], [], 0
    for p in model.parameters():
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    flight, seen = [], {}

    def ready(p):
        for ps in buckets:
            if any(q is p for q in ps):
                seen[id(p)] = True
                if all(id(q) in seen for q in ps):
                    flat = torch.cat([q.grad.reshape(-1) for q in ps])
                    flight.append((ps, flat, comm.all_reduce(flat, async_op=True)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(ready)

    def finish():
        for ps, flat, h in flight:
            h.wait()
            flat.div_(n)
            for q, piece in zip(ps, flat.split([q.numel() for q in ps])):
                q.grad.copy_(piece.view_as(q.grad))
        flight.clear()
        seen.clear()

    return finish


# ---- no_sync_accumulation ---------------------------------------------------------
def accumulate_last_outside(model, optimizer, micro_batches, loss_fn):
    """Every microbatch but the last under no_sync; the loss divided by k."""
    k = len(micro_batches)
    *early, (x_last, y_last) = micro_batches
    with model.no_sync():
        for x, y in early:
            (loss_fn(model(x), y) / k).backward()
    (loss_fn(model(x_last), y_last) / k).backward()
    optimizer.step()


def accumulate_then_finish(model, optimizer, micro_batches, loss_fn):
    """All microbatches under no_sync, then the explicit
    finish_gradient_synchronization(), the gradients divided by k afterwards."""
    import torch

    with model.no_sync():
        for x, y in micro_batches:
            loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(len(micro_batches))
    optimizer.step()


def accumulate_with_a_chosen_context(model, optimizer, micro_batches, loss_fn):
    """The context chosen per microbatch (no_sync or nullcontext), the loss scaled
    by 1/k with a multiplication, zero_grad after the step."""
    import contextlib

    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model(x), y) * (1.0 / k)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def accumulate_stepping_every_microbatch(model, optimizer, micro_batches, loss_fn):
    """Wrong: an optimizer step per microbatch."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        if i < k - 1:
            with model.no_sync():
                (loss_fn(model(x), y) / k).backward()
        else:
            (loss_fn(model(x), y) / k).backward()
        optimizer.step()


def accumulate_one_backward_of_the_summed_loss(
    model, optimizer, micro_batches, loss_fn
):
    """Wrong: one backward of the summed losses. The gradient and the all-reduce
    count are right, but every microbatch's activations are alive at once, which
    accumulation exists to avoid."""
    k = len(micro_batches)
    (sum(loss_fn(model(x), y) for x, y in micro_batches) / k).backward()
    optimizer.step()


for _answer in (
    hooks_divide_first,
    hooks_on_the_gradient_tensor,
    hooks_replace_the_grad,
    hooks_async_waited_at_once,
    hooks_sum_without_dividing,
    hooks_on_the_first_parameter_only,
    buckets_counted_and_launched_in_order,
    buckets_with_futures_and_flatten_utils,
    buckets_forward_order,
    accumulate_last_outside,
    accumulate_then_finish,
    accumulate_with_a_chosen_context,
    accumulate_stepping_every_microbatch,
    accumulate_one_backward_of_the_summed_loss,
):
    ship_by_value(_answer)


@pytest.mark.parametrize(
    "answer",
    [
        hooks_divide_first,
        hooks_on_the_gradient_tensor,
        hooks_replace_the_grad,
        hooks_async_waited_at_once,
    ],
)
def test_grad_hooks_accepts_other_right_answers(answer, lab_cluster):
    assert check_grad_hooks(answer, lab_cluster(4)).passed


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (hooks_sum_without_dividing, "(?i)divid|/ ?N|sum"),
        (
            hooks_on_the_first_parameter_only,
            r"1 tensors per step, of \[2048\] bytes in step 0",
        ),
    ],
)
def test_grad_hooks_names_the_cause(answer, cause, lab_cluster):
    with pytest.raises(ExerciseFailed, match=cause):
        check_grad_hooks(answer, lab_cluster(4))


@pytest.mark.parametrize(
    "answer",
    [buckets_counted_and_launched_in_order, buckets_with_futures_and_flatten_utils],
)
def test_bucketed_hooks_accepts_other_right_answers(answer, lab_cluster):
    assert check_bucketed_hooks(answer, lab_cluster(4)).passed


def test_bucketed_hooks_names_the_bucket_order(lab_cluster):
    with pytest.raises(ExerciseFailed, match="(?i)revers|order"):
        check_bucketed_hooks(buckets_forward_order, lab_cluster(4))


@pytest.mark.parametrize(
    "answer",
    [accumulate_last_outside, accumulate_then_finish, accumulate_with_a_chosen_context],
)
def test_no_sync_accumulation_accepts_other_right_answers(answer, lab_cluster):
    assert check_no_sync_accumulation(answer, lab_cluster(4)).passed


def test_no_sync_accumulation_names_extra_steps(lab_cluster):
    with pytest.raises(ExerciseFailed, match="(?i)step"):
        check_no_sync_accumulation(accumulate_stepping_every_microbatch, lab_cluster(4))


def test_no_sync_accumulation_names_every_microbatch_held_at_once(lab_cluster):
    with pytest.raises(ExerciseFailed, match="held 3 microbatches' activations"):
        check_no_sync_accumulation(
            accumulate_one_backward_of_the_summed_loss, lab_cluster(4)
        )

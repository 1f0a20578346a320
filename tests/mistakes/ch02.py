"""The mistakes learners make in chapter 02's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it)."""

from __future__ import annotations

import torch

from dtlab.exercises import (  # noqa: F401 - they declare the exercises
    ch02_data_parallel,
    ch02_torch_ddp,
)
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- grad_hooks ----------------------------------------------------------------------
@mistake("grad_hooks", expect="summed, not averaged")
def forgets_to_divide_by_n(model):
    """All-reduces each gradient and stops there: the sum over N ranks. AdamW is
    nearly scale-invariant and would hide it; SGD moves N times too far."""
    from dtlab import comm

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: comm.all_reduce(param.grad))
    return model


@mistake("grad_hooks", expect="dtlab.ddp.DistributedDataParallel")
def wraps_in_the_library_ddp(model):
    """``return DistributedDataParallel(model)``: right numbers, nothing built."""
    from dtlab.ddp import DistributedDataParallel

    return DistributedDataParallel(model)


@mistake("grad_hooks", expect="torch.nn.parallel.DistributedDataParallel")
def wraps_in_torch_ddp(model):
    """PyTorch's DDP: right numbers, nothing built, and nothing recorded."""
    return torch.nn.parallel.DistributedDataParallel(model)


@mistake("grad_hooks", expect="biases too")
def skips_the_biases(model):
    """Hooks only on the weight matrices (``p.dim() > 1``): the biases stay local."""
    from dtlab import comm

    n = comm.group_size()

    def average(param):
        comm.all_reduce(param.grad)
        param.grad.div_(n)

    for p in model.parameters():
        if p.dim() > 1:
            p.register_post_accumulate_grad_hook(average)
    return model


@mistake("grad_hooks", expect="different weights")
def averages_the_weights(model):
    """All-reduces ``param.data`` instead of ``param.grad``: the weights, equal
    already, stay equal; every rank then steps with its own gradient."""
    from dtlab import comm

    n = comm.group_size()

    def average(param):
        comm.all_reduce(param.data)
        param.data.div_(n)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    return model


# ---- overlapped_hooks ----------------------------------------------------------------
@mistake("overlapped_hooks", expect="waited inside the backward")
def waits_in_the_hook(model):
    """Launches asynchronously, then waits at once: no better than blocking."""
    from dtlab import comm

    n = comm.group_size()

    def launch(param):
        comm.all_reduce(param.grad, async_op=True).wait()
        param.grad.div_(n)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(launch)
    return lambda: None


@mistake("overlapped_hooks", expect="was blocking (async_op=False)")
def blocks_in_the_hook(model):
    """Chapter 02's first step again (a blocking all-reduce per hook), dividing in
    finish(): correct, with no overlap at all."""
    from dtlab import comm

    n = comm.group_size()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.register_post_accumulate_grad_hook(lambda param: comm.all_reduce(param.grad))

    def finish():
        for p in params:
            p.grad.div_(n)

    return finish


@mistake("overlapped_hooks", expect="launched after backward returned")
def launches_in_finish(model):
    """Async all-reduces, but all launched in finish(): backward is over, nothing
    overlaps."""
    from dtlab import comm

    n = comm.group_size()
    params = [p for p in model.parameters() if p.requires_grad]

    def finish():
        handles = [comm.all_reduce(p.grad, async_op=True) for p in params]
        for p, h in zip(params, handles):
            h.wait()
            p.grad.div_(n)

    return finish


@mistake("overlapped_hooks", expect="never waited")
def never_waits(model):
    """Launches from the hooks and divides in finish() without waiting: the step
    may read a gradient still being summed."""
    from dtlab import comm

    n = comm.group_size()
    params = [p for p in model.parameters() if p.requires_grad]

    def launch(param):
        comm.all_reduce(param.grad, async_op=True)  # the handle is dropped

    for p in params:
        p.register_post_accumulate_grad_hook(launch)

    def finish():
        for p in params:
            p.grad.div_(n)

    return finish


@mistake("overlapped_hooks", expect="different weights")
def reduces_a_copy(model):
    """All-reduces ``param.grad.clone()`` and forgets to copy the sum back."""
    from dtlab import comm

    n = comm.group_size()
    in_flight = []

    def launch(param):
        in_flight.append(comm.all_reduce(param.grad.clone(), async_op=True))

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.register_post_accumulate_grad_hook(launch)

    def finish():
        for h in in_flight:
            h.wait()
        in_flight.clear()
        for p in params:
            p.grad.div_(n)

    return finish


# ---- bucketed_hooks ------------------------------------------------------------------
def _bucketed(
    model,
    cap_bytes,
    *,
    reverse=True,
    close_before=False,
    copy_back=True,
    launch_in_finish=False,
):
    """A bucketed reducer with one of the learners' mistakes switched on."""
    from dtlab import comm

    n = comm.group_size()
    params = [p for p in model.parameters() if p.requires_grad]
    buckets, current, filled = [], [], 0
    for p in params[::-1] if reverse else params:
        size = p.numel() * p.element_size()
        if close_before and current and filled + size > cap_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(p)
        filled += size
        if not close_before and filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
    ready, launched = [0] * len(buckets), []

    def launch(bucket):
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        launched.append((bucket, flat, comm.all_reduce(flat, async_op=True)))

    def on_ready(param):
        ready[bucket_of[id(param)]] += 1
        while not launch_in_finish and len(launched) < len(buckets):
            if ready[len(launched)] < len(buckets[len(launched)]):
                break
            launch(buckets[len(launched)])

    for p in params:
        p.register_post_accumulate_grad_hook(on_ready)

    def finish():
        if launch_in_finish:
            for bucket in buckets:
                launch(bucket)
        for bucket, flat, handle in launched:
            handle.wait()
            flat.div_(n)
            if copy_back:
                for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
                    p.grad.copy_(part.view_as(p))
        launched.clear()
        ready[:] = [0] * len(buckets)

    return finish


@mistake("bucketed_hooks", expect="reverse registration order")
def buckets_in_registration_order(model, cap_bytes):
    """Cuts the buckets walking the parameters in registration order: bucket 0 (the
    first layers) is ready last, and every bucket launches at the end."""
    return _bucketed(model, cap_bytes, reverse=False)


@mistake("bucketed_hooks", expect="all-reduces 3 per step")
def one_bucket_per_parameter(model, cap_bytes):
    """Ignores the cap: one bucket per gradient, a launch (and its latency) each."""
    return _bucketed(model, 0)


@mistake("bucketed_hooks", expect="the cap or more")
def never_overshoots_the_cap(model, cap_bytes):
    """Closes a bucket *before* the gradient that would overflow it, where DDP
    closes it as soon as it holds the cap or more."""
    return _bucketed(model, cap_bytes, close_before=True)


@mistake("bucketed_hooks", expect="launched after backward returned")
def launches_the_buckets_in_finish(model, cap_bytes):
    """The right buckets, all launched after backward: no overlap."""
    return _bucketed(model, cap_bytes, launch_in_finish=True)


@mistake("bucketed_hooks", expect="different weights")
def forgets_to_copy_back(model, cap_bytes):
    """Averages the flat bucket buffers and never copies them back into .grad."""
    return _bucketed(model, cap_bytes, copy_back=False)


# ---- no_sync_accumulation ------------------------------------------------------------
@mistake("no_sync_accumulation", expect="model.no_sync()")
def syncs_every_micro_batch(model, optimizer, micro_batches, loss_fn):
    """No no_sync(): the right gradients, with an all-reduce per microbatch."""
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


@mistake("no_sync_accumulation", expect="no all-reduce at all")
def never_syncs(model, optimizer, micro_batches, loss_fn):
    """Every backward inside no_sync(), the last one too: nothing is averaged."""
    with model.no_sync():
        for x, y in micro_batches:
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


@mistake("no_sync_accumulation", expect="divide each microbatch's loss by k")
def forgets_to_divide_the_loss(model, optimizer, micro_batches, loss_fn):
    """Accumulates the microbatch losses' gradients without dividing by k: the
    gradient of the sum, k times the mean's."""
    for i, (x, y) in enumerate(micro_batches):
        if i < len(micro_batches) - 1:
            with model.no_sync():
                loss_fn(model(x), y).backward()
        else:
            loss_fn(model(x), y).backward()
    optimizer.step()


@mistake("no_sync_accumulation", expect="no zero_grad between them")
def zeroes_between_micro_batches(model, optimizer, micro_batches, loss_fn):
    """Calls zero_grad() before every microbatch: only the last one counts."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        optimizer.zero_grad()
        if i < k - 1:
            with model.no_sync():
                (loss_fn(model(x), y) / k).backward()
        else:
            (loss_fn(model(x), y) / k).backward()
    optimizer.step()


@mistake("no_sync_accumulation", expect="optimizer.step()")
def steps_every_micro_batch(model, optimizer, micro_batches, loss_fn):
    """Steps after every microbatch: k small steps instead of one."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        if i < k - 1:
            with model.no_sync():
                (loss_fn(model(x), y) / k).backward()
        else:
            (loss_fn(model(x), y) / k).backward()
        optimizer.step()


# ---- torch_ddp -----------------------------------------------------------------------
def _torch_ddp_loop(model, batches, lr, *, whole=False, via_module=False, zero=True):
    """The reference loop with one thing changed (each mistake below names it)."""
    import torch.distributed as dist
    from torch import nn

    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = nn.parallel.DistributedDataParallel(model)
    forward = ddp.module if via_module else ddp
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        if not whole:
            per = len(x) // n
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        if zero:
            optimizer.zero_grad()
        loss = nn.functional.mse_loss(forward(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@mistake("torch_ddp", expect="trained on the whole batch")
def trains_on_the_whole_batch(model, batches, lr):
    """Wraps the model and feeds every rank the whole global batch: the averaged
    gradient is right, at N times the compute, and nothing is data-parallel."""
    return _torch_ddp_loop(model, batches, lr, whole=True)


@mistake("torch_ddp", expect="not ddp.module(x)")
def forwards_through_the_module(model, batches, lr):
    """Calls ``ddp.module(x)``: the forward skips DDP's, so its reducer is never
    readied for the backward and no gradient is all-reduced."""
    return _torch_ddp_loop(model, batches, lr, via_module=True)


@mistake("torch_ddp", expect="optimizer.zero_grad()")
def forgets_zero_grad(model, batches, lr):
    """Never zeroes the gradients: each step adds the earlier steps' gradients
    (the averaged ones: every rank still agrees, and every rank is wrong)."""
    return _torch_ddp_loop(model, batches, lr, zero=False)


@mistake("torch_ddp", expect="dtlab.ddp.DistributedDataParallel")
def wraps_in_dtlab_ddp(model, batches, lr):
    """dtlab's DDP instead of PyTorch's: the right numbers, the wrong framework."""
    import torch.distributed as dist
    from torch import nn

    from dtlab.ddp import DistributedDataParallel

    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        per = len(x) // n
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@mistake("torch_ddp", expect="never wrapped the model")
def averages_by_hand(model, batches, lr):
    """Hooks that all-reduce each gradient with dtlab.comm (exercise 1's answer)
    instead of PyTorch's DDP: the weights come out right, but no DDP was used."""
    import torch.distributed as dist
    from torch import nn

    from dtlab import comm

    rank, n = dist.get_rank(), dist.get_world_size()

    def average(param):
        comm.all_reduce(param.grad)
        param.grad.div_(n)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(average)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        per = len(x) // n
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses

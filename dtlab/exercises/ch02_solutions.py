"""Chapter 02's reference solutions: DDP in three steps (hooks, overlap, buckets),
gradient accumulation with ``no_sync`` (Li et al. 2020, "PyTorch Distributed",
§3.2), and a training loop on PyTorch's own ``DistributedDataParallel``.
``dtlab.exercises.solution(name)`` shows each; :mod:`.ch02_data_parallel` checks a
learner's against them."""

from __future__ import annotations

import contextlib

import torch

__all__ = [
    "attach_grad_averaging",
    "attach_overlapped_averaging",
    "attach_bucketed_averaging",
    "accumulate_and_step",
    "train_with_torch_ddp",
]


def attach_grad_averaging(model):
    """Register hooks so that once ``loss.backward()`` returns, every ``.grad``
    holds the average of that parameter's gradients over all ranks: one blocking
    all-reduce per parameter, then a division by N."""
    from dtlab import comm

    n = comm.group_size()

    def average(param):  # called once param.grad is final for this backward
        comm.all_reduce(param.grad)  # sum over ranks, in place
        param.grad.div_(n)

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(average)
    return model


def attach_overlapped_averaging(model):
    """Launch each gradient's all-reduce asynchronously from its hook, so it runs
    while backward computes earlier layers; return ``finish()``, which the training
    loop calls after ``loss.backward()``: it waits for every handle and divides."""
    from dtlab import comm

    n = comm.group_size()
    in_flight = []  # (param, handle), in launch order

    def launch(param):
        in_flight.append((param, comm.all_reduce(param.grad, async_op=True)))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(launch)

    def finish():
        for param, handle in in_flight:
            handle.wait()
            param.grad.div_(n)
        in_flight.clear()

    return finish


def attach_bucketed_averaging(model, cap_bytes):
    """DDP's buckets: parameters in *reverse* registration order (the order backward
    produces their gradients), a bucket closed as soon as it holds ``cap_bytes`` or
    more; when every gradient of the next bucket is ready, it is flattened and
    all-reduced asynchronously. ``finish()`` waits, divides by N, and copies the
    averages back into ``.grad``."""
    from dtlab import comm

    n = comm.group_size()
    buckets, current, filled = [], [], 0
    for p in [p for p in model.parameters() if p.requires_grad][::-1]:
        current.append(p)
        filled += p.numel() * p.element_size()
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
    ready = [0] * len(buckets)
    launched = []  # (bucket, flat buffer, handle), in bucket order

    def on_ready(param):
        ready[bucket_of[id(param)]] += 1
        # launch in bucket order: bucket i goes once it and all before it are full
        while len(launched) < len(buckets):
            bucket = buckets[len(launched)]
            if ready[len(launched)] < len(bucket):
                break
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            launched.append((bucket, flat, comm.all_reduce(flat, async_op=True)))

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(on_ready)

    def finish():
        for bucket, flat, handle in launched:
            handle.wait()
            flat.div_(n)
            for p, part in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(part.view_as(p))
        launched.clear()
        ready[:] = [0] * len(buckets)

    return finish


def accumulate_and_step(model, optimizer, micro_batches, loss_fn):
    """One optimizer step over ``micro_batches`` (a list of ``(x, y)``, equal in
    size) on a :class:`dtlab.ddp.DistributedDataParallel` ``model``: the gradient
    of the mean loss over all of them, all-reduced once, with the last backward."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        # inside no_sync() the gradients only accumulate; the last backward reduces
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model(x), y) / k).backward()
    optimizer.step()


def train_with_torch_ddp(model, batches, lr):
    """Wrap ``model`` in PyTorch's ``DistributedDataParallel`` and take one SGD step
    (learning rate ``lr``, mean squared error) per ``(x, y)`` global batch of
    ``batches``, on this rank's contiguous slice of it: rows ``r·B/N`` to
    ``(r+1)·B/N``. Returns this rank's losses, one float per step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:  # (B, d_in), (B, d_out): the global batch
        per = len(x) // n
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)  # through the wrapper: DDP's hooks
        loss.backward()  # the reducer all-reduces the buckets in here
        optimizer.step()
        losses.append(loss.item())
    return losses

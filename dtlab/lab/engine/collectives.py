"""The collectives the README picture (chapter 01's dashboard) times, on every rank:
``python -m dtlab.lab.snapshot --collectives`` ships them through ``cluster.run``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtlab import comm, telemetry
from dtlab.events import Span


def sweep_all_reduce(sizes, reps: int):
    """All-reduce each size ``reps`` times (after one untimed warm-up), a barrier
    before each so every call starts together and its duration is the op's."""
    for size in sizes:
        x = torch.ones(size // 4)  # fp32: size bytes
        comm.all_reduce(x, tag="warm-up")
        for _ in range(reps):
            comm.barrier(tag="sweep")
            comm.all_reduce(x, tag="sweep")


def ring_matches_all_reduce(nbytes: int):
    """The course's ring all-reduce; returns whether it matched ``dist.all_reduce``."""
    r = dist.get_rank()
    x = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(r))
    expected = x.clone()
    dist.all_reduce(expected)  # torch directly, so the check is not recorded
    comm.ring_all_reduce(x, tag="ring")
    # the ring adds in another order than gloo: equal up to fp32 rounding
    return bool(torch.allclose(x, expected, rtol=1e-5, atol=1e-5))


def data_parallel_steps(n_steps: int = 3, width: int = 384):
    """A data-parallel-like loop: forward and backward spans of real matmuls, then
    the all-reduce of a gradient-sized buffer."""
    rec = telemetry.current()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(width, width, generator=g)
    x = torch.randn(256, width, generator=g)
    for step in range(n_steps):
        rec.step = step
        with rec.span(Span.F):
            h = torch.tanh(x @ w)  # (256, width)
        with rec.span(Span.B):
            grad = x.T @ (1 - h * h)  # (width, width), same size as w
        comm.all_reduce(grad, tag="grads")
        with rec.span(Span.OPT):
            w -= 1e-3 * grad


def collective_mix(nbytes: int = 1 << 18):
    """One of each collective on the same payload."""
    n = dist.get_world_size()
    x = torch.ones(nbytes // 4)
    comm.broadcast(x, src=0)
    comm.all_reduce(x)
    shard = torch.empty(x.numel() // n)
    comm.reduce_scatter(shard, x)
    comm.all_gather(x, shard)

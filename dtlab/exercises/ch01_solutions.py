"""Chapter 01's reference solutions: the ring reduce-scatter and the ring
all-reduce from ``isend``/``irecv`` (Patarasuk & Yuan 2009).
``dtlab.exercises.solution(name)`` shows each; :mod:`.ch01_collectives` checks a
learner's against them."""

from __future__ import annotations

import torch

__all__ = ["ring_reduce_scatter", "ring_all_reduce"]


def ring_reduce_scatter(output, input):
    """Rank r ends with slice r of the sum over ranks of ``input`` (N·k elements) in
    ``output`` (k), using only ``comm.isend`` to (r+1) mod N and ``comm.irecv``
    from (r−1) mod N: N−1 steps, each passing on one partial sum."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    right, left = (r + 1) % n, (r - 1) % n
    chunks = input.clone().chunk(n)  # a copy: the caller's input stays as it was
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        # step s: pass on the partial sum of chunk r-s-1, add the left's partial
        # sum of chunk r-s-2 to ours; after N-1 steps chunk r has every term
        sending = comm.isend(chunks[(r - s - 1) % n], right)
        receiving = comm.irecv(incoming, left)
        sending.wait()
        receiving.wait()
        chunks[(r - s - 2) % n].add_(incoming)
    output.copy_(chunks[r])


def ring_all_reduce(tensor):
    """Sum ``tensor`` over the ranks in place: a reduce-scatter phase (N−1 steps,
    after which rank r holds the whole sum of chunk r+1), then an all-gather phase
    (N−1 steps passing the finished chunks on round the ring)."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    right, left = (r + 1) % n, (r - 1) % n
    # views, the largest first: writing a chunk writes the tensor
    chunks = torch.tensor_split(tensor.view(-1), n)
    incoming = torch.empty_like(chunks[0])

    def step(send_index, recv_index):
        sending = comm.isend(chunks[send_index].contiguous(), right)
        receiving = comm.irecv(incoming[: chunks[recv_index].numel()], left)
        sending.wait()
        receiving.wait()
        return incoming[: chunks[recv_index].numel()]

    for s in range(n - 1):  # reduce-scatter phase
        chunks[(r - s - 1) % n].add_(step((r - s) % n, (r - s - 1) % n))
    for s in range(n - 1):  # all-gather phase: the finished chunk r+1 goes first
        chunks[(r - s) % n].copy_(step((r + 1 - s) % n, (r - s) % n))

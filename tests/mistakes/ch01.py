"""The mistakes learners make in chapter 01's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it)."""

from __future__ import annotations

import torch

from dtlab.exercises import ch01_collectives  # noqa: F401 - declares the exercises
from dtlab.exercises.ch01_solutions import ring_all_reduce
from dtlab.exercises.grading import mistake

__all__: list[str] = []


@mistake("ring_reduce_scatter", expect="direct exchange")
def sends_each_chunk_to_its_owner(output, input):
    """A direct exchange: every rank sends chunk j straight to rank j. Right values,
    right byte count, but N−1 peers instead of one: not a ring."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    chunks = input.chunk(n)
    bufs = {j: torch.empty_like(chunks[r]) for j in range(n) if j != r}
    handles = [comm.isend(chunks[j].contiguous(), j) for j in bufs]
    handles += [comm.irecv(bufs[j], j) for j in bufs]
    for h in handles:
        h.wait()
    output.copy_(chunks[r] + sum(bufs.values()))


@mistake("ring_reduce_scatter", expect="the library's collective")
def calls_the_library_reduce_scatter(output, input):
    """Calls dtlab.comm.reduce_scatter: right answer, no ring built."""
    from dtlab import comm

    comm.reduce_scatter(output, input.clone())


@mistake("ring_reduce_scatter", expect="torch.distributed.reduce_scatter_tensor")
def calls_torch_reduce_scatter(output, input):
    """Calls torch.distributed directly: right answer, no ring, and nothing
    recorded."""
    import torch.distributed as dist

    dist.reduce_scatter_tensor(output, input.clone())


@mistake("ring_reduce_scatter", expect="chunk order")
def sends_the_all_reduce_chunk_order(output, input):
    """The all-reduce's order (send chunk r−s at step s): after N−1 steps rank r
    has finished chunk r+1, and returns its unfinished chunk r."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    chunks = input.clone().chunk(n)
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        sending = comm.isend(chunks[(r - s) % n], (r + 1) % n)
        receiving = comm.irecv(incoming, (r - 1) % n)
        sending.wait()
        receiving.wait()
        chunks[(r - s - 1) % n].add_(incoming)
    output.copy_(chunks[r])


@mistake("ring_reduce_scatter", expect="sends N−1")
def all_reduces_then_keeps_a_slice(output, input):
    """A whole ring all-reduce, then slice r: right values for twice the traffic."""
    from dtlab import comm

    total = input.clone()
    ring_all_reduce(total)
    output.copy_(total.chunk(comm.group_size())[comm.group_rank()])


@mistake("ring_reduce_scatter", expect="changed `input`")
def adds_into_the_input(output, input):
    """The right ring, but it adds into the caller's input instead of a copy."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    chunks = input.chunk(n)
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        sending = comm.isend(chunks[(r - s - 1) % n], (r + 1) % n)
        receiving = comm.irecv(incoming, (r - 1) % n)
        sending.wait()
        receiving.wait()
        chunks[(r - s - 2) % n].add_(incoming)
    output.copy_(chunks[r])


@mistake("ring_all_reduce", expect="right neighbour")
def sends_the_whole_tensor_to_everyone(tensor):
    """The naive all-reduce: every rank sends its whole tensor to every other rank,
    (N−1)·S bytes per rank instead of the ring's 2(N−1)/N·S."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    bufs = [torch.empty_like(tensor) for _ in range(n)]
    handles = [comm.isend(tensor.clone(), j) for j in range(n) if j != r]
    handles += [comm.irecv(bufs[j], j) for j in range(n) if j != r]
    for h in handles:
        h.wait()
    for j in range(n):
        if j != r:
            tensor.add_(bufs[j])


@mistake("ring_all_reduce", expect="dtlab.comm.ring_all_reduce")
def calls_the_library_ring(tensor):
    """Calls the library's ring: the right traffic, none of it written."""
    from dtlab import comm

    comm.ring_all_reduce(tensor)


@mistake("ring_all_reduce", expect="torch.distributed.all_reduce")
def calls_torch_all_reduce(tensor):
    """torch.distributed.all_reduce: the right sum, no ring, nothing recorded."""
    import torch.distributed as dist

    dist.all_reduce(tensor)


@mistake("ring_all_reduce", expect="all-gather phase")
def stops_after_the_reduce_scatter_phase(tensor):
    """Only the reduce-scatter phase: each rank has one finished chunk."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    chunks = tensor.view(-1).chunk(n)
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        sending = comm.isend(chunks[(r - s) % n].contiguous(), (r + 1) % n)
        receiving = comm.irecv(incoming, (r - 1) % n)
        sending.wait()
        receiving.wait()
        chunks[(r - s - 1) % n].add_(incoming)


@mistake("ring_all_reduce", expect="the mean, not the sum")
def averages_instead_of_summing(tensor):
    """The ring, then a division by N: that is DDP's job, not the all-reduce's."""
    from dtlab import comm

    ring_all_reduce(tensor)
    tensor.div_(comm.group_size())


@mistake("ring_all_reduce", expect="the other way round")
def runs_the_ring_to_the_left(tensor):
    """Sends to (r−1) and receives from (r+1): a ring, but the other way round from
    the one the exercise (and dtlab) uses."""
    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    chunks = tensor.view(-1).chunk(n)
    incoming = torch.empty_like(chunks[0])
    for phase in ("reduce", "gather"):
        for s in range(n - 1):
            send_i = (r + s) % n if phase == "reduce" else (r - 1 + s) % n
            recv_i = (r + s + 1) % n if phase == "reduce" else (r + s) % n
            sending = comm.isend(chunks[send_i].contiguous(), (r - 1) % n)
            receiving = comm.irecv(incoming, (r + 1) % n)
            sending.wait()
            receiving.wait()
            if phase == "reduce":
                chunks[recv_i].add_(incoming)
            else:
                chunks[recv_i].copy_(incoming)

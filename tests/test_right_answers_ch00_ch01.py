"""Chapters 00 and 01: right answers written differently from the references are
accepted, and a few wrong answers a learner would write are rejected with a
message that names the cause.

Each right answer was written from what the learner sees (the notebook's stub,
the exercise's markdown and the checker's ``measures=`` line) before the
reference or the checker's body was read. The catalogues' own wrong answers are
proven in tests/test_exercises*.py. (Answers run on the engines travel by value:
each imports what it uses.)"""

import math

import pytest

from dtlab.exercises import (
    ExerciseFailed,
    check_min_gpus,
    check_ring_all_reduce,
    check_ring_reduce_scatter,
    check_zero2_bytes,
)
from dtlab.lab.kernel.shipping import ship_by_value


# ---- ch00 zero2_bytes -------------------------------------------------------------
def zero2_by_state(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """One term per kind of state, summed from a dict."""
    held = {
        "weights": bytes_param * n_params,
        "gradients": bytes_grad * n_params / n_gpus,
        "optimizer": K * n_params / n_gpus,
    }
    return sum(held.values())


def zero2_from_the_stage_table(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """The table of stages as data: a state is sliced from the stage that shards it."""
    stage = 2
    sharded_from = ((bytes_param, 3), (bytes_grad, 2), (K, 1))
    total = 0.0
    for width, first_sharded in sharded_from:
        share = 1 / n_gpus if stage >= first_sharded else 1.0
        total += width * n_params * share
    return total


def zero2_factored(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """Ψ factored out: Ψ·(b_p + (b_g + K)/N)."""
    return n_params * (bytes_param + (bytes_grad + K) / n_gpus)


def zero2_gradients_as_wide_as_weights(
    n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12
):
    """Wrong: the gradient priced at the weight's width (bytes_grad ignored)."""
    return bytes_param * n_params + (bytes_param + K) * n_params / n_gpus


def zero2_ring_fraction(n_params, n_gpus, bytes_param=2, bytes_grad=2, K=12):
    """Wrong: each GPU keeps (N-1)/N of the sharded states, the ring's factor."""
    return bytes_param * n_params + (bytes_grad + K) * n_params * (n_gpus - 1) / n_gpus


@pytest.mark.parametrize(
    "answer", [zero2_by_state, zero2_from_the_stage_table, zero2_factored]
)
def test_zero2_bytes_accepts_other_right_answers(answer):
    assert check_zero2_bytes(answer).passed


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (zero2_gradients_as_wide_as_weights, "(?i)gradient"),
        (zero2_ring_fraction, r"(?i)\(N ?[-−] ?1\)|ring"),
    ],
)
def test_zero2_bytes_names_the_cause(answer, cause):
    with pytest.raises(ExerciseFailed, match=cause):
        check_zero2_bytes(answer)


# ---- ch00 min_gpus ------------------------------------------------------------------
def min_gpus_doubling(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Double N from 1 and ask dtlab.estimate at each power of two."""
    from dtlab import estimate as est

    n = 1
    while n <= max_gpus:
        need = est.zero_memory_per_device(n_params, n, stage, precision, optimizer)
        if need["total"] <= gpu_bytes:
            return n
        n *= 2
    return None


def min_gpus_closed_form(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Replicated part R and sharded part S: N ≥ S / (M − R), rounded up to a power
    of two; no loop over N at all."""
    from dtlab import estimate as est

    b = est.bytes_per_param(precision, optimizer)
    widths = (b.params, b.grads, b.optimizer)  # sharded from stages 3, 2, 1
    replicated = sum(w for w, s in zip(widths, (3, 2, 1)) if stage < s) * n_params
    sharded = sum(w for w, s in zip(widths, (3, 2, 1)) if stage >= s) * n_params
    room = gpu_bytes - replicated
    if sharded == 0:
        return 1 if room >= 0 else None
    if room <= 0:
        return None
    n = 2 ** max(0, math.ceil(math.log2(sharded / room)))
    # float rounding of the logarithm: step to the exact smallest power that fits
    while n > 1 and replicated + sharded / (n // 2) <= gpu_bytes:
        n //= 2
    while replicated + sharded / n > gpu_bytes:
        n *= 2
    return n if n <= max_gpus else None


def min_gpus_bisect(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Memory falls as N grows: bisect over the exponents."""
    import bisect

    from dtlab import estimate as est

    exponents = range(int(math.log2(max_gpus)) + 1)

    def fits(e):
        got = est.zero_memory_per_device(n_params, 2**e, stage, precision, optimizer)
        return got["total"] <= gpu_bytes

    i = bisect.bisect_left(exponents, True, key=fits)
    return 2 ** exponents[i] if i < len(exponents) else None


def min_gpus_any_count(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Wrong: the smallest N of any size, not a power of two."""
    from dtlab import estimate as est

    for n in range(1, max_gpus + 1):
        need = est.zero_memory_per_device(n_params, n, stage, precision, optimizer)
        if need["total"] <= gpu_bytes:
            return n
    return None


def min_gpus_max_when_none(
    n_params, gpu_bytes, stage, precision="mixed", optimizer="adam", max_gpus=4096
):
    """Wrong: returns max_gpus where nothing fits, instead of None."""
    return (
        min_gpus_doubling(n_params, gpu_bytes, stage, precision, optimizer) or max_gpus
    )


@pytest.mark.parametrize(
    "answer", [min_gpus_doubling, min_gpus_closed_form, min_gpus_bisect]
)
def test_min_gpus_accepts_other_right_answers(answer):
    assert check_min_gpus(answer).passed


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (min_gpus_any_count, "(?i)power of two"),
        (min_gpus_max_when_none, "(?i)None"),
    ],
)
def test_min_gpus_names_the_cause(answer, cause):
    with pytest.raises(ExerciseFailed, match=cause):
        check_min_gpus(answer)


# ---- ch01 ring_reduce_scatter ---------------------------------------------------
def rs_on_a_copy_finishing_chunk_r(output, input):
    """A working copy; in step s rank r sends chunk r−s−1 and adds chunk r−s−2 in."""
    import torch

    from dtlab import comm

    r, n = comm.group_rank(), comm.group_size()
    work = input.detach().reshape(-1).clone()
    chunks = work.chunk(n)
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        send = comm.isend(chunks[(r - s - 1) % n], (r + 1) % n)
        recv = comm.irecv(incoming, (r - 1) % n)
        send.wait()
        recv.wait()
        chunks[(r - s - 2) % n].add_(incoming)
    output.copy_(chunks[r].view_as(output))


def rs_travelling_partial(output, input):
    """No copy of the input: one partial sum travels, rebuilt out of place each step
    from the chunk that arrived and this rank's own chunk; receive posted first,
    both waited through their futures."""
    import torch

    from dtlab import comm

    r, n = comm.group_rank(), comm.group_size()
    mine = torch.tensor_split(input.reshape(-1), n)
    partial = mine[(r - 1) % n].clone()
    for s in range(n - 1):
        arrived = torch.empty_like(partial)
        handles = [
            comm.irecv(arrived, (r - 1) % n),
            comm.isend(partial, (r + 1) % n),
        ]
        for h in reversed(handles):
            h.wait()
        partial = arrived + mine[(r - s - 2) % n]
    output.reshape(-1).copy_(partial)


def rs_with_the_world_group_named(output, input):
    """The world group passed explicitly to every call; the ring runs backwards
    through a list of chunk indices computed up front."""
    import torch
    import torch.distributed as dist

    from dtlab import comm

    world = dist.group.WORLD
    r, n = comm.group_rank(world), comm.group_size(world)
    order = [(r - 1 - s) % n for s in range(n)]  # chunk sent at step s
    acc = list(input.reshape(-1).clone().tensor_split(n))
    buf = torch.zeros_like(acc[0])
    for s in range(n - 1):
        out_h = comm.isend(acc[order[s]], (r + 1) % n, group=world)
        in_h = comm.irecv(buf, (r - 1) % n, group=world)
        in_h.wait()
        out_h.wait()
        acc[order[s + 1]] = acc[order[s + 1]] + buf
    output.copy_(acc[r].reshape(output.shape))


def rs_blocking_by_parity(output, input):
    """Blocking send/recv, even ranks sending first and odd ranks receiving first,
    so that the ring cannot deadlock: the same messages as isend/irecv."""
    import torch

    from dtlab import comm

    r, n = comm.group_rank(), comm.group_size()
    chunks = input.reshape(-1).clone().chunk(n)
    buf = torch.empty_like(chunks[0])
    for s in range(n - 1):
        outgoing = chunks[(r - s - 1) % n].contiguous()
        if r % 2 == 0:
            comm.send(outgoing, (r + 1) % n)
            comm.recv(buf, (r - 1) % n)
        else:
            comm.recv(buf, (r - 1) % n)
            comm.send(outgoing, (r + 1) % n)
        chunks[(r - s - 2) % n].add_(buf)
    output.copy_(chunks[r])


def rs_forgets_the_last_add(output, input):
    """Wrong: N−1 sends, but the last chunk that arrives is never added in."""
    import torch

    from dtlab import comm

    r, n = comm.group_rank(), comm.group_size()
    chunks = input.reshape(-1).clone().chunk(n)
    incoming = torch.empty_like(chunks[0])
    for s in range(n - 1):
        send = comm.isend(chunks[(r - s - 1) % n], (r + 1) % n)
        recv = comm.irecv(incoming, (r - 1) % n)
        send.wait()
        recv.wait()
        if s < n - 2:
            chunks[(r - s - 2) % n].add_(incoming)
        else:
            chunks[(r - s - 2) % n].copy_(incoming)
    output.copy_(chunks[r].view_as(output))


# ---- ch01 ring_all_reduce ----------------------------------------------------------
def ar_the_tables_schedule(tensor):
    """The notebook table's schedule (rank r finishes chunk r+1), a receive buffer,
    then the all-gather phase overwriting stale chunks with copy_."""
    import torch

    from dtlab import comm

    r, n = comm.group_rank(), comm.group_size()
    chunks = torch.tensor_split(tensor.view(-1), n)
    for s in range(n - 1):  # reduce-scatter
        got = torch.empty_like(chunks[(r - s - 1) % n])
        hs = comm.isend(chunks[(r - s) % n], (r + 1) % n)
        hr = comm.irecv(got, (r - 1) % n)
        hs.wait()
        hr.wait()
        chunks[(r - s - 1) % n].add_(got)
    for s in range(n - 1):  # all-gather: rank r holds chunk r+1 finished
        got = torch.empty_like(chunks[(r - s) % n])
        hs = comm.isend(chunks[(r + 1 - s) % n], (r + 1) % n)
        hr = comm.irecv(got, (r - 1) % n)
        hs.wait()
        hr.wait()
        chunks[(r - s) % n].copy_(got)


def ar_on_a_flat_copy_received_in_place(tensor):
    """Works on a flat copy (finishing chunk r), receives the all-gather phase straight
    into the chunk's view, and copies the result into ``tensor`` at the end."""
    import torch

    from dtlab import comm

    r, n = comm.group_rank(), comm.group_size()
    work = tensor.detach().reshape(-1).clone()
    chunks = work.chunk(n)
    for s in range(n - 1):
        got = torch.empty_like(chunks[(r - s - 2) % n])
        recv = comm.irecv(got, (r - 1) % n)
        send = comm.isend(chunks[(r - s - 1) % n], (r + 1) % n)
        recv.wait()
        send.wait()
        chunks[(r - s - 2) % n].add_(got)
    for s in range(n - 1):  # pass on the chunk finished most recently
        recv = comm.irecv(chunks[(r - s - 1) % n], (r - 1) % n)
        send = comm.isend(chunks[(r - s) % n], (r + 1) % n)
        recv.wait()
        send.wait()
    tensor.copy_(work.view_as(tensor))


def ar_phases_as_one_loop(tensor):
    """Both phases in one loop of 2(N−1) steps with the world group named, the
    phase deciding whether the arriving chunk is added or copied."""
    import torch
    import torch.distributed as dist

    from dtlab import comm

    g = dist.group.WORLD
    r, n = comm.group_rank(g), comm.group_size(g)
    flat = tensor.view(-1)
    bounds = [len(c) for c in torch.tensor_split(flat, n)]
    chunks = list(flat.split(bounds))
    for step in range(2 * (n - 1)):
        send_i = (r - step) % n
        recv_i = (r - step - 1) % n
        buf = torch.empty_like(chunks[recv_i])
        a = comm.isend(chunks[send_i], (r + 1) % n, group=g)
        b = comm.irecv(buf, (r - 1) % n, group=g)
        a.wait()
        b.wait()
        if step < n - 1:
            chunks[recv_i] += buf
        else:
            chunks[recv_i].copy_(buf)


def ar_gathers_the_unfinished_chunk(tensor):
    """Wrong: the all-gather phase starts from chunk r, which this rank has not
    finished (it finished chunk r+1)."""
    import torch

    from dtlab import comm

    r, n = comm.group_rank(), comm.group_size()
    chunks = torch.tensor_split(tensor.view(-1), n)
    for s in range(n - 1):
        got = torch.empty_like(chunks[(r - s - 1) % n])
        hs = comm.isend(chunks[(r - s) % n], (r + 1) % n)
        hr = comm.irecv(got, (r - 1) % n)
        hs.wait()
        hr.wait()
        chunks[(r - s - 1) % n].add_(got)
    for s in range(n - 1):
        got = torch.empty_like(chunks[(r - s - 1) % n])
        hs = comm.isend(chunks[(r - s) % n], (r + 1) % n)
        hr = comm.irecv(got, (r - 1) % n)
        hs.wait()
        hr.wait()
        chunks[(r - s - 1) % n].copy_(got)


for _answer in (
    rs_on_a_copy_finishing_chunk_r,
    rs_travelling_partial,
    rs_with_the_world_group_named,
    rs_blocking_by_parity,
    rs_forgets_the_last_add,
    ar_the_tables_schedule,
    ar_on_a_flat_copy_received_in_place,
    ar_phases_as_one_loop,
    ar_gathers_the_unfinished_chunk,
):
    ship_by_value(_answer)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "answer",
    [
        rs_on_a_copy_finishing_chunk_r,
        rs_travelling_partial,
        rs_with_the_world_group_named,
        rs_blocking_by_parity,
    ],
)
def test_ring_reduce_scatter_accepts_other_right_answers(answer, lab_cluster):
    assert check_ring_reduce_scatter(answer, lab_cluster(4)).passed


@pytest.mark.cluster
def test_ring_reduce_scatter_names_a_missing_add(lab_cluster):
    with pytest.raises(
        ExerciseFailed,
        match=r"without the contributions of ranks \[0\]: what arrived was copied",
    ):
        check_ring_reduce_scatter(rs_forgets_the_last_add, lab_cluster(4))


@pytest.mark.cluster
@pytest.mark.parametrize(
    "answer",
    [
        ar_the_tables_schedule,
        ar_on_a_flat_copy_received_in_place,
        ar_phases_as_one_loop,
    ],
)
def test_ring_all_reduce_accepts_other_right_answers(answer, lab_cluster):
    assert check_ring_all_reduce(answer, lab_cluster(4)).passed


@pytest.mark.cluster
def test_ring_all_reduce_names_the_wrong_chunk_gathered(lab_cluster):
    with pytest.raises(
        ExerciseFailed, match=r"no chunk is right, and chunk 0 holds chunk 0 without"
    ):
        check_ring_all_reduce(ar_gathers_the_unfinished_chunk, lab_cluster(4))

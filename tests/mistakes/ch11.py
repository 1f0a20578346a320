"""The mistakes learners make in chapter 11's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` and
``tests/test_exercises_ch11.py`` prove it)."""

from __future__ import annotations

import torch

from dtlab.exercises import ch11_beyond  # noqa: F401 - declares the exercises
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- merge_attention ---------------------------------------------------------------
@mistake("merge_attention", expect="share of the softmax mass")
def averages_the_outputs(out_a, lse_a, out_b, lse_b):
    """Averages the two blocks' outputs, as if each held half of the softmax mass."""
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


@mistake("merge_attention", expect="that is the larger lse")
def keeps_the_larger_lse(out_a, lse_a, out_b, lse_b):
    """Merges the outputs right but keeps max(lse_a, lse_b), the running max of the
    online softmax mistaken for its log-sum-exp: the next block is weighed wrong."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a
    out = out + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, torch.maximum(lse_a, lse_b)


@mistake("merge_attention", expect="multiplies the two masses")
def adds_the_log_sum_exps(out_a, lse_a, out_b, lse_b):
    """Adds the log-sum-exps, where the masses (their exponentials) add."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a
    out = out + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse_a + lse_b


@mistake("merge_attention", expect="overflows fp32")
def exponentiates_without_shifting(out_a, lse_a, out_b, lse_b):
    """Weighs each block by e^lse / (e^lse_a + e^lse_b) computed as written: right
    for small scores, inf / inf = nan once a log-sum-exp passes 88."""
    mass_a, mass_b = torch.exp(lse_a), torch.exp(lse_b)
    total = mass_a + mass_b
    out = (mass_a / total).unsqueeze(-1) * out_a + (mass_b / total).unsqueeze(
        -1
    ) * out_b
    return out, torch.log(total)


@mistake("merge_attention", expect="must sum to one")
def shifts_by_the_max_but_never_normalises(out_a, lse_a, out_b, lse_b):
    """Shifts by the larger log-sum-exp (stable) but forgets to divide by the
    merged mass: the weights exp(lse_x - max) add up to more than one."""
    m = torch.maximum(lse_a, lse_b)
    out = torch.exp(lse_a - m).unsqueeze(-1) * out_a
    out = out + torch.exp(lse_b - m).unsqueeze(-1) * out_b
    return out, torch.logaddexp(lse_a, lse_b)


@mistake("merge_attention", expect="swapped")
def swaps_the_weights(out_a, lse_a, out_b, lse_b):
    """Gives block a the weight of block b and the other way round."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_b - lse).unsqueeze(-1) * out_a
    out = out + torch.exp(lse_a - lse).unsqueeze(-1) * out_b
    return out, lse


# ---- moe_dispatch ------------------------------------------------------------------
def _dispatch(expert, n_experts, capacity, *, order="choice", keep="first", limit=0):
    """A dispatch with one of the learners' mistakes switched on."""
    N, k = expert.shape
    pairs = [(t, c) for c in range(k) for t in range(N)]
    if order == "token":
        pairs = [(t, c) for t in range(N) for c in range(k)]
    queues = [[] for _ in range(n_experts)]
    for t, c in pairs:
        queues[int(expert[t, c])].append(t)
    cap = capacity + limit
    queues = [q[-cap:] if keep == "last" else q[:cap] for q in queues]
    token = [t for q in queues for t in q]
    return torch.tensor(token), torch.tensor([len(q) for q in queues])


@mistake("moe_dispatch", expect="capacity is")
def ignores_the_capacity(expert, n_experts, capacity):
    """Sends every assignment to its expert: a hot expert takes all its tokens."""
    return _dispatch(expert, n_experts, capacity, limit=len(expert) * 2)


@mistake("moe_dispatch", expect="capacity is")
def lets_one_more_in(expert, n_experts, capacity):
    """Drops an assignment only once the queue is already past capacity
    (``slot <= capacity``): one row too many per full expert."""
    return _dispatch(expert, n_experts, capacity, limit=1)


@mistake("moe_dispatch", expect="before any token's second choice")
def serves_each_tokens_choices_together(expert, n_experts, capacity):
    """Walks token by token, both choices at once: token 0's second choice takes a
    slot before token 5's first choice is served."""
    return _dispatch(expert, n_experts, capacity, order="token")


@mistake("moe_dispatch", expect="reached it first")
def keeps_the_latest_arrivals(expert, n_experts, capacity):
    """A full expert keeps the last assignments that reached it, not the first."""
    return _dispatch(expert, n_experts, capacity, keep="last")


@mistake("moe_dispatch", expect="queue order")
def sorts_each_queue_by_token(expert, n_experts, capacity):
    """The right tokens per expert, each expert's sorted by token index instead of
    kept in the order they were served."""
    token, counts = _dispatch(expert, n_experts, capacity)
    parts = [p.sort().values for p in token.split(counts.tolist())]
    return torch.cat(parts), counts


@mistake("moe_dispatch", expect="not grouped by expert")
def keeps_priority_order_without_grouping(expert, n_experts, capacity):
    """Keeps the right assignments but lists them in priority order, not grouped by
    expert: the experts cannot read consecutive blocks."""
    N, k = expert.shape
    seen = [0] * n_experts
    token = []
    for c in range(k):
        for t in range(N):
            e = int(expert[t, c])
            if seen[e] < capacity:
                seen[e] += 1
                token.append(t)
    return torch.tensor(token), torch.tensor(seen)


# ---- all_to_all_splits -------------------------------------------------------------
def _splits(counts, rank, *, owner="block", self_piece=True, recv_from="column"):
    ep, E = len(counts), len(counts[0])
    per = E // ep

    def experts_of(j):
        return range(j * per, (j + 1) * per) if owner == "block" else range(j, E, ep)

    send = [sum(counts[rank][e] for e in experts_of(j)) for j in range(ep)]
    if recv_from == "column":
        recv = [sum(counts[i][e] for e in experts_of(rank)) for i in range(ep)]
    else:
        recv = list(send)
    if not self_piece:
        send[rank] = recv[rank] = 0
    return send, recv


@mistake("all_to_all_splits", expect="swapped")
def swaps_send_and_recv(counts, rank):
    """Returns what it receives as what it sends."""
    send, recv = _splits(counts, rank)
    return recv, send


@mistake("all_to_all_splits", expect="contiguous blocks")
def assigns_experts_round_robin(counts, rank):
    """Takes expert e to live on rank e mod ep; dtlab (like GShard's sharding) gives
    rank j a contiguous block of E/ep experts."""
    return _splits(counts, rank, owner="round robin")


@mistake("all_to_all_splits", expect="own piece")
def leaves_out_its_own_rows(counts, rank):
    """Sets its own entry to 0, since those rows never cross the wire; but the
    all-to-all's splits must cover every row of its input and output."""
    return _splits(counts, rank, self_piece=False)


@mistake("all_to_all_splits", expect="YOUR experts")
def receives_what_it_sends(counts, rank):
    """Assumes the exchange is symmetric: recv = send. Rank i sends your experts
    what ITS tokens chose, read from its row of the matrix."""
    return _splits(counts, rank, recv_from="own row")


@mistake("all_to_all_splits", expect="not per expert")
def returns_rows_per_expert(counts, rank):
    """Returns the counts per expert, one entry per expert rather than per rank."""
    column = [sum(row[e] for row in counts) for e in range(len(counts[0]))]
    return list(counts[rank]), column

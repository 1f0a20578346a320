"""Chapter 11's reference solutions: the online-softmax merge of two partial
attention results (ring attention's inner step), the dispatch permutation of a
mixture-of-experts layer with an expert capacity, and the all-to-all splits of
expert parallelism. ``dtlab.exercises.solution(name)`` shows each;
:mod:`.ch11_beyond` checks a learner's against them."""

from __future__ import annotations

import torch

__all__ = ["merge_attention", "moe_dispatch", "all_to_all_splits"]


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Merge two partial attention results over the same queries, each computed
    against its own block of keys: ``out_x`` ``(B, nh, T, hs)`` is the block's
    normalised output, ``lse_x`` ``(B, nh, T)`` the log-sum-exp of its scores.
    Return ``(out, lse)``: exactly the attention over both blocks' keys together
    (Milakov & Gimelshein 2018; FlashAttention-2 §3.1)."""
    lse = torch.logaddexp(lse_a, lse_b)  # log(e^lse_a + e^lse_b), never overflows
    # each block's share of the softmax mass: e^lse_a / (e^lse_a + e^lse_b)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)  # (B, nh, T, 1), in [0, 1]
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


def moe_dispatch(expert, n_experts, capacity):
    """The dispatch permutation of a top-k router. ``expert`` ``(N, k)`` holds each
    token's chosen experts, best first; an expert accepts at most ``capacity``
    assignments. Serve them in GShard's priority order (every token's first choice,
    in token order, before any token's second choice) and drop an assignment that
    finds its expert full. Return ``(token, counts)``: ``token`` ``(M,)`` the token
    of each kept assignment, grouped by expert (expert 0's first), each expert's in
    the order it was served; ``counts`` ``(E,)`` the kept assignments per expert."""
    N, k = expert.shape
    queues = [[] for _ in range(n_experts)]
    for choice in range(k):  # all first choices, then all second choices
        for t in range(N):
            e = int(expert[t, choice])
            if len(queues[e]) < capacity:  # a full expert drops the assignment
                queues[e].append(t)
    token = torch.tensor([t for queue in queues for t in queue], dtype=torch.long)
    counts = torch.tensor([len(queue) for queue in queues], dtype=torch.long)
    return token, counts


def all_to_all_splits(counts, rank):
    """The splits of expert parallelism's dispatch all-to-all on rank ``rank``.
    ``counts[s][e]`` is how many rows rank s sends to expert e (every rank knows the
    whole ``(ep, E)`` matrix after the all-gather of the counts); rank j owns the
    experts ``j·E/ep … (j+1)·E/ep - 1``. Return ``(send_rows, recv_rows)``, one
    entry per rank: the rows this rank sends to rank j, and the rows it receives
    from rank i (``dtlab.comm.all_to_all_single``'s input and output splits; the
    entry for this rank itself is the rows it keeps)."""
    ep, E = len(counts), len(counts[0])
    per = E // ep

    def experts_of(j):
        return range(j * per, (j + 1) * per)

    send = [sum(counts[rank][e] for e in experts_of(j)) for j in range(ep)]
    recv = [sum(counts[i][e] for e in experts_of(rank)) for i in range(ep)]
    return send, recv

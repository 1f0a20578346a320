"""Chapter 11's exercises: the online-softmax merge at the heart of ring attention,
and the two halves of expert parallelism's dispatch (which token goes to which
expert, and how many rows travel between which ranks).

1. ``merge_attention``: the learner's merge of two partial attention results
   ``(out, lse)`` against attention over all the keys at once, on four hidden
   cases: two uneven blocks, three blocks merged in turn (a wrong log-sum-exp shows
   in the next merge), one block carrying almost all of the softmax mass, and scores
   as large as long sequences give (log-sum-exps near 400, where ``exp`` overflows
   fp32). The reference agrees with
   :func:`dtlab.context_parallel.merge_attention_blocks`; calling it is refused.
2. ``moe_dispatch``: the dispatch permutation and the kept assignments per expert
   for hidden routings (top-1 and top-2, a skewed router, capacities that bind and
   one that does not), against :func:`dtlab.moe.top_k_routing` and
   :func:`dtlab.moe.dispatch_order` on the same router logits (the checker asserts
   that the reference reproduces them).
3. ``all_to_all_splits``: the input and output splits of the dispatch all-to-all
   on every rank of hidden ``(ep, E)`` count matrices, against what
   :class:`dtlab.moe.ExpertParallelDispatch` computes, and the all-to-all's
   consistency: what rank i sends to rank j is what j receives from i.
"""

from __future__ import annotations

import torch

from dtlab.context_parallel import block_attention, merge_attention_blocks
from dtlab.exercises.ch11_solutions import (
    all_to_all_splits,
    merge_attention,
    moe_dispatch,
)
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.watch import Watch
from dtlab.model import param_generator
from dtlab.moe import dispatch_order, top_k_routing

__all__ = ["check_merge_attention", "check_moe_dispatch", "check_all_to_all_splits"]


# ---- 1. the online-softmax merge ---------------------------------------------------
ATOL = 1e-5  # fp32; the merge itself adds a few roundings of ~1e-7 relative
SHAPE = (2, 3, 5, 8)  # (B, nh, T, hs)


def _qkv(case: str, n_keys: int):
    gen = param_generator(0, f"merge/{case}")
    B, nh, T, hs = SHAPE
    q = torch.randn(B, nh, T, hs, generator=gen)
    k = torch.randn(B, nh, n_keys, hs, generator=gen)
    v = torch.randn(B, nh, n_keys, hs, generator=gen)
    return q, k, v


def _cases():
    """``(name, q, k, v, cuts)``: the keys cut into blocks at ``cuts``."""
    out = []
    q, k, v = _qkv("uneven", 11)
    out.append(("two uneven blocks (3 and 8 keys)", q, k, v, (3,)))
    q, k, v = _qkv("three", 12)
    out.append(("three blocks merged in turn", q, k, v, (4, 8)))
    q, k, v = _qkv("dominant", 10)
    k[..., :5, :] += 2.0 * q.mean(dim=2, keepdim=True)  # block a draws the queries
    out.append(("one block holding almost all of the mass", q, k, v, (5,)))
    q, k, v = _qkv("large", 10)
    out.append(("scores of a long sequence (lse ≈ 400)", 40.0 * q, 4.0 * k, v, (6,)))
    return out


def _full(q, k, v):
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5  # (B, nh, T, Tk)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _blocks(q, k, v, cuts):
    edges = (0, *cuts, k.shape[-2])
    return [
        block_attention(q, k[..., a:b, :], v[..., a:b, :])
        for a, b in zip(edges, edges[1:])
    ]


def _lse_hint(lse, lse_a, lse_b) -> str:
    if not torch.isfinite(lse).all():
        return (
            "it is not finite: exp(lse) overflows fp32 above 88. Compute "
            "log(e^lse_a + e^lse_b) without leaving log space: torch.logaddexp, or "
            "m + log(e^(lse_a - m) + e^(lse_b - m)) with m the larger."
        )
    if torch.allclose(lse, torch.maximum(lse_a, lse_b), atol=ATOL):
        return (
            "that is the larger lse, not the log-sum-exp of the merged blocks: "
            "log(e^lse_a + e^lse_b) is above both (torch.logaddexp)."
        )
    if torch.allclose(lse, lse_a + lse_b, atol=ATOL):
        return (
            "adding two log-sum-exps multiplies the two masses; the merged mass is "
            "their sum: log(e^lse_a + e^lse_b) (torch.logaddexp)."
        )
    return "the merged log-sum-exp is log(e^lse_a + e^lse_b) (torch.logaddexp)."


def _out_hint(out, inputs) -> str:
    out_a, lse_a, out_b, lse_b = inputs
    m = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - torch.logaddexp(lse_a, lse_b)).unsqueeze(-1)
    if not torch.isfinite(out).all():
        return (
            "it is not finite: exp(lse) overflows fp32 above 88. Weigh each block "
            "by exp(lse_x - lse), with lse the merged log-sum-exp: a number in [0, 1]."
        )
    alternatives = {
        "averaging weighs both blocks equally, whatever their keys: each block "
        "counts by its share of the softmax mass, exp(lse_x - lse).": (out_a + out_b)
        / 2,
        "the two weights must sum to one: each block's is its share of the mass, "
        "exp(lse_x - lse), where lse is the merged log-sum-exp, not the larger "
        "one.": torch.exp(lse_a - m).unsqueeze(-1) * out_a
        + torch.exp(lse_b - m).unsqueeze(-1) * out_b,
        "the weights are swapped: block a's output takes exp(lse_a - lse), block "
        "b's exp(lse_b - lse).": (1 - w_a) * out_a + w_a * out_b,
    }
    for hint, wrong in alternatives.items():
        if torch.allclose(out, wrong, atol=ATOL):
            return hint
    return "weigh each block's output by exp(lse_x - lse) and add them."


def _as_pair(got, what: str):
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise ExerciseFailed(f"{what}: return the pair (out, lse), got {type(got)}")
    out, lse = got
    if not (isinstance(out, torch.Tensor) and out.shape == SHAPE):
        shape = tuple(getattr(out, "shape", ()))
        raise ExerciseFailed(f"{what}: out must be {SHAPE}, got {shape}")
    if not (isinstance(lse, torch.Tensor) and lse.shape == SHAPE[:-1]):
        shape = tuple(getattr(lse, "shape", ()))
        raise ExerciseFailed(f"{what}: lse must be {SHAPE[:-1]}, got {shape}")
    return out, lse


@exercise(
    "merge_attention",
    chapter=11,
    reference=merge_attention,
    local=True,
    measures=(
        "out and lse == attention over all keys at once (±1e-5) on 4 hidden cases: "
        "uneven blocks, three merged in turn, a dominant block, lse ≈ 400 (overflow)"
    ),
)
def check_merge_attention(solution, cluster=None):
    forbidden = {
        merge_attention_blocks: "dtlab.context_parallel.merge_attention_blocks"
    }
    for what, q, k, v, cuts in _cases():
        pieces = _blocks(q, k, v, cuts)
        out, lse = pieces[0]
        with Watch(forbidden) as seen:
            for out_b, lse_b in pieces[1:]:
                inputs = (out, lse, out_b, lse_b)
                got = attempt(solution, *(t.clone() for t in inputs))
                out, lse = _as_pair(got, what)
                want_out, want_lse = merge_attention(*inputs)
                if not torch.allclose(lse, want_lse, atol=ATOL):
                    raise ExerciseFailed(
                        f"{what}: lse is off by {(lse - want_lse).abs().max():.3g}: "
                        + _lse_hint(lse, inputs[1], lse_b)
                    )
                if not torch.allclose(out, want_out, atol=ATOL):
                    raise ExerciseFailed(
                        f"{what}: out is off by {(out - want_out).abs().max():.3g} "
                        "from attention over both blocks' keys: "
                        + _out_hint(out, inputs)
                    )
        if seen.forbidden:
            raise ExerciseFailed(
                f"you called {', '.join(seen.forbidden)}: write the merge yourself "
                "(log-sum-exps and exponentials)."
            )
        full_out, full_lse = _full(q, k, v)  # the point: it is attention itself
        assert torch.allclose(out, full_out, atol=ATOL), what
        assert torch.allclose(lse, full_lse, atol=ATOL), what
    return [
        "out and lse equal attention over all the keys at once on 4 hidden cases",
        "three blocks merged in turn, and scores whose exp overflows fp32",
    ]


# ---- 2. the dispatch permutation ---------------------------------------------------
def _routings():
    """``(name, expert (N, k), E, capacity)``, from router logits through
    dtlab.moe's top-k, with what dtlab.moe's dispatch gives for them."""
    out = []
    specs = [
        ("top-1, capacity 3 of 12 tokens", 12, 4, 1, 3, 0.0),
        ("top-2, capacity 5", 12, 4, 2, 5, 0.0),
        ("top-2, a skewed router, capacity 4", 16, 4, 2, 4, 1.5),
        ("top-2, capacity 20 (nothing dropped)", 10, 4, 2, 20, 0.0),
        ("top-1, 8 experts, capacity 2", 20, 8, 1, 2, 1.0),
    ]
    for name, N, E, k, capacity, skew in specs:
        logits = torch.randn(N, E, generator=param_generator(0, f"dispatch/{name}"))
        logits[:, 0] += skew  # a hot expert
        routing = top_k_routing(logits, k, capacity)
        token, _, counts = dispatch_order(routing)
        out.append((name, routing.expert.clone(), E, capacity, token, counts))
    return out


def _alternative(expert, E, capacity, *, token_major=False, keep_last=False):
    """The dispatch a mistaken priority or drop rule gives (for the hints)."""
    N, k = expert.shape
    order = (
        [(t, c) for t in range(N) for c in range(k)]
        if token_major
        else [(t, c) for c in range(k) for t in range(N)]
    )
    queues = [[] for _ in range(E)]
    for t, c in order:
        queues[int(expert[t, c])].append(t)
    queues = [(q[-capacity:] if keep_last else q[:capacity]) for q in queues]
    return [t for q in queues for t in q], [len(q) for q in queues]


def _groups(token, counts) -> list[list[int]]:
    """Each expert's rows of a dispatch buffer."""
    edges = [sum(counts[:e]) for e in range(len(counts) + 1)]
    return [token[a:b] for a, b in zip(edges, edges[1:])]


def _dispatch_hint(token, expert, E, capacity) -> str:
    if token == _alternative(expert, E, capacity, token_major=True)[0]:
        return (
            "you served each token's choices together; GShard serves every token's "
            "first choice before any token's second choice, so a second choice "
            "never takes a slot a first choice needed."
        )
    if token == _alternative(expert, E, capacity, keep_last=True)[0]:
        return (
            "a full expert keeps the assignments that reached it first, in "
            "priority order, and drops the later ones."
        )
    return (
        "serve the assignments in priority order (first choices in token order, "
        "then second choices), drop one that finds its expert full."
    )


@exercise(
    "moe_dispatch",
    chapter=11,
    reference=moe_dispatch,
    local=True,
    measures=(
        "token permutation and kept counts per expert == dtlab.moe's top_k_routing "
        "+ dispatch_order on 5 hidden routings (top-1/2, skewed, binding capacity)"
    ),
)
def check_moe_dispatch(solution, cluster=None):
    for name, expert, E, capacity, want_token, want_counts in _routings():
        ref_token, ref_counts = moe_dispatch(expert, E, capacity)
        assert torch.equal(ref_token, want_token), name  # the reference is dtlab's
        assert torch.equal(ref_counts, want_counts), name
        got = attempt(solution, expert.clone(), E, capacity)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            raise ExerciseFailed(f"{name}: return the pair (token, counts)")
        token = [int(t) for t in torch.as_tensor(got[0]).reshape(-1)]
        counts = [int(c) for c in torch.as_tensor(got[1]).reshape(-1)]
        if len(counts) != E:
            raise ExerciseFailed(
                f"{name}: counts has {len(counts)} entries: one per expert ({E})"
            )
        # counts that disagree with token first: counts of the routed assignments
        # beside a token of the kept ones exceed the capacity too
        if sum(counts) != len(token):
            raise ExerciseFailed(
                f"{name}: counts add up to {sum(counts)} but token has {len(token)} "
                "rows: count the kept assignments, one row each."
            )
        for e, n in enumerate(counts):
            if n > capacity:
                raise ExerciseFailed(
                    f"{name}: expert {e} takes {n} rows, but its capacity is "
                    f"{capacity}: an assignment that finds its expert full is "
                    "dropped (the token skips that expert; the residual carries it)."
                )
        want = want_token.tolist()
        if token == want and counts == want_counts.tolist():
            continue
        groups = _groups(token, counts)
        want_groups = _groups(want, want_counts.tolist())
        if groups != want_groups and all(
            sorted(g) == sorted(w) for g, w in zip(groups, want_groups)
        ):
            raise ExerciseFailed(
                f"{name}: the right tokens reach each expert, in another order: "
                "inside an expert the rows keep their queue order, the order they "
                "were served in: every token's first choice before any token's "
                "second choice, each in token order. Row i of expert e's block is "
                "slot i of its capacity buffer (GShard's (E, C) dispatch tensor), "
                "where a fixed-capacity combine reads the output back from."
            )
        if sorted(token) == sorted(want) and counts == want_counts.tolist():
            raise ExerciseFailed(
                f"{name}: the kept tokens are right but not grouped by expert "
                "(expert 0's rows first, then expert 1's, …): each expert reads "
                "one consecutive block of the buffer, counts[e] rows long."
            )
        wrong = [e for e in range(E) if groups[e] != want_groups[e]]
        raise ExerciseFailed(
            f"{name}: expert(s) {wrong} get {[groups[e] for e in wrong]}, expected "
            f"{[want_groups[e] for e in wrong]}: "
            + _dispatch_hint(token, expert, E, capacity)
        )
    return [
        "the dispatch permutation and the kept counts of dtlab.moe on 5 hidden "
        "routings, capacities binding and not"
    ]


# ---- 3. the all-to-all splits ------------------------------------------------------
def _matrices():
    """``(ep, E, counts)``: hidden ``(ep, E)`` matrices of rows per expert."""
    out = []
    for ep, E in ((2, 4), (4, 4), (4, 8)):
        gen = param_generator(0, f"splits/{ep}/{E}")
        counts = torch.randint(0, 9, (ep, E), generator=gen)
        counts[:, 0] += 6  # a hot expert, so the ranks' loads differ
        out.append((ep, E, counts.tolist()))
    return out


def _splits_hint(send, recv, counts, rank, want) -> str:
    ep, E = len(counts), len(counts[0])
    if (send, recv) == (want[1], want[0]) and send != recv:
        return "send and recv are swapped."
    round_robin = (
        [sum(counts[rank][e] for e in range(j, E, ep)) for j in range(ep)],
        [sum(counts[i][e] for e in range(rank, E, ep)) for i in range(ep)],
    )
    if (send, recv) == round_robin and E > ep:
        return (
            "experts are owned in contiguous blocks: rank j holds experts "
            "j·E/ep … (j+1)·E/ep - 1, not every ep-th expert."
        )
    if send[rank] == 0 and want[0][rank] != 0 or recv[rank] == 0 and want[1][rank]:
        return (
            "all_to_all_single's splits include this rank's own piece (the rows it "
            "keeps for its own experts); they are just never on the wire."
        )
    if recv == send:
        return (
            "recv[i] is what rank i sends to YOUR experts: read rank i's row of the "
            "matrix at your experts' columns, not your own row."
        )
    return (
        "send[j] sums your row of the matrix over rank j's experts; recv[i] sums "
        "rank i's row over your experts."
    )


@exercise(
    "all_to_all_splits",
    chapter=11,
    reference=all_to_all_splits,
    local=True,
    measures=(
        "send and recv splits of the dispatch all-to-all on every rank of 3 hidden "
        "(ep, E) count matrices == dtlab.moe's; i's send to j == j's recv from i"
    ),
)
def check_all_to_all_splits(solution, cluster=None):
    for ep, E, counts in _matrices():
        got_all = []
        for rank in range(ep):
            want = all_to_all_splits(counts, rank)
            got = attempt(solution, [list(row) for row in counts], rank)
            if not (isinstance(got, tuple | list) and len(got) == 2):
                raise ExerciseFailed("return the pair (send_rows, recv_rows)")
            send, recv = ([int(n) for n in split] for split in got)
            where = f"ep={ep}, {E} experts, rank {rank}"
            if len(send) != ep or len(recv) != ep:
                raise ExerciseFailed(
                    f"{where}: send has {len(send)} entries and recv {len(recv)}: "
                    f"the all-to-all's splits have one entry per rank ({ep}), not "
                    "per expert."
                )
            if (send, recv) != want:
                raise ExerciseFailed(
                    f"{where}: you say send={send}, recv={recv}; the matrix "
                    f"{counts} gives send={want[0]}, recv={want[1]}: "
                    + _splits_hint(send, recv, counts, rank, want)
                )
            got_all.append((send, recv))
        for i in range(ep):  # what i sends to j is what j receives from i
            for j in range(ep):
                assert got_all[i][0][j] == got_all[j][1][i]
    return [
        "the splits of every rank on 3 hidden matrices (ep 2 and 4, 4 and 8 experts)",
        "every rank's send to j is what j expects to receive",
    ]

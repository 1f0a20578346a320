"""Ring attention: each rank keeps its queries and passes its keys and values round
the ring of cp ranks, one block per step, merging the partial results with the
online softmax.

Taught in chapter 11 (long context). Sources:

- Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
  Near-Infinite Context", §3: a rank computes attention of its query block against
  the K/V block it holds while the next block is already on its way, so the ring's
  traffic hides behind the block's compute.
- Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", and Dao
  2023, "FlashAttention-2", §3.1: a block's result is ``(O_b, lse_b)``, its
  normalised output and the log-sum-exp of its scores; two blocks merge exactly::

      lse = log(e^lse_a + e^lse_b)
      O   = e^(lse_a - lse) · O_a + e^(lse_b - lse) · O_b

  Backward needs only ``lse`` and ``D = rowsum(dO ∘ O)`` to recompute each block's
  probabilities ``P = exp(S - lse)`` and its gradients (FlashAttention-2, §3.1.2).
- Megatron-LM's context parallelism and torchtitan's load balancer: with the
  load-balanced layout (:mod:`.sharding`: rank i holds chunks i and 2·cp-1-i) every
  step but the first does exactly half a block of causal work on every rank.

Per layer and microbatch each rank sends its K/V block ``cp - 1`` times forward,
and backward ``cp - 1`` times again plus ``cp - 1`` hops of the dK/dV accumulators:
``3·(cp-1)`` blocks of ``2·b·(s/cp)·h`` values
(:func:`dtlab.estimate.cp_bytes_per_layer`).

Tensors are ``(B, nh, T, hs)``, T this rank's ``2·c`` tokens (two chunks of c).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dtlab import comm
from dtlab.context_parallel.sharding import local_positions

__all__ = [
    "block_attention",
    "merge_attention_blocks",
    "block_attention_backward",
    "RingStep",
    "ring_schedule",
    "RingAttention",
    "ring_attention",
]


# ---- one block -----------------------------------------------------------------------
def block_attention(q, k, v, mask=None):
    """Attention of ``q`` against one K/V block: ``(O_b, lse_b)``, the block's
    normalised output ``(B, nh, Tq, hs)`` and the log-sum-exp of its scores
    ``(B, nh, Tq)``. ``mask`` (bool ``(Tq, Tk)``, True = may attend) is the causal
    mask where the block needs one."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B,nh,Tq,Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, nh, Tq)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge_attention_blocks(out_a, lse_a, out_b, lse_b):
    """The online-softmax merge of two blocks' results over the same queries:
    exactly the attention over both blocks' keys together."""
    lse = torch.logaddexp(lse_a, lse_b)  # (B, nh, Tq)
    weight_a = torch.exp(lse_a - lse).unsqueeze(-1)  # each block's share of the mass
    weight_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return weight_a * out_a + weight_b * out_b, lse


def block_attention_backward(dout, q, k, v, lse, delta, mask=None):
    """One block's share of the gradients, from the *final* ``lse`` and
    ``delta = rowsum(dO ∘ O)`` (FlashAttention-2, §3.1.2): ``(dQ_b, dK_b, dV_b)``.

    ``P = exp(S - lse)`` are the block's entries of the whole softmax, so
    ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - delta)``, ``dQ = dS K / √hs``,
    ``dK = dSᵀ Q / √hs``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))  # (B, nh, Tq, Tk)
    dv = p.transpose(-2, -1) @ dout  # (B, nh, Tk, hs)
    ds = p * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1))  # (B, nh, Tq, Tk)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, dv


# ---- the schedule, as data -----------------------------------------------------------
class RingStep(NamedTuple):
    """What rank ``index`` computes at one step: its ``queries`` ("both" chunks or
    the "late" one) against the ``keys`` ("both" or the "early" one) of the K/V block
    that came from rank ``source``; ``causal`` on the rank's own block only."""

    step: int
    source: int
    queries: str
    keys: str
    causal: bool


def ring_schedule(cp: int, index: int) -> list[RingStep]:
    """The load-balanced ring's steps on rank ``index`` (chunks ``index`` = early,
    ``2·cp-1-index`` = late). At step s the K/V block of rank ``j = index - s``
    arrives; for ``j < index`` its early chunk precedes both of ours and its late
    chunk follows both: all queries, early keys. For ``j > index`` its early chunk
    follows ours but precedes our late one, and its late chunk precedes our late
    one: late queries, all keys. Each is half a block, on every rank."""
    steps = []
    for s in range(cp):
        j = (index - s) % cp
        if s == 0:
            steps.append(RingStep(s, j, "both", "both", True))
        elif j < index:
            steps.append(RingStep(s, j, "both", "early", False))
        else:
            steps.append(RingStep(s, j, "late", "both", False))
    return steps


def _rows(which: str, c: int) -> slice:
    return {"both": slice(None), "early": slice(0, c), "late": slice(c, 2 * c)}[which]


class _Hop:
    """One step round the ring, posted now: ``tensor`` to the next rank, the
    previous rank's into a fresh buffer; :meth:`wait` returns what arrived."""

    def __init__(self, tensor, group, tag):
        cp, i = comm.group_size(group), comm.group_rank(group)
        self.incoming = torch.empty_like(tensor)
        self.works = [
            comm.isend(tensor, (i + 1) % cp, group, tag=tag),
            comm.irecv(self.incoming, (i - 1) % cp, group, tag=tag),
        ]

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.incoming


def _own_mask(T, cp, index, device):
    """The causal mask of the rank's own block: its two chunks' global positions."""
    pos = local_positions(T * cp, cp, index, True).to(device)  # (T,)
    return pos.unsqueeze(1) >= pos.unsqueeze(0)  # (T, T)


# ---- forward and backward round the ring ---------------------------------------------
class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's keys, with the
    K/V blocks (forward) and K/V blocks plus dK/dV accumulators (backward) passed
    round the ring through :func:`dtlab.comm.isend` / :func:`~dtlab.comm.irecv`,
    each hop posted before the step's compute and awaited after it."""

    @staticmethod
    def forward(ctx, q, k, v, group, tag):
        cp, index = comm.group_size(group), comm.group_rank(group)
        T = q.shape[-2]
        c, mask = T // 2, _own_mask(T, cp, index, q.device)
        kv = torch.stack([k, v])  # (2, B, nh, T, hs): one message per hop
        out = lse = None
        for st in ring_schedule(cp, index):
            hop = _Hop(kv, group, f"{tag}:fwd") if st.step + 1 < cp else None
            qs, ks = _rows(st.queries, c), _rows(st.keys, c)
            o_b, lse_b = block_attention(
                q[..., qs, :],
                kv[0, ..., ks, :],
                kv[1, ..., ks, :],
                mask if st.causal else None,
            )
            if out is None:  # the own block comes first and covers every query
                out, lse = o_b, lse_b
            else:
                out[..., qs, :], lse[..., qs] = merge_attention_blocks(
                    out[..., qs, :], lse[..., qs], o_b, lse_b
                )
            if hop is not None:
                kv = hop.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.tag = group, tag
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, tag = ctx.group, f"{ctx.tag}:bwd"
        cp, index = comm.group_size(group), comm.group_rank(group)
        T = q.shape[-2]
        c, mask = T // 2, _own_mask(T, cp, index, q.device)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # (B, nh, T): FlashAttention-2's D
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])  # the same blocks go round again
        own = accumulated = None
        for st in ring_schedule(cp, index):
            hop = _Hop(kv, group, tag) if st.step + 1 < cp else None
            qs, ks = _rows(st.queries, c), _rows(st.keys, c)
            dq_b, dk_b, dv_b = block_attention_backward(
                dout[..., qs, :],
                q[..., qs, :],
                kv[0, ..., ks, :],
                kv[1, ..., ks, :],
                lse[..., qs],
                delta[..., qs],
                mask if st.causal else None,
            )
            dq[..., qs, :] += dq_b
            dkv = torch.zeros_like(kv)  # (2, B, nh, T, hs): this block's dK, dV
            dkv[0, ..., ks, :], dkv[1, ..., ks, :] = dk_b, dv_b
            if st.step == 0:
                own = dkv  # the owner adds its share last, when the rest comes home
            else:
                # the ranks between the block's owner and us added theirs already;
                # ours joins, and the sum moves on (the last hop reaches the owner)
                if accumulated is not None:
                    dkv += accumulated.wait()
                accumulated = _Hop(dkv, group, tag)
            if hop is not None:
                kv = hop.wait()
        if accumulated is not None:
            own = own + accumulated.wait()  # every other rank's share of our block
        return dq, own[0], own[1], None, None


def ring_attention(q, k, v, group, *, tag: str = "attn"):
    """Causal ring attention over the cp group ``group``: ``q, k, v`` are this
    rank's ``(B, nh, T/cp, hs)`` in the load-balanced layout
    (:func:`~dtlab.context_parallel.shard_sequence` with ``variant="ring"``); the
    result is the attention output of this rank's queries over the whole sequence,
    ``(B, nh, T/cp, hs)``. Events are tagged ``tag:fwd`` and ``tag:bwd``."""
    if q.shape != k.shape or k.shape != v.shape or q.dim() != 4:
        raise ValueError(
            f"ring_attention needs q, k, v of one shape (B, nh, T, hs), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-2] % 2:
        raise ValueError(
            f"the load-balanced ring holds two chunks per rank: {q.shape[-2]} local "
            "tokens do not split in two; shard with shard_sequence(x, group, 'ring')"
        )
    return RingAttention.apply(q, k, v, group, tag)

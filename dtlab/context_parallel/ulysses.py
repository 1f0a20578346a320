"""DeepSpeed-Ulysses: trade the sequence shard for a head shard, attend, trade back.

Taught in chapter 11 (long context). Jacobs et al. 2023, "DeepSpeed Ulysses: System
Optimizations for Enabling Training of Extreme Long Sequence Transformer Models",
§3: before attention an all-to-all turns ``(B, nh, T/cp, hs)`` (every head, this
rank's tokens) into ``(B, nh/cp, T, hs)`` (this rank's heads, every token); any
local attention runs on that, unchanged; a second all-to-all turns the result back.
Heads are independent, so nothing else needs the other ranks.

Per layer each rank sends ``(cp-1)/cp`` of its q, k, v and of its output forward,
and the same again backward (the transpose of an all-to-all is the all-to-all the
other way): ``2 · (cp-1)/cp · 4·b·(s/cp)·h`` values
(:func:`dtlab.estimate.cp_bytes_per_layer`), a volume that shrinks with cp where
the ring's stays. The price: ``n_heads`` must be a multiple of cp (ValueError
otherwise), and cp can never exceed the number of heads.

Ulysses uses the contiguous layout (:mod:`.sharding`): after the all-to-all the
chunks arrive in rank order, so the whole sequence is in its natural order and the
plain causal mask applies.
"""

from __future__ import annotations

import torch

from dtlab import comm

__all__ = ["all_to_all_along", "SeqAllToAll", "ulysses_attention"]


def all_to_all_along(x, scatter_dim: int, gather_dim: int, group, tag: str):
    """Cut ``x`` into cp pieces along ``scatter_dim``, send piece j to rank j, and
    concatenate what arrives along ``gather_dim`` in rank order (no autograd)."""
    cp = comm.group_size(group)
    send = torch.stack(x.chunk(cp, scatter_dim))  # (cp, ...): piece j for rank j
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group, tag=tag)
    return torch.cat(recv.unbind(0), dim=gather_dim)  # piece i came from rank i


class SeqAllToAll(torch.autograd.Function):
    """The all-to-all of Ulysses as an autograd function: forward scatters
    ``scatter_dim`` and gathers ``gather_dim``; backward does the opposite."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, tag):
        ctx.args = (group, scatter_dim, gather_dim, tag)
        return all_to_all_along(x, scatter_dim, gather_dim, group, f"{tag}:fwd")

    @staticmethod
    def backward(ctx, dy):
        group, scatter_dim, gather_dim, tag = ctx.args
        dx = all_to_all_along(dy, gather_dim, scatter_dim, group, f"{tag}:bwd")
        return dx, None, None, None, None


def ulysses_attention(q, k, v, group, local_attention, *, tag: str = "attn"):
    """``local_attention(q, k, v)`` over the whole sequence, with the heads split
    over the cp group: ``q, k, v`` are this rank's ``(B, nh, T/cp, hs)`` in the
    contiguous layout; the result is the same shape. ``local_attention`` maps
    ``(B, nh/cp, T, hs)`` each to ``(B, nh/cp, T, hs)`` (dtlab.model's
    ``CausalSelfAttention.core``, the way DeepSpeed wraps any local attention)."""
    cp, nh = comm.group_size(group), q.shape[1]
    if nh % cp:
        raise ValueError(
            f"Ulysses gives each of the cp={cp} ranks n_heads / cp heads: "
            f"n_heads={nh} is not a multiple of {cp}; use ring attention or a cp "
            "that divides n_heads"
        )
    if cp == 1:  # nothing to trade: the local attention is the whole attention
        return local_attention(q, k, v)
    qkv = torch.stack([q, k, v])  # (3, B, nh, T/cp, hs): one all-to-all for three
    # heads scattered (dim 2), sequence gathered (dim 3)
    qkv = SeqAllToAll.apply(qkv, group, 2, 3, f"{tag}.qkv")  # (3, B, nh/cp, T, hs)
    y = local_attention(qkv[0], qkv[1], qkv[2])  # (B, nh/cp, T, hs)
    # sequence scattered (dim 2), heads gathered (dim 1)
    return SeqAllToAll.apply(y, group, 2, 1, f"{tag}.out")  # (B, nh, T/cp, hs)

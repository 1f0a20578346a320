"""Which tokens of the sequence each context-parallel rank holds.

Taught in chapter 11 (long context). Context parallelism cuts every sequence, not
the batch: rank i of the cp group holds a slice of each sequence's positions, and
everything position-wise (embeddings, LayerNorms, MLPs, the loss) runs on that slice
alone. Only attention needs the other ranks' tokens.

Two layouts:

- **contiguous** (Ulysses): rank i holds chunk i of cp equal chunks. Ulysses gathers
  the whole sequence for a subset of heads, so the order of the chunks costs nothing.
- **load balanced** (ring attention): the sequence is cut into ``2·cp`` chunks and
  rank i holds chunks ``i`` and ``2·cp - 1 - i``, one early and one late (the
  "zigzag" of Megatron-LM's context parallelism and torchtitan's
  ``_HeadTailLoadBalancer``). Under a causal mask an early chunk attends to few keys
  and a late chunk to many; pairing them gives every rank the same work. With the
  contiguous layout the last rank would compute ``2·cp - 1`` times as many scores
  as the first.

A group is anything :mod:`dtlab.comm` accepts: a :class:`dtlab.topology.Axis`, a
process group, or ``None`` (the world).
"""

from __future__ import annotations

import torch

from dtlab import comm
from dtlab.checks import one_of
from dtlab.events import CP_VARIANTS

__all__ = [
    "sequence_chunks",
    "local_positions",
    "shard_sequence",
]

"""How attention sees the whole sequence: K/V blocks passed round a ring (Liu et al.
2023), or an all-to-all from sequence shards to head shards (DeepSpeed-Ulysses)."""


def sequence_chunks(cp: int, index: int, load_balanced: bool) -> tuple[int, ...]:
    """The chunks rank ``index`` holds: ``(index, 2·cp-1-index)`` of ``2·cp``
    chunks, load balanced; ``(index,)`` of ``cp`` otherwise."""
    if not 0 <= index < cp:
        raise ValueError(f"cp index {index} is outside 0..{cp - 1}")
    return (index, 2 * cp - 1 - index) if load_balanced else (index,)


def _chunk_len(seq_len: int, cp: int, load_balanced: bool) -> int:
    n_chunks = 2 * cp if load_balanced else cp
    if seq_len % n_chunks:
        why = "2·cp chunks (load-balanced ring)" if load_balanced else "cp chunks"
        raise ValueError(
            f"context parallelism cuts the sequence into {why}: seq_len={seq_len} "
            f"is not a multiple of {n_chunks}; pick a sequence length divisible by it"
        )
    return seq_len // n_chunks


def local_positions(
    seq_len: int, cp: int, index: int, load_balanced: bool
) -> torch.Tensor:
    """The global positions of rank ``index``'s tokens, in the order it holds them:
    ``(seq_len / cp,)`` int64."""
    c = _chunk_len(seq_len, cp, load_balanced)
    chunks = sequence_chunks(cp, index, load_balanced)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in chunks])


def shard_sequence(
    x: torch.Tensor, group, variant: str = "ring", *, dim: int = 1
) -> torch.Tensor:
    """This rank's tokens of ``x`` along ``dim`` (token ids ``(B, T)``, targets, or
    activations ``(B, T, C)``): the layout ``variant`` attends over. No
    communication: every rank starts from the whole batch."""
    variant = one_of("context-parallel variant", variant, CP_VARIANTS)
    cp, index = comm.group_size(group), comm.group_rank(group)
    pos = local_positions(x.shape[dim], cp, index, variant == "ring")
    return x.index_select(dim, pos.to(x.device))

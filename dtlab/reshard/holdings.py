"""What one rank of a :class:`dtlab.train.Trainer` holds, in the full model's terms.

Taught in chapter 13 (:mod:`dtlab.reshard`). The save plan and the load plan of a
rank are the same list: for every tensor the rank's optimizer steps, a
:class:`Holding` names the full tensor (the single-process GPT's name), says which
:class:`~dtlab.reshard.pieces.Piece` of it the rank holds, and whether this rank is
the one that writes it.

What the optimizer steps is the fp32 *master* (:attr:`dtlab.train.Trainer.parameters`):

- DDP over dp, any tp/pp: each module parameter (its tp slice), or under a 16-bit
  policy its fp32 master copy in :class:`~dtlab.amp.MixedPrecisionOptimizer`, in the
  order the optimizer took them (``Parallelized.full_parameters`` pairs them the
  same way);
- ZeRO 1-3: each :class:`~dtlab.zero.units.LocalShard`, elements ``[start, stop)``
  of the flattened tp-local parameter; the shards *are* the fp32 masters, whatever
  the compute dtype.

One writer per element: a replica over dp (DDP) is written by dp index 0, an HSDP
replica by replica 0, a tensor no tp rank cuts (LayerNorms, position embeddings,
row-parallel biases) by tp index 0, and a tied head kept as a copy on the last
pipeline stage not at all (the first stage's embedding is the same numbers: the
pipeline sums both gradients, so both take the same steps). Loading fills the copy
from the embedding's pieces.

What no optimizer steps is not saved: a frozen parameter (``requires_grad=False``)
of a DDP run, which the trainer never changes; the model's init (seeded per
parameter name) gives it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtlab.reshard.pieces import Piece, tp_piece

__all__ = ["Holding", "holdings", "TIED"]

TIED = ("wte.weight", "head.weight")  # the tensors whose rows are the vocabulary


@dataclass(frozen=True)
class Holding:
    """One tensor this rank steps: ``master.reshape(-1)`` is the ``piece``'s
    elements followed by ``padding`` zeros (vocabulary rows that are no token);
    ``name`` is the full model's; ``writes``: whether this rank saves it."""

    name: str
    piece: Piece
    master: torch.Tensor
    padding: int
    writes: bool


def _full_shape(name, local_shape, dim, tp: int, vocab: int) -> tuple[int, ...]:
    """The full tensor's shape from a tp rank's slice: ``dim`` times tp, the
    vocabulary rows unpadded."""
    shape = list(local_shape)
    if dim is not None:
        shape[dim] *= tp
    if name in TIED:
        shape[0] = vocab
    return tuple(shape)


def _holding(trainer, name, param, master, lo, hi, replica_writes) -> Holding:
    """``master`` holds elements ``[lo, hi)`` of ``param``'s tp-local tensor."""
    config, tp = trainer.config.model, trainer.topo.axis("tp")
    dim = getattr(param, "tensor_parallel_dim", None)
    copy = name == "head.weight" and config.tied_head  # a last stage's tied copy
    if copy:
        name = "wte.weight"
    full = _full_shape(name, param.shape, dim, tp.size, config.vocab_size)
    piece, padding = tp_piece(full, param.shape, dim, tp.index, lo, hi)
    if master.numel() != piece.numel + padding:
        raise ValueError(
            f"{name}: the optimizer's tensor has {master.numel()} elements, the "
            f"piece {piece.numel} (+{padding} padding): the optimizer does not step "
            "this model's parameters in the order they were built"
        )
    writes = replica_writes and not copy and (dim is not None or tp.index == 0)
    return Holding(name, piece, master, padding, writes)


def holdings(trainer) -> list[Holding]:
    """This rank's :class:`Holding` s, in the optimizer's order."""
    parts, layout = trainer.parts, trainer.topo.layout
    if layout.cp > 1 or layout.ep > 1:
        raise ValueError(
            f"layout {layout} has cp={layout.cp}, ep={layout.ep}: the resharding "
            "checkpoint covers dp, tp and pp; save such a run with "
            "dtlab.checkpoint.save_training (it loads at its own layout)"
        )
    out = []
    if parts.zero_stage is not None:
        for wrapper in parts.wrapped:
            first = wrapper.replica_rank == 0
            for s in wrapper.local_shards():
                out.append(
                    _holding(trainer, s.name, s.param, s.tensor, s.start, s.stop, first)
                )
        return out
    first = trainer.topo.axis("dp").index == 0
    masters = iter(parts.optimizer.masters)
    for module in parts.modules:
        seen = set()
        for name, p in module.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            out.append(_holding(trainer, name, p, next(masters), 0, p.numel(), first))
    return out

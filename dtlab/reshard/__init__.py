"""Checkpoints that reshard: saved at one layout, loaded at any other.

Taught in chapter 13 (when ranks fail). PyTorch's distributed checkpoint (DCP,
``torch.distributed.checkpoint``; its design is in the PyTorch docs, "Distributed
Checkpoint - torch.distributed.checkpoint", and in Wan et al. 2024, "ByteCheckpoint:
A Unified Checkpointing System for Large Foundation Model Development") and
Megatron-Core's ``dist_checkpointing`` share one idea: a checkpoint that describes
every piece in the coordinates of the *full* tensor does not depend on the layout
that wrote it. dtlab's older format (:mod:`dtlab.checkpoint`) re-cuts ZeRO slices
over dp only and refuses tp, pp and 16-bit layouts; this one loads a ZeRO-3 run on 4
ranks into DDP on 2, a dp2·tp2 run into one process, a two-stage pipeline into
ZeRO-3 without one.

**Saving** (:func:`save`): each rank writes only what it holds. For every tensor its
optimizer steps (:func:`holdings`: the fp32 master, never a 16-bit copy), it
describes its :class:`Piece` of the full, GPT-named tensor: the tensor-parallel
slice (a box along ``tensor_parallel_dim``, the vocabulary's padding rows left out)
and, under ZeRO, the flat range of that slice; the AdamW moments are cut like the
weight, the step count is kept per piece. One writer per element (dp replicas, tp
replicas and a pipeline's tied head copy write nothing). The ranks' indexes meet at
rank 0, which writes ``metadata.json`` (:mod:`~dtlab.reshard.format`).

**Loading** (:func:`load`): each rank plans from the metadata alone which saved
pieces overlap its own piece of each tensor (its tp slice, its ZeRO range), checks
that they cover it, reads only those bytes, and writes them into its masters and
optimizer state; the weights it computes with follow. No rank gathers the model.

This is DCP's planner: a *save plan* per rank whose items carry global offsets,
deduplicated and turned into global metadata by a coordinator; a *load plan* per
rank that reads the overlaps of its chunks with the saved ones. What differs:

- DCP describes a chunk as a box (offsets and sizes per dimension): FSDP2 shards
  dim 0, so its chunks are boxes. dtlab's ZeRO cuts a *flat* buffer, so a piece is
  a flat range of a box, and overlaps are found on runs of the row-major
  flattening (:func:`overlaps`).
- DCP's coordinator deduplicates replicated items after gathering every plan;
  dtlab's writer rule decides locally, and rank 0 only checks the cover.
- DCP stores each item with ``torch.save`` in the rank's ``.distcp`` file and the
  metadata pickled; dtlab stores raw bytes and JSON. DCP reads a whole saved item
  and narrows it; dtlab reads the span of a saved piece its overlap needs.
- DCP checkpoints a state dict; which tensors are masters, how a tied head is
  stored, what happens to 16-bit copies is the caller's business
  (``torch.distributed.checkpoint.state_dict`` helps). dtlab's loader knows the
  trainer.

**Random state** belongs to a rank and a layout: rank 3 of dp4 has no counterpart
at dp2. At the layout it was saved at, each rank gets its own back (the run goes on
with the same dropout masks); elsewhere the trainer keeps its own seeding, the
:class:`LoadReport` says so, and with dropout on a :class:`RandomStateNotCarried`
warning says that the masks, and so the losses, differ from the run that never
stopped. With dropout 0 a resharded run continues with the same losses, to the
rounding of the new layout's sums.

**Precision.** The checkpoint holds fp32 masters and fp32 moments whatever the
policy, so a bf16 or fp16 run loads into an fp32 trainer and the reverse: the masters
are exact, the weights computed with are them in the new precision (as after any
step), and the report notes the change. fp16's loss scale carries from fp16 to
fp16 only.

:mod:`~dtlab.reshard.dcp` runs DCP itself on FSDP2 beside this. Saving the same
ZeRO-3 job at world 2 (7248 parameters, tests/test_reshard.py): dtlab writes two
data files of 43 488 bytes (6 bytes a parameter each: 12 in all, the fp32 master
and both moments), a 12 KB JSON index and 7 KB of random state per rank; DCP writes
214 645 and 288 514 bytes (the same numbers plus the tied head a second time and a
float32 step count per parameter, every item behind a ``torch.save`` header of
~1.5 KB; the replicated items, step counts and hyper-parameters, all go to one
rank) and a 63 KB pickled ``.metadata``. Both continue, at world 1, with the same
losses.
"""

from dtlab.reshard.format import describe, read_full, read_metadata
from dtlab.reshard.holdings import Holding, holdings
from dtlab.reshard.load import LoadReport, RandomStateNotCarried, load
from dtlab.reshard.pieces import Piece, overlaps, tp_piece
from dtlab.reshard.save import save

__all__ = [
    "save",
    "load",
    "LoadReport",
    "RandomStateNotCarried",
    "read_metadata",
    "read_full",
    "describe",
    "holdings",
    "Holding",
    "Piece",
    "overlaps",
    "tp_piece",
]

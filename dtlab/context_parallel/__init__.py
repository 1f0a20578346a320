"""Context parallelism: every sequence split over the cp ranks, attention by ring
(Liu et al. 2023) or by Ulysses (Jacobs et al. 2023).

Taught in chapter 11 (long context and mixture of experts). At 128k tokens one
layer's activations no longer fit a device; data parallelism cannot help (it splits
the batch, and a batch of one sequence does not split) and tensor parallelism stops
at the heads. Context parallelism splits the sequence itself: each rank holds
``s/cp`` tokens of every sequence, everything position-wise runs on those alone, and
attention, the one place a token meets others, reaches across ranks:

- **ring attention**: queries stay, K/V blocks travel round the ring, one per step,
  overlapped with the step's attention; partial results merge with the online
  softmax (log-sum-exp). The load-balanced layout (rank i holds chunks i and
  2·cp-1-i) gives every rank the same causal work. Sends ``3·(cp-1)`` K/V-sized
  blocks per layer, whatever the number of heads.
- **Ulysses**: two all-to-alls turn a sequence shard into a head shard and back;
  attention itself runs unchanged on ``nh/cp`` heads. Each rank sends ``(cp-1)/cp``
  of its q, k, v and attention output forward, and as much backward: a volume that
  shrinks with cp where the ring's does not, but cp must divide ``n_heads``.

Where each piece lives:

- :mod:`~dtlab.context_parallel.sharding`: which tokens a rank holds
  (:func:`shard_sequence`, :func:`local_positions`, the load-balanced chunks);
- :mod:`~dtlab.context_parallel.ring`: the online-softmax merge
  (:func:`merge_attention_blocks`), one block forward and backward, the ring's
  schedule as data (:func:`ring_schedule`) and :class:`RingAttention`;
- :mod:`~dtlab.context_parallel.ulysses`: the all-to-all (:class:`SeqAllToAll`) and
  :func:`ulysses_attention`;
- :mod:`~dtlab.context_parallel.model`: :class:`ContextParallelAttention` (a
  drop-in for dtlab.model's attention, same weights),
  :func:`context_parallel_gpt`, the whole GPT, with the gradient all-reduce over cp,
  and :func:`apply_context_parallel`, which composed layouts use on a GPT or on its
  pipeline and tensor-parallel stages (:func:`context_parallel_core`).

The estimates: :func:`dtlab.estimate.cp_bytes_per_layer`,
:func:`~dtlab.estimate.cp_bytes_per_step` and
:func:`~dtlab.estimate.cp_activation_bytes_per_layer`.
"""

from dtlab.context_parallel.model import (
    ContextParallelAttention,
    ContextParallelGPT,
    all_reduce_gradients,
    apply_context_parallel,
    context_parallel_core,
    context_parallel_gpt,
    cp_core,
)
from dtlab.context_parallel.ring import (
    RingAttention,
    RingStep,
    block_attention,
    block_attention_backward,
    merge_attention_blocks,
    ring_attention,
    ring_schedule,
)
from dtlab.context_parallel.sharding import (
    local_positions,
    sequence_chunks,
    shard_sequence,
)
from dtlab.context_parallel.ulysses import (
    SeqAllToAll,
    all_to_all_along,
    ulysses_attention,
)

__all__ = [
    # sharding
    "sequence_chunks",
    "local_positions",
    "shard_sequence",
    # ring
    "block_attention",
    "merge_attention_blocks",
    "block_attention_backward",
    "RingStep",
    "ring_schedule",
    "RingAttention",
    "ring_attention",
    # ulysses
    "all_to_all_along",
    "SeqAllToAll",
    "ulysses_attention",
    # model
    "ContextParallelAttention",
    "apply_context_parallel",
    "context_parallel_core",
    "cp_core",
    "ContextParallelGPT",
    "context_parallel_gpt",
    "all_reduce_gradients",
]

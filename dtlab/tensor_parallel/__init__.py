"""Tensor parallelism the Megatron-LM way, with sequence parallelism and a
vocab-parallel loss.

Taught in chapter 04 (``notebooks/04_tensor_parallel.ipynb``); chapter 07 splits
pipeline stages with it (:meth:`TensorParallelStage.from_stage`, composed by
:mod:`dtlab.parallelize`).

Sources:

- Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models
  Using Model Parallelism", §3 and Figure 3: split the first matrix of each block by
  columns and the second by rows, so a block needs one all-reduce forward (**g**) and
  one backward (**f**).
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", §4.2.2 and Figure 5: *sequence parallelism* shards the LayerNorm and
  dropout regions along the sequence; each all-reduce becomes a reduce-scatter plus
  an all-gather (the same bytes), and those regions' activations shrink by t.

Where each piece lives:

- :mod:`~dtlab.tensor_parallel.ops`: every collective of TP, as autograd functions:
  f (:func:`copy_to_tp`), g (:func:`reduce_from_tp`), gather/scatter of the last
  dim, and sequence parallelism's g and ḡ (:func:`gather_from_sp`,
  :func:`reduce_scatter_to_sp`);
- :mod:`~dtlab.tensor_parallel.layers`: :class:`ColumnParallelLinear`,
  :class:`RowParallelLinear`, :class:`ParallelMLP`, :class:`ParallelSelfAttention`,
  :class:`VocabParallelEmbedding`, and :func:`load_shards_` (a full module's
  weights into its tp slices);
- :mod:`~dtlab.tensor_parallel.cross_entropy`: :func:`vocab_parallel_cross_entropy`
  on logits split by vocabulary;
- :mod:`~dtlab.tensor_parallel.rng`: :class:`TPRandom` and :class:`ParallelDropout`
  (the same mask where replicated, another where sharded);
- :mod:`~dtlab.tensor_parallel.model`: :class:`ParallelBlock` and
  :class:`TensorParallelStage`, the GPT or one pipeline stage of it;
  :func:`tensor_parallel_gpt` splits a whole GPT;
- :mod:`~dtlab.tensor_parallel.step`: chapter 04's training step
  (:func:`tp_train_step`, :func:`tp_grad_norm`).
"""

from dtlab.tensor_parallel.cross_entropy import (
    VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)
from dtlab.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_shards_,
)
from dtlab.tensor_parallel.model import (
    ParallelBlock,
    TensorParallelGPT,
    TensorParallelStage,
    tensor_parallel_gpt,
)
from dtlab.tensor_parallel.ops import (
    CopyToTP,
    GatherFromSP,
    GatherFromTP,
    ReduceFromTP,
    ReduceScatterToSP,
    ScatterToTP,
    all_gather_along,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_along,
    reduce_scatter_to_sp,
    scatter_to_tp,
    split_along,
)
from dtlab.tensor_parallel.rng import ParallelDropout, TPRandom
from dtlab.tensor_parallel.step import tp_grad_norm, tp_train_step

__all__ = [
    # ops: the conjugate operators and the moves they are made of
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "CopyToTP",
    "ReduceFromTP",
    "GatherFromTP",
    "ScatterToTP",
    "GatherFromSP",
    "ReduceScatterToSP",
    "split_along",
    "all_gather_along",
    "reduce_scatter_along",
    # rng
    "TPRandom",
    "ParallelDropout",
    # layers
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "VocabParallelEmbedding",
    "load_shards_",
    # cross_entropy
    "VocabParallelCrossEntropy",
    "vocab_parallel_cross_entropy",
    # model
    "ParallelBlock",
    "TensorParallelStage",
    "tensor_parallel_gpt",
    "TensorParallelGPT",
    # step
    "tp_train_step",
    "tp_grad_norm",
]

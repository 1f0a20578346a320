"""ZeRO stages 0-3 (stage 3 is FSDP) and CPU offload, each stage adding one thing.

Taught in chapter 03 (``notebooks/03_zero.ipynb``); chapter 07 runs it over the dp
axis of tensor-parallel models and pipeline stages (:mod:`dtlab.parallelize`).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC20). Plain data parallelism keeps the whole *model state* on
each of the N_d ranks: 2Ψ bytes of fp16 weights, 2Ψ of gradients and KΨ of optimizer
state (K = 12 for mixed-precision Adam: fp32 master weights, momentum, variance).
ZeRO-DP removes the copies, one kind at a time (§5):

- stage 1, P_os: each rank keeps the optimizer state of 1/N_d of the parameters and
  updates only that slice; the updated slices are all-gathered (§5.1);
- stage 2, P_os+g: gradients too are reduce-scattered into slices, bucket by bucket
  while backward runs, and the full gradient of a bucket is freed once reduced (§5.2);
- stage 3, P_os+g+p: parameters too. Each *unit* (a transformer block) keeps a flat
  slice; its full weights are all-gathered just before its forward and again before
  its backward, and freed after use; the next unit is prefetched (§5.3). PyTorch
  calls this FSDP (Zhao et al. 2023, "PyTorch FSDP", §3).

Communication per step (§7): an all-reduce is a reduce-scatter plus an all-gather,
2Ψ; stages 1 and 2 do exactly those two, also 2Ψ; stage 3 gathers the weights twice,
3Ψ. :func:`dtlab.estimate.zero_comm_per_step` has the numbers, the tests check them.

Gradient accumulation: stages 0 and 1 keep the full gradient anyway, so under
``no_sync`` they add each microbatch's gradient into it and communicate once per
step, like DDP. Stages 2 and 3 exist to *not* hold the full gradient, so they
reduce-scatter after every backward and add the slices; ``no_sync`` refuses them
(DeepSpeed's engine refuses it for its stages 2 and 3 too).

The files, in reading order:

- :mod:`~dtlab.zero.stages`: what each stage shards, as four named flags;
- :mod:`~dtlab.zero.units`: the flat layout, a rank's slice, the per-parameter local
  shards the optimizer steps;
- :mod:`~dtlab.zero.gather`: the all-gathers (stage 3's gather, free, re-gather);
- :mod:`~dtlab.zero.reduce`: the all-reduce (stage 0) and reduce-scatter (1-3);
- :mod:`~dtlab.zero.offload`: ZeRO-Offload, masters and optimizer on the host;
- :mod:`~dtlab.zero.hsdp`: hybrid sharding (HSDP), ZeRO within a shard group and
  one more all-reduce across the replicas of each slice (chapter 11);
- :mod:`~dtlab.zero.fsdp`: :class:`FullyShardedDataParallel`, the hooks that run all
  of it (``stage=3`` by default, like FSDP2's ``fully_shard``);
- :mod:`~dtlab.zero.optimizer`: :class:`ShardedOptimizer`, stage 1 alone as an
  optimizer (like ``ZeroRedundancyOptimizer``), after something averaged the
  gradients.
"""

from dtlab.zero.fsdp import FullyShardedDataParallel
from dtlab.zero.hsdp import REPLICATE_AXIS, SHARD_AXIS, HybridGroups, hsdp_groups
from dtlab.zero.optimizer import ShardedOptimizer
from dtlab.zero.stages import STAGES

__all__ = [
    "STAGES",
    "ShardedOptimizer",
    "FullyShardedDataParallel",
    "HybridGroups",
    "hsdp_groups",
    "SHARD_AXIS",
    "REPLICATE_AXIS",
]

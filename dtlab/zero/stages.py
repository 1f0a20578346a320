"""What each ZeRO stage shards: one stage number, four named flags.

Taught in chapter 03. Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models" (SC20), §5. Plain data parallelism keeps the
whole model state on each of the N_d ranks: 2Ψ bytes of weights, 2Ψ of gradients,
KΨ of optimizer state. Each stage removes one more of the copies:

======  ==========  ===========================================================
stage   the paper   what it adds, and where the code does it
======  ==========  ===========================================================
0                   nothing sharded: the gradient is all-reduced (``reduce.py``)
1       P_os §5.1   ``shards_optimizer``: each rank steps a 1/N slice of the
                    fp32 master weights, so it holds 1/N of the optimizer state;
                    gradients are reduce-scattered, the updated slices
                    all-gathered (``units.py``, ``reduce.py``, ``gather.py``)
2       P_os+g      ``shards_grads``: a unit's full gradient bucket is freed as
        §5.2        soon as its reduce-scatter is done, microbatch by
                    microbatch (``reduce.py``)
3       P_os+g+p    ``shards_params``: a unit's full weights exist only around its
        §5.3        forward and backward: gathered, used, freed (``fsdp.py``'s
                    P_os+g+p section, ``gather.py``)
======  ==========  ===========================================================

``keeps_full_grads`` is the other side of ``shards_grads``: stages 0 and 1 hold the
full gradient anyway, so they keep it until the optimizer step (the module's
``.grad`` are views of it) and may accumulate microbatches in it under ``no_sync``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STAGES", "Sharding"]

STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Sharding:
    """The flags of one ZeRO ``stage``, derived once (``Sharding(3).shards_params``)."""

    stage: int

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"unknown ZeRO stage {self.stage!r}: use 0, 1, 2 or 3")

    @property
    def shards_optimizer(self) -> bool:
        """P_os: each rank owns the master weights and optimizer state of 1/N."""
        return self.stage >= 1

    @property
    def shards_grads(self) -> bool:
        """P_os+g: gradients are reduce-scattered into slices, the full one freed."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        """P_os+g+p: weights are gathered before each use and freed after it."""
        return self.stage >= 3

    @property
    def keeps_full_grads(self) -> bool:
        """Stages 0-1: the full gradient bucket lives until the optimizer step."""
        return not self.shards_grads

    def n_shards(self, world_size: int) -> int:
        """How many ranks the master weights are cut over: N, or 1 at stage 0."""
        return world_size if self.shards_optimizer else 1

    def tag(self, what: str) -> str:
        """The telemetry tag of a collective: ``zero2/rs/blocks.0``."""
        return f"zero{self.stage}/{what}"

"""Random numbers under tensor parallelism: the same dropout mask where activations
are replicated, a different one where they are sharded.

Taught in chapter 04 (section 6). Megatron keeps the two streams in its RNG tracker
(``megatron/core/tensor_parallel/random.py``, "model parallel random number
generation"); :mod:`dtlab.recompute` replays them when it recomputes a block, and
:meth:`dtlab.train.Trainer.state_dict` saves them (:meth:`TPRandom.get_states`), as
Megatron saves its tracker's states with a checkpoint: a run resumed from it, or a
replica healed with it, draws the masks the run that never stopped drew.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TPRandom", "ParallelDropout"]


class TPRandom:
    """Two random streams per rank, as Megatron's RNG tracker keeps:

    - ``replicated``: seeded with ``seed`` on every tp rank. Dropout on activations
      that every rank holds whole (the residual stream without sequence
      parallelism) must drop the *same* elements everywhere, or the copies diverge.
    - ``sharded``: seeded with ``seed + 2718 + tp_index`` (Megatron's offset). Dropout
      on a shard (attention heads, a sequence slice) must differ between ranks, or
      every shard would repeat one mask.

    Explicit generators leave torch's global RNG alone, so nothing else shifts.
    """

    OFFSET = 2718

    def __init__(self, seed: int, axis) -> None:
        self.seed, self.index = int(seed), axis.index
        # (sharded, device) -> generator; dtlab.recompute finds them here to replay
        self._gens: dict[tuple[bool, str], torch.Generator] = {}

    def generator(self, sharded: bool, device) -> torch.Generator:
        key = (sharded, str(device))
        if key not in self._gens:
            seed = self.seed + (self.OFFSET + self.index if sharded else 0)
            self._gens[key] = torch.Generator(device=device).manual_seed(seed)
        return self._gens[key]

    def manual_seed(self, seed: int) -> None:
        """Start both streams again from ``seed`` (the same on every tp rank of a
        group: the replicated stream must stay one stream)."""
        self.seed = int(seed)
        self._gens.clear()

    def get_states(self) -> dict[tuple[bool, str], torch.Tensor]:
        """``{(sharded, device): generator state}`` of every stream drawn from so
        far (copies; a stream never drawn from is still at its seed)."""
        return {key: g.get_state() for key, g in self._gens.items()}

    def set_states(self, states: dict[tuple[bool, str], torch.Tensor]) -> None:
        """Put every stream back where :meth:`get_states` found it; a stream
        missing from ``states`` had not drawn yet and starts again from its seed.
        The generator objects stay the same (only their states change)."""
        for key in [k for k in self._gens if k not in states]:
            del self._gens[key]
        for (sharded, device), state in states.items():
            self.generator(sharded, device).set_state(state)


class ParallelDropout(nn.Module):
    """Dropout drawing its mask from one of :class:`TPRandom`'s streams:
    ``sharded=True`` where each rank holds a different piece of the activation."""

    def __init__(self, p: float, rng: TPRandom, *, sharded: bool) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p, self.rng, self.sharded = p, rng, sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        gen = self.rng.generator(self.sharded, x.device)
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=gen)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, {'sharded' if self.sharded else 'replicated'}"

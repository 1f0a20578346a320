"""Pipeline stages of dtlab's GPT: which layers each rank holds.

Taught in chapter 05 (pipeline parallelism); chapter 07 hands these stages to
tensor parallelism (:class:`dtlab.tensor_parallel.TensorParallelStage`) or ZeRO
before :class:`dtlab.pipeline.Pipeline` runs them.

The ``n_layers`` blocks are cut into ``p·v`` equal *virtual stages*; rank ``r``
holds virtual stages ``c·p + r`` for its ``v`` chunks ``c`` (Megatron's interleaved
assignment; ``v = 1`` is the plain cut), or, placed in a V (ZB-V, DualPipeV:
``placement="v"``, ``v = 2``), stages ``r`` and ``2p - 1 - r``
(:func:`dtlab.pipeline.schedules.virtual_stage`). The embedding goes with virtual
stage 0, the final LayerNorm, head and loss with the last one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.model import INIT_STD, Block, GPTConfig, init_gpt_weights, param_generator
from dtlab.pipeline.schedules import virtual_stage
from dtlab.topology import Layout

__all__ = ["partition", "StageModule", "build_stages"]


def partition(
    config: GPTConfig, p: int, v: int = 1, placement: str = "interleaved"
) -> list[list[range]]:
    """Layers of each rank's chunks: ``partition(cfg, p, v)[r][c]`` is the range of
    block indices of the virtual stage chunk ``c`` of rank ``r`` runs (``c·p + r``,
    or in a V ``r`` and ``2p - 1 - r``). The embedding goes with virtual stage 0,
    the final LayerNorm, head and loss with the last one."""
    Layout(pp=p).validate(n_layers=config.n_layers, chunks=v)
    if placement == "v" and v != 2:
        raise ValueError(f"the V placement holds 2 chunks per rank, not v={v}")
    per = config.n_layers // (p * v)
    stage = [[virtual_stage(p, r, c, placement) for c in range(v)] for r in range(p)]
    return [[range(s * per, (s + 1) * per) for s in row] for row in stage]


class StageModule(nn.Module):
    """One virtual stage of :class:`dtlab.model.GPT`: the embedding if it is the
    first, ``blocks`` ``layers``, the head if it is the last.

    Parameters have the full model's names (``blocks.5.attn.q.weight``) and values:
    each is drawn from its own generator seeded by ``(seed, name)``, so this stage
    builds only its own slice and still matches ``GPT(config, seed)`` exactly. A
    tied head on a last stage that is not also the first is a *copy* of ``wte``
    whose gradient :class:`dtlab.pipeline.Pipeline` sums with the first stage's
    (Megatron's embedding group).
    """

    def __init__(
        self, config: GPTConfig, layers: range, *, first: bool, last: bool, seed=0
    ):
        super().__init__()
        self.config, self.first, self.last = config, first, last
        with torch.random.fork_rng(devices=[]):  # torch's default init draws
            if first:
                self.wte = nn.Embedding(config.vocab_size, config.d_model)
                self.wpe = nn.Embedding(config.seq_len, config.d_model)
                self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleDict({str(i): Block(config) for i in layers})
            if last:
                self.ln_f = nn.LayerNorm(config.d_model)
                self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if first and last and config.tied_head:
            self.head.weight = self.wte.weight
        init_gpt_weights(self, seed, config.n_layers)  # the full model's, by name
        if last and config.tied_head and not first:
            with torch.no_grad():  # the copy gets wte's values: wte's generator
                gen = param_generator(seed, "wte.weight")
                self.head.weight.normal_(0.0, INIT_STD, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids (first stage) or ``(B, T, C)`` -> ``(B, T, C)``, or logits
        ``(B, T, V)`` on the last stage (same ops as ``GPT.embed``/``GPT.output``)."""
        if self.first:
            pos = self.positions(x.shape[1], x.device)  # (T,)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.last:
            x = self.head(self.ln_f(x))  # (B, T, V)
        return x

    def positions(self, T: int, device=None) -> torch.Tensor:
        """As :meth:`dtlab.model.GPT.positions`: ``0..T-1``, or under context
        parallelism the global positions of this rank's ``T`` tokens."""
        return torch.arange(T, device=device)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, exactly as ``GPT.output`` computes it
        (in fp32 whatever the logits' dtype: see :mod:`dtlab.amp`)."""
        V = logits.shape[-1]
        z = logits.view(-1, V).float()  # (B·T, V)
        return F.cross_entropy(z, targets.reshape(-1))

    def global_named_parameters(self):
        """``(name in GPT, parameter)``: a tied head copy is reported as
        ``wte.weight``, the name it has in the full model."""
        for name, param in self.named_parameters():
            if name == "head.weight" and self.config.tied_head:
                name = "wte.weight"
            yield name, param


def build_stages(
    config: GPTConfig,
    p: int,
    rank: int,
    v: int = 1,
    seed: int = 0,
    placement: str = "interleaved",
):
    """The ``v`` :class:`StageModule` chunks of pp rank ``rank``; ``placement``
    as the schedule's (:attr:`dtlab.pipeline.Schedule.placement`)."""
    parts = partition(config, p, v, placement)[rank]
    last = p * v - 1
    return [
        StageModule(
            config,
            layers,
            first=virtual_stage(p, rank, c, placement) == 0,
            last=virtual_stage(p, rank, c, placement) == last,
            seed=seed,
        )
        for c, layers in enumerate(parts)
    ]

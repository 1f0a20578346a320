"""dtlab's GPT with every sequence split over the cp axis.

Taught in chapter 11 (long context). Everything in a GPT but attention works
position by position, so under context parallelism each rank runs the embedding,
the LayerNorms, the MLPs, the head and the loss on its own tokens only, with the
positions of those tokens (:func:`~dtlab.context_parallel.local_positions`).
Attention alone reaches the other ranks, by ring or by Ulysses
(:class:`ContextParallelAttention`).

The weights are replicated over cp, exactly as over dp: each rank's backward gives
the gradient of its own tokens' loss, ``∂L_r/∂W`` summed over every use of W on
this rank (the ring and the all-to-alls carry the other ranks' shares back). The
mean loss over the whole sequence is the mean of the ranks' equal-sized losses, so
its gradient is the average over cp of the ranks' gradients: one all-reduce,
:meth:`ContextParallelGPT.finish_gradient_synchronization` (in a composed layout,
the same reduction as dp's, over dp·cp ranks).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dtlab import comm
from dtlab.checks import one_of
from dtlab.context_parallel.ring import ring_attention
from dtlab.context_parallel.sharding import local_positions, shard_sequence
from dtlab.context_parallel.ulysses import ulysses_attention
from dtlab.events import CP_VARIANTS
from dtlab.gradsync import all_reduce_flat
from dtlab.model import GPT, CausalSelfAttention

__all__ = [
    "apply_context_parallel",
    "context_parallel_core",
    "cp_core",
    "ContextParallelAttention",
    "ContextParallelGPT",
    "context_parallel_gpt",
    "all_reduce_gradients",
]


class ContextParallelAttention(CausalSelfAttention):
    """:class:`dtlab.model.CausalSelfAttention` whose core sees the whole sequence
    while this rank holds ``T/cp`` tokens of it: a drop-in, with the same q, k, v
    and proj layers (the very modules of ``attn``: same weights, same names).

    ``variant="ring"`` runs :func:`~dtlab.context_parallel.ring_attention` (tokens
    in the load-balanced layout); ``"ulysses"``,
    :func:`~dtlab.context_parallel.ulysses_attention` around ``attn``'s own core
    (contiguous layout; ``n_heads`` a multiple of cp). Ring attention computes no
    attention dropout: a dropout probability above zero is refused.
    """

    def __init__(
        self, attn: CausalSelfAttention, group, variant: str = "ring", *, name="attn"
    ) -> None:
        # adopt attn's layers rather than build (and initialise) new ones
        nn.Module.__init__(self)
        self.head_dim = attn.head_dim
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj
        self.attn_drop, self.resid_drop = attn.attn_drop, attn.resid_drop
        self.variant = one_of("context-parallel variant", variant, CP_VARIANTS)
        if self.variant == "ring" and self.attn_drop.p > 0:
            raise ValueError(
                f"ring attention has no attention dropout (dropout="
                f"{self.attn_drop.p}): use dropout=0.0, or variant='ulysses'"
            )
        self.group, self.name = group, name

    def core(self, q, k, v):
        """This rank's ``(B, nh, T/cp, hs)`` queries, keys and values -> its
        attention output over the whole sequence, ``(B, nh, T/cp, hs)``."""
        return cp_core(q, k, v, self.group, self.variant, super().core, self.name)


def cp_core(q, k, v, group, variant: str, local_core, tag: str):
    """The attention core over the cp group: this rank's ``(B, heads, T/cp, hs)``
    queries, keys and values -> its output over the whole sequence. ``heads`` are
    the heads this rank computes (all of them, or ``n_heads/tp`` under tensor
    parallelism: heads never meet, so cp and tp compose). ``local_core``, the
    single-process core, is what Ulysses runs on its ``heads/cp`` heads."""
    if variant == "ring":
        return ring_attention(q, k, v, group, tag=tag)
    return ulysses_attention(q, k, v, group, local_core, tag=tag)


def context_parallel_core(
    attn: nn.Module, group, variant: str = "ring", *, name="attn"
):
    """Make ``attn``'s core run over the cp group ``group``, in place: a
    :class:`dtlab.model.CausalSelfAttention` or a tensor-parallel
    :class:`dtlab.tensor_parallel.ParallelSelfAttention` (its f and g, q, k, v and
    proj work token by token and stay as they are). Idempotent."""
    variant = one_of("context-parallel variant", variant, CP_VARIANTS)
    if isinstance(attn.core, functools.partial) and attn.core.func is cp_core:
        return attn
    if variant == "ring" and attn.attn_drop.p > 0:
        raise ValueError(
            f"ring attention has no attention dropout (dropout={attn.attn_drop.p}): "
            "use dropout=0.0, or variant='ulysses'"
        )
    # an instance attribute: the class's core stays the single-process one
    attn.core = functools.partial(
        cp_core, group=group, variant=variant, local_core=attn.core, tag=name
    )
    return attn


def all_reduce_gradients(module: nn.Module, group, *, tag: str = "cp/grads") -> None:
    """Average every gradient of ``module`` over ``group`` in one all-reduce of one
    flat buffer (the replicated weights of context parallelism; dp's sum over the
    same ranks would be the same bytes)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    all_reduce_flat(grads, group, tag=tag, divide_by=comm.group_size(group))


def apply_context_parallel(model: nn.Module, group, variant: str = "ring"):
    """Split ``model``'s sequences over the cp group ``group``, in place (names and
    weights unchanged, what a composed layout needs): every block's attention core
    runs over cp (:func:`context_parallel_core`), and ``model.positions`` gives the
    global positions of this rank's ``T/cp`` tokens. ``model`` is a
    :class:`dtlab.model.GPT`, a pipeline stage
    (:class:`~dtlab.pipeline.StageModule`) or a tensor-parallel one
    (:class:`~dtlab.tensor_parallel.TensorParallelStage`): anything with ``blocks``
    and ``positions``. It then takes this rank's tokens
    (:func:`~dtlab.context_parallel.shard_sequence`) and returns the mean loss over
    them; the gradients are averaged over cp (with dp, over dp·cp)."""
    variant = one_of("context-parallel variant", variant, CP_VARIANTS)
    cp, index = comm.group_size(group), comm.group_rank(group)
    heads = model.config.n_heads // _tp_size(model)  # the heads this rank computes
    if variant == "ulysses" and heads % cp:
        raise ValueError(
            f"Ulysses splits the heads over cp={cp}: the {heads} heads this rank "
            f"computes (n_heads={model.config.n_heads}) are not a multiple of it; "
            "use variant='ring' or another cp"
        )
    blocks = model.blocks
    numbered = (
        blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    )
    for i, block in numbered:
        context_parallel_core(block.attn, group, variant, name=f"blocks.{i}.attn")
    balanced = variant == "ring"

    def positions(T: int, device=None) -> torch.Tensor:  # T: this rank's tokens
        return local_positions(T * cp, cp, index, balanced).to(device)

    model.positions = positions
    return model


def _tp_size(model) -> int:
    axis = getattr(model, "axis", None)  # a TensorParallelStage's tp axis
    return 1 if axis is None else axis.size


class ContextParallelGPT(nn.Module):
    """:class:`dtlab.model.GPT` with its sequences split over the cp group
    ``group``: each block's attention becomes a :class:`ContextParallelAttention`
    (in place: ``module`` is the GPT, its weights and names unchanged).

    ``forward(idx, targets=None)`` takes this rank's tokens, ``(B, T/cp)`` ids from
    :meth:`shard` (and targets sharded alike), and returns this rank's logits
    ``(B, T/cp, V)`` and the mean loss over its tokens. The whole sequence's loss
    is the mean of the ranks' losses. After ``backward()``, call
    :meth:`finish_gradient_synchronization`.
    """

    def __init__(self, model: GPT, group, variant: str = "ring") -> None:
        super().__init__()
        self.variant = one_of("context-parallel variant", variant, CP_VARIANTS)
        self.group, self.cp = group, comm.group_size(group)
        cfg = model.config
        if self.variant == "ulysses" and cfg.n_heads % self.cp:
            raise ValueError(
                f"Ulysses splits the heads over cp={self.cp}: n_heads={cfg.n_heads} "
                "is not a multiple of it; use variant='ring' or another cp"
            )
        for i, block in enumerate(model.blocks):
            if not isinstance(block.attn, ContextParallelAttention):
                block.attn = ContextParallelAttention(
                    block.attn, group, self.variant, name=f"blocks.{i}.attn"
                )
        self.module = model

    @property
    def load_balanced(self) -> bool:
        return self.variant == "ring"

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole ``(B, T)`` batch (or targets)."""
        return shard_sequence(x, self.group, self.variant, dim=dim)

    def positions(self, seq_len: int) -> torch.Tensor:
        """The global positions of this rank's tokens of a ``seq_len`` sequence."""
        index = comm.group_rank(self.group)
        return local_positions(seq_len, self.cp, index, self.load_balanced)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        m = self.module
        T = idx.shape[1] * self.cp  # the whole sequence
        if T > m.config.seq_len:
            raise ValueError(
                f"sequence length {T} (= {idx.shape[1]} local tokens x cp={self.cp})"
                f" exceeds the model's seq_len={m.config.seq_len}"
            )
        pos = self.positions(T).to(idx.device)  # (T/cp,): where our tokens sit
        x = m.drop(m.wte(idx) + m.wpe(pos))  # (B, T/cp, C)
        for block in m.blocks:
            x = block(x)  # (B, T/cp, C): attention reaches the other ranks
        return m.output(x, targets)  # this rank's logits, the mean over its tokens

    def finish_gradient_synchronization(self) -> None:
        """Average the gradients over cp: afterwards every rank holds the gradient
        of the whole sequence's mean loss (what the single process computes)."""
        all_reduce_gradients(self.module, self.group)


def context_parallel_gpt(
    model: GPT, group, variant: str = "ring"
) -> ContextParallelGPT:
    """Split ``model``'s sequences over the cp group ``group`` (an Axis, a process
    group or None), attention by ``variant`` ("ring" or "ulysses"): the entry point
    for composing cp with the other axes."""
    return ContextParallelGPT(model, group, variant)

"""The layers of Megatron-LM's tensor parallelism: column- and row-parallel linears,
the MLP and attention built from them, and the vocab-parallel embedding.

Taught in chapter 04 (sections 1 to 3, and 5 for the vocabulary). Shoeybi et al.
2019, "Megatron-LM", §3 and Figure 3: split the first matrix of each block by
columns and the second by rows, so a block needs one all-reduce forward (g) and one
backward (f), from :mod:`.ops`.

The tensor-parallel (tp) group of ``t`` ranks holds one copy of the model between
them. For ``Y = X·A`` (``A`` of shape ``(in, out)``, torch stores ``A^T``):

- **column parallel**: ``A = [A_1 … A_t]``, rank i computes ``Y_i = X·A_i``: the
  input must be whole on every rank, the output comes out split by columns;
- **row parallel**: ``A = [A_1; …; A_t]``, rank i computes ``X_i·A_i`` from its
  column-slice ``X_i``: the partial outputs must be *summed*, ``Y = Σ_i X_i·A_i``.

Column then row needs no communication in between: GELU, and attention per head,
act on local columns. Per transformer layer, attention (f … g) and MLP (f … g) give
**2 all-reduces forward and 2 backward**, each of the full activation ``b·s·h``.

Each sharded parameter says along which dim it is split
(``param.tensor_parallel_dim``); a replicated one whose gradient is a partial sum
under sequence parallelism says so (``param.sequence_parallel``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.checks import divisors
from dtlab.model import param_generator
from dtlab.tensor_parallel.ops import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from dtlab.tensor_parallel.rng import ParallelDropout, TPRandom
from dtlab.topology import padded_vocab

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "VocabParallelEmbedding",
    "load_shards_",
]


def _check_divides(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(
            f"tp={tp} does not divide {what}={n}: each rank must hold an equal share; "
            f"pick tp from {divisors(n)}"
        )


def _shard(full: torch.Tensor, dim: int, axis, size: int | None = None):
    """This rank's slice of ``full`` along ``dim``, zero-padded to ``size`` first."""
    full = full.detach()
    if size is not None and size > full.shape[dim]:
        pad = list(full.shape)
        pad[dim] = size - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=dim)
    return full.chunk(axis.size, dim)[axis.index].clone()


def _seeded_normal(shape, std, seed, name) -> torch.Tensor:
    gen = param_generator(seed, f"{name}.weight")
    return torch.randn(*shape, generator=gen) * std


@torch.no_grad()
def load_shards_(tp_module: nn.Module, full_module: nn.Module, axis) -> nn.Module:
    """Copy into each parameter of ``tp_module`` this rank's slice of the
    same-named parameter of ``full_module``: split along ``tensor_parallel_dim``
    (zero-padded first when the dim was padded, like a vocabulary), whole
    otherwise. Returns ``tp_module``."""
    full = dict(full_module.named_parameters())
    for name, p in tp_module.named_parameters():
        dim = getattr(p, "tensor_parallel_dim", None)
        if dim is None:
            p.copy_(full[name])
        else:
            p.copy_(_shard(full[name], dim, axis, p.shape[dim] * axis.size))
    return tp_module


class ColumnParallelLinear(nn.Module):
    """``Y = X·A`` with ``A = [A_1 … A_t]`` split by columns (Megatron §3, eq. 3):
    rank i holds ``weight`` rows ``i·out/t … (i+1)·out/t`` (torch stores ``A^T``)
    and their bias, and computes ``Y_i = X·A_i``.

    ``copy_input`` applies f to the input (identity forward, all-reduce backward),
    or under ``sequence_parallel`` Korthikanti's g (all-gather the sequence); set it
    False when the caller already did (attention runs f once for q, k and v).
    ``gather_output`` all-gathers the column slices into the whole ``Y``.
    ``name`` (the module's path, e.g. ``blocks.0.mlp.fc``) tags its collectives
    ``name:fwd`` / ``name:bwd`` in telemetry and seeds its own init: every rank
    draws the same full matrix from ``(seed, name)`` and keeps its rows.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axis,
        *,
        bias: bool = True,
        gather_output: bool = False,
        copy_input: bool = True,
        sequence_parallel: bool = False,
        seed: int = 0,
        name: str = "column",
    ) -> None:
        super().__init__()
        _check_divides("out_features", out_features, axis.size)
        self.in_features, self.out_features = in_features, out_features
        self.axis, self.name = axis, name
        self.gather_output, self.copy_input = gather_output, copy_input
        self.sequence_parallel = sequence_parallel
        # like Megatron's CPU init: draw the whole matrix the same way on every rank,
        # keep my rows; the shards then form one consistent full matrix
        full = _seeded_normal(
            (out_features, in_features), in_features**-0.5, seed, name
        )
        self.weight = nn.Parameter(_shard(full, 0, axis))  # (out/t, in)
        self.weight.tensor_parallel_dim = 0
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // axis.size))
            self.bias.tensor_parallel_dim = 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, axis, **kwargs) -> ColumnParallelLinear:
        """My shard of an existing ``nn.Linear`` (for parity with it)."""
        kwargs.setdefault("bias", linear.bias is not None)
        layer = cls(linear.in_features, linear.out_features, axis, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard(linear.weight, 0, axis))
            if layer.bias is not None:
                layer.bias.copy_(_shard(linear.bias, 0, axis))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            f = gather_from_sp if self.sequence_parallel else copy_to_tp
            x = f(x, self.axis, self.name)  # (B, T, in) on every rank
        y = F.linear(x, self.weight, self.bias)  # (B, T, out/t): Y_i = X·A_i
        if self.gather_output:
            y = gather_from_tp(y, self.axis, self.name)  # (B, T, out)
        return y

    def extra_repr(self) -> str:
        t = self.axis.size
        return f"in={self.in_features}, out={self.out_features}/{t}, tp={t}"


class RowParallelLinear(nn.Module):
    """``Y = X·A`` with ``A = [A_1; …; A_t]`` split by rows (Megatron §3): rank i
    holds ``weight`` columns ``i·in/t … (i+1)·in/t``, computes ``X_i·A_i``, and g
    sums the partial products, ``Y = Σ_i X_i·A_i``. The bias is whole on every rank
    and added **once, after** the sum (added before, it would count t times).

    ``input_is_parallel=False`` first keeps this rank's slice of a whole input.
    Under ``sequence_parallel`` the sum is Korthikanti's ḡ, a reduce-scatter along
    the sequence, so the bias sees only this rank's tokens: its gradient is partial,
    and :meth:`TensorParallelStage.finish_gradient_synchronization` sums it over tp.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axis,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seed: int = 0,
        name: str = "row",
    ) -> None:
        super().__init__()
        _check_divides("in_features", in_features, axis.size)
        self.in_features, self.out_features = in_features, out_features
        self.axis, self.name = axis, name
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        full = _seeded_normal(
            (out_features, in_features), in_features**-0.5, seed, name
        )
        self.weight = nn.Parameter(_shard(full, 1, axis))  # (out, in/t)
        self.weight.tensor_parallel_dim = 1
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))  # whole, replicated
            self.bias.sequence_parallel = sequence_parallel

    @classmethod
    def from_linear(cls, linear: nn.Linear, axis, **kwargs) -> RowParallelLinear:
        """My shard of an existing ``nn.Linear`` (for parity with it)."""
        kwargs.setdefault("bias", linear.bias is not None)
        layer = cls(linear.in_features, linear.out_features, axis, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard(linear.weight, 1, axis))
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.axis, self.name)  # (B, T, in/t)
        partial = F.linear(x, self.weight)  # (B, T, out): X_i·A_i, one term of Y
        g = reduce_scatter_to_sp if self.sequence_parallel else reduce_from_tp
        y = g(partial, self.axis, self.name)  # Σ_i X_i·A_i: (B, T or T/t, out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        t = self.axis.size
        return f"in={self.in_features}/{t}, out={self.out_features}, tp={t}"


class ParallelMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with ``fc`` column- and ``proj`` row-parallel (Megatron
    Figure 3a): GELU is elementwise, so it runs on local columns, and the block
    costs one g forward and one f backward."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        axis,
        rng: TPRandom,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        name: str = "mlp",
    ) -> None:
        super().__init__()
        sp = sequence_parallel
        self.fc = ColumnParallelLinear(
            d_model, d_ff, axis, bias=bias, sequence_parallel=sp, name=f"{name}.fc"
        )
        self.act = nn.GELU()
        self.proj = RowParallelLinear(
            d_ff, d_model, axis, bias=bias, sequence_parallel=sp, name=f"{name}.proj"
        )
        # its output is whole on every rank, or a sequence shard under SP
        self.drop = ParallelDropout(dropout, rng, sharded=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))  # (B, T, d_ff/t)
        return self.drop(self.proj(h))  # (B, T, C), or (B, T/t, C) under SP


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split over the tp group (Megatron
    Figure 3b): ``q``, ``k``, ``v`` are column-parallel (rank i holds heads
    ``i·nh/t … (i+1)·nh/t``), each head attends on its own rank, and the output
    projection ``proj`` is row-parallel. One f for q, k and v together, one g.

    The math is line for line :class:`dtlab.model.CausalSelfAttention`'s.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        axis,
        rng: TPRandom,
        *,
        bias: bool = True,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        name: str = "attn",
    ) -> None:
        super().__init__()
        if n_heads % axis.size:
            raise ValueError(
                f"tp={axis.size} does not divide n_heads={n_heads}: tensor "
                "parallelism gives each rank whole attention heads; pick tp from "
                f"{divisors(n_heads)}"
            )
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} does not divide d_model={d_model}")
        self.axis, self.name, self.sequence_parallel = axis, name, sequence_parallel
        self.head_dim = d_model // n_heads
        # f runs once, here, for q, k and v together: one all-reduce backward, not 3
        col = dict(bias=bias, copy_input=False)
        self.q = ColumnParallelLinear(d_model, d_model, axis, name=f"{name}.q", **col)
        self.k = ColumnParallelLinear(d_model, d_model, axis, name=f"{name}.k", **col)
        self.v = ColumnParallelLinear(d_model, d_model, axis, name=f"{name}.v", **col)
        self.proj = RowParallelLinear(
            d_model,
            d_model,
            axis,
            bias=bias,
            sequence_parallel=sequence_parallel,
            name=f"{name}.proj",
        )
        # the attention matrix holds my heads only: a shard, so its own mask
        self.attn_drop = ParallelDropout(dropout, rng, sharded=True)
        self.resid_drop = ParallelDropout(dropout, rng, sharded=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = gather_from_sp if self.sequence_parallel else copy_to_tp
        x = f(x, self.axis, self.name)  # (B, T, C), whole on every rank
        B, T, _ = x.shape
        hs = self.head_dim
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, nh/t*hs) each
        nh = q.shape[-1] // hs  # my heads: n_heads / t
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh/t, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh/t, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh/t, T, hs)

        y = self.core(q, k, v)  # (B, nh/t, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, C/t)
        return self.resid_drop(self.proj(y))  # (B, T, C), or (B, T/t, C) under SP

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``dropout(softmax(QK^T / sqrt(hs) + causal)) V`` on this rank's heads,
        ``(B, nh/t, T, hs)`` each: what selective recomputation re-runs
        (:mod:`dtlab.recompute`; needs no communication, heads are local)."""
        T, hs = q.shape[-2], q.shape[-1]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh/t, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        return att @ v  # (B, nh/t, T, hs)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp (Megatron §3, "input
    embedding"): rank i holds rows ``i·V'/t … (i+1)·V'/t`` of a table padded to
    ``V' = padded_vocab(V, t)``. Each rank looks up the ids it owns, writes zeros
    for the rest, and g sums the pieces (under SP: ḡ, a reduce-scatter along the
    sequence, so each rank keeps only its tokens)."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        axis,
        *,
        sequence_parallel: bool = False,
        seed: int = 0,
        name: str = "wte",
    ) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.axis, self.name = vocab_size, dim, axis, name
        self.sequence_parallel = sequence_parallel
        self.padded_size = padded_vocab(vocab_size, axis.size)
        self.per_rank = self.padded_size // axis.size
        self.start = axis.index * self.per_rank  # my first token id
        full = _seeded_normal((vocab_size, dim), 1.0, seed, name)
        self.weight = nn.Parameter(_shard(full, 0, axis, self.padded_size))  # (V'/t, C)
        self.weight.tensor_parallel_dim = 0

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, axis, **kwargs):
        """My rows of an existing ``nn.Embedding`` (for parity with it)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, axis, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard(emb.weight, 0, axis, layer.padded_size))
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start  # (B, T)
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)  # (B, T, C)
        out = out * mine.unsqueeze(-1)  # zero rows for ids another rank owns
        g = reduce_scatter_to_sp if self.sequence_parallel else reduce_from_tp
        return g(out, self.axis, self.name)  # (B, T, C) or (B, T/t, C)

    def extra_repr(self) -> str:
        return (
            f"{self.vocab_size} (padded {self.padded_size}) / tp={self.axis.size}, "
            f"dim={self.dim}"
        )

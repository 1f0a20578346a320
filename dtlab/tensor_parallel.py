"""Tensor parallelism the Megatron-LM way, with sequence parallelism and a
vocab-parallel loss.

Taught in chapter 04 (``notebooks/04_tensor_parallel.ipynb``); chapter 07 splits
pipeline stages with it (:class:`TensorParallelStage`, composed by
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

The tensor-parallel (tp) group of ``t`` ranks holds one copy of the model between
them. For ``Y = X·A`` (``A`` of shape ``(in, out)``, torch stores ``A^T``):

- **column parallel**: ``A = [A_1 … A_t]``, rank i computes ``Y_i = X·A_i``: the
  input must be whole on every rank, the output comes out split by columns;
- **row parallel**: ``A = [A_1; …; A_t]``, rank i computes ``X_i·A_i`` from its
  column-slice ``X_i``: the partial outputs must be *summed*, ``Y = Σ_i X_i·A_i``.

Column then row needs no communication in between (GELU, and attention per head,
act on local columns). The conjugate operators of Megatron's §3 join the pieces:

======  ===========================  ==========================
 op      forward                      backward
======  ===========================  ==========================
 f       identity                     all-reduce  (sum of dX_i)
 g       all-reduce (sum of partial)  identity
======  ===========================  ==========================

Per transformer layer: attention (f … g) and MLP (f … g) give **2 all-reduces
forward and 2 backward**, each of the full activation ``b·s·h``. They sit on the
critical path (the next matmul needs their result), which is why TP stays inside a
node. Under sequence parallelism f/g become Korthikanti's g/ḡ: all-gather along the
sequence forward (reduce-scatter backward) and reduce-scatter forward (all-gather
backward).

Activations here are ``(B, T, C)``; sequence parallelism splits ``T``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtlab import comm, telemetry
from dtlab.topology import padded_vocab

__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "TPRandom",
    "ParallelDropout",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "ParallelBlock",
    "TensorParallelGPT",
    "TensorParallelStage",
    "tensor_parallel_gpt",
    "load_shards_",
    "tp_train_step",
    "tp_grad_norm",
]


# ---- moving tensors between ranks along one dimension --------------------------------
def _split(x: torch.Tensor, dim: int, axis) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication)."""
    if x.shape[dim] % axis.size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split over "
            f"tp={axis.size} ranks: make it a multiple of tp"
        )
    return x.chunk(axis.size, dim)[axis.index].contiguous()


def _all_gather(x: torch.Tensor, dim: int, axis, tag: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    x = x.contiguous()
    t, d0 = axis.size, x.shape[0]
    # gloo and nccl gather along dim 0: (t*d0, ...), rank order
    out = torch.empty((t * d0, *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group=axis, tag=tag)
    return torch.cat(out.split(d0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, axis, tag: str) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice along ``dim``."""
    if x.shape[dim] % axis.size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split over "
            f"tp={axis.size} ranks: make it a multiple of tp"
        )
    # comm.reduce_scatter cuts dim 0: bring the t slices of `dim` to the front
    slices = torch.cat(x.chunk(axis.size, dim), dim=0)  # (t*d0, ...): slice i at i
    out = torch.empty_like(
        x.chunk(axis.size, dim)[0], memory_format=torch.contiguous_format
    )
    comm.reduce_scatter(out, slices, group=axis, tag=tag)
    return out


def _all_reduce(x: torch.Tensor, axis, tag: str) -> torch.Tensor:
    # a fresh contiguous copy: the tensor autograd hands us may be shared or strided
    x = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(x, group=axis, tag=tag)
    return x


# ---- the conjugate operators (Megatron-LM §3; Korthikanti et al. §4.2.2) -------------
class _CopyToTP(torch.autograd.Function):
    """Megatron's **f**: identity forward, all-reduce of the input gradient backward
    (each rank's column slice contributed part of dL/dX)."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis, ctx.name = axis, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.axis, f"{ctx.name}:bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's **g**: all-reduce forward (sum the row-parallel partial outputs),
    identity backward (every rank needs the whole dL/dY)."""

    @staticmethod
    def forward(ctx, x, axis, name):
        return _all_reduce(x, axis, f"{name}:fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis = axis
        return _all_gather(x, -1, axis, f"{name}:fwd")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.axis), None, None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis, ctx.name = axis, name
        return _split(x, -1, axis)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.axis, f"{ctx.name}:bwd"), None, None


class _GatherFromSP(torch.autograd.Function):
    """Korthikanti's **g** (sequence parallel → tensor parallel region): all-gather
    the sequence forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis, ctx.name = axis, name
        return _all_gather(x, 1, axis, f"{name}:fwd")  # (B, T/t, C) -> (B, T, C)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.axis, f"{ctx.name}:bwd"), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Korthikanti's **ḡ** (tensor parallel → sequence parallel region): sum the
    partial outputs and keep this rank's sequence slice; all-gather backward."""

    @staticmethod
    def forward(ctx, x, axis, name):
        ctx.axis, ctx.name = axis, name
        return _reduce_scatter(x, 1, axis, f"{name}:fwd")  # (B, T, C) -> (B, T/t, C)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.axis, f"{ctx.name}:bwd"), None, None


def _apply(fn, x, axis, name):
    # a tp group of one rank has nothing to exchange: the operator is the identity
    return x if axis.size == 1 else fn.apply(x, axis, name)


def copy_to_tp(x, axis, name="f"):
    """f: identity forward, all-reduce backward."""
    return _apply(_CopyToTP, x, axis, name)


def reduce_from_tp(x, axis, name="g"):
    """g: all-reduce forward, identity backward."""
    return _apply(_ReduceFromTP, x, axis, name)


def gather_from_tp(x, axis, name="gather"):
    """All-gather the last dim forward, split backward."""
    return _apply(_GatherFromTP, x, axis, name)


def scatter_to_tp(x, axis, name="scatter"):
    """Split the last dim forward, all-gather backward."""
    return _apply(_ScatterToTP, x, axis, name)


def gather_from_sp(x, axis, name="sp_gather"):
    """Sequence-parallel g: all-gather dim 1 forward, reduce-scatter backward."""
    return _apply(_GatherFromSP, x, axis, name)


def reduce_scatter_to_sp(x, axis, name="sp_scatter"):
    """Sequence-parallel ḡ: reduce-scatter dim 1 forward, all-gather backward."""
    return _apply(_ReduceScatterToSP, x, axis, name)


# ---- random numbers: same mask where replicated, different where sharded -------------
class TPRandom:
    """Two random streams per rank, as Megatron's RNG tracker keeps (§ "model parallel
    random number generation" in its code):

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
        self._gens: dict[tuple[bool, str], torch.Generator] = {}

    def generator(self, sharded: bool, device) -> torch.Generator:
        key = (sharded, str(device))
        if key not in self._gens:
            seed = self.seed + (self.OFFSET + self.index if sharded else 0)
            self._gens[key] = torch.Generator(device=device).manual_seed(seed)
        return self._gens[key]


class ParallelDropout(nn.Module):
    """Dropout drawing its mask from one of :class:`TPRandom`'s streams."""

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


# ---- layers --------------------------------------------------------------------------
def _check_divides(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(
            f"tp={tp} does not divide {what}={n}: each rank must hold an equal share; "
            f"pick tp from {[d for d in range(1, n + 1) if n % d == 0]}"
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
    from dtlab.model import param_generator

    return torch.randn(*shape, generator=param_generator(seed, f"{name}.weight")) * std


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
            enter = gather_from_sp if self.sequence_parallel else copy_to_tp
            x = enter(x, self.axis, self.name)  # (B, T, in) on every rank
        y = F.linear(x, self.weight, self.bias)  # (B, T, out/t): my columns
        if self.gather_output:
            y = gather_from_tp(y, self.axis, self.name)  # (B, T, out)
        return y

    def extra_repr(self) -> str:
        t = self.axis.size
        return f"in={self.in_features}, out={self.out_features}/{t}, tp={t}"


class RowParallelLinear(nn.Module):
    """``Y = X·A`` with ``A = [A_1; …; A_t]`` split by rows (Megatron §3): rank i
    holds ``weight`` columns ``i·in/t … (i+1)·in/t`` and computes ``X_i·A_i``; g
    sums the partial products. The bias is whole on every rank and added **once,
    after** the sum (added before, it would be counted t times).

    ``input_is_parallel=False`` first keeps this rank's slice of a whole input.
    Under ``sequence_parallel`` the sum is a reduce-scatter along the sequence
    (ḡ), so the bias sees only this rank's tokens: its gradient is partial and is
    summed over tp by :meth:`TensorParallelGPT.finish_gradient_synchronization`.
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
        partial = F.linear(x, self.weight)  # (B, T, out): my share of the sum
        leave = reduce_scatter_to_sp if self.sequence_parallel else reduce_from_tp
        y = leave(partial, self.axis, self.name)  # (B, T, out) or (B, T/t, out)
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
                f"{[d for d in range(1, n_heads + 1) if n_heads % d == 0]}"
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
            d_model, d_model, axis, bias=bias, sequence_parallel=sequence_parallel,
            name=f"{name}.proj",
        )  # fmt: skip
        # the attention matrix holds my heads only: a shard, so its own mask
        self.attn_drop = ParallelDropout(dropout, rng, sharded=True)
        self.resid_drop = ParallelDropout(dropout, rng, sharded=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enter = gather_from_sp if self.sequence_parallel else copy_to_tp
        x = enter(x, self.axis, self.name)  # (B, T, C), whole on every rank
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
        layer = cls(emb.num_embeddings, emb.embedding_dim, axis, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard(emb.weight, 0, axis, layer.padded_size))
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start  # (B, T)
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)  # (B, T, C)
        out = out * mine.unsqueeze(-1)  # zero rows for ids another rank owns
        leave = reduce_scatter_to_sp if self.sequence_parallel else reduce_from_tp
        return leave(out, self.axis, self.name)  # (B, T, C) or (B, T/t, C)

    def extra_repr(self) -> str:
        return (
            f"{self.vocab_size} (padded {self.padded_size}) / tp={self.axis.size}, "
            f"dim={self.dim}"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary (Megatron's
    ``vocab_parallel_cross_entropy``). For one token with logits ``z``:
    ``loss = log Σ_v exp(z_v − m) − (z_target − m)``, ``m = max_v z_v``. Three
    all-reduces of one number per token (max, sum of exps, target logit) replace an
    all-gather of ``V`` numbers per token; backward is local:
    ``dL/dz = softmax(z) − onehot(target)``."""

    @staticmethod
    def forward(ctx, logits, targets, axis, vocab_size, name):
        N, V_local = logits.shape  # (N, V'/t)
        start = axis.index * V_local
        cols = torch.arange(start, start + V_local, device=logits.device)
        if vocab_size is not None and start + V_local > vocab_size:
            # padding columns are no tokens: they must take no probability
            logits = logits.masked_fill(cols >= vocab_size, float("-inf"))
        m = logits.max(dim=-1).values  # (N,)
        if axis.size > 1:
            comm.all_reduce(m, op=comm.ReduceOp.MAX, group=axis, tag=f"{name}:fwd")
        shifted = logits - m.unsqueeze(-1)  # (N, V'/t), all <= 0
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # (N,)
        mine = (targets >= start) & (targets < start + V_local)  # (N,)
        local_t = (targets - start).clamp(0, V_local - 1)
        z_t = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1)  # (N,)
        z_t = torch.where(mine, z_t, torch.zeros_like(z_t))
        if axis.size > 1:
            comm.all_reduce(sum_exp, group=axis, tag=f"{name}:fwd")
            comm.all_reduce(z_t, group=axis, tag=f"{name}:fwd")
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine)
        return sum_exp.log() - z_t  # (N,) per-token loss

    @staticmethod
    def backward(ctx, grad):  # grad: (N,)
        softmax, local_t, mine = ctx.saved_tensors
        g = softmax.clone()  # (N, V'/t)
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= mine.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    axis,
    vocab_size: int | None = None,
    *,
    name: str = "loss",
) -> torch.Tensor:
    """Mean cross-entropy of ``(..., V'/t)`` logit shards against ``(...)`` targets,
    equal to ``F.cross_entropy`` on the whole logits, which no rank ever holds.
    ``vocab_size`` masks the padding columns of the last rank(s)."""
    V_local = local_logits.shape[-1]
    if targets.shape != local_logits.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} do not match logits "
            f"{tuple(local_logits.shape)} without their last (vocab) dim"
        )
    if axis.size == 1:  # nothing is split: the plain loss, bit for bit
        z = local_logits[..., :vocab_size] if vocab_size else local_logits
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1))
    losses = _VocabParallelCrossEntropy.apply(
        local_logits.reshape(-1, V_local), targets.reshape(-1), axis, vocab_size, name
    )
    return losses.mean()


# ---- the GPT -------------------------------------------------------------------------
class ParallelBlock(nn.Module):
    """Pre-norm block ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``. The LayerNorms
    run on whole activations (replicated), or on a sequence shard under SP, where
    their gradients are partial sums and must be added over tp."""

    def __init__(self, config, axis, rng: TPRandom, sp: bool, name: str) -> None:
        super().__init__()
        C = config.d_model
        self.ln_1 = nn.LayerNorm(C)
        self.attn = ParallelSelfAttention(
            C, config.n_heads, axis, rng, bias=config.bias, dropout=config.dropout,
            sequence_parallel=sp, name=f"{name}.attn",
        )  # fmt: skip
        self.ln_2 = nn.LayerNorm(C)
        self.mlp = ParallelMLP(
            C, config.d_ff, axis, rng, bias=config.bias, dropout=config.dropout,
            sequence_parallel=sp, name=f"{name}.mlp",
        )  # fmt: skip
        for ln in (self.ln_1, self.ln_2):
            for p in ln.parameters():
                p.sequence_parallel = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C), or (B, T/t, C) under SP
        return x + self.mlp(self.ln_2(x))


class TensorParallelGPT(nn.Module):
    """:class:`dtlab.model.GPT` split over the tp axis of a topology.

    Parameter names are the GPT's; each rank holds a slice of the sharded ones
    (``param.tensor_parallel_dim`` says along which dim) and a copy of the rest.
    ``forward(idx, targets) -> (local_logits, loss)``: ``local_logits`` is this
    rank's ``(B, T, V'/t)`` vocabulary slice, the loss is the full mean
    cross-entropy, the same on every tp rank. Build it with
    :func:`tensor_parallel_gpt`.
    """

    def __init__(self, config, topo, *, sequence_parallel=False, seed=0) -> None:
        super().__init__()
        # torch's default init of wpe draws from the global RNG: leave it untouched
        with torch.random.fork_rng(devices=[]):
            self._build(config, topo, sequence_parallel, seed)

    def _build(self, config, topo, sequence_parallel, seed) -> None:
        axis = topo.axis("tp")
        t = axis.size
        _check_divides("n_heads", config.n_heads, t)
        if sequence_parallel and config.seq_len % t:
            raise ValueError(
                f"sequence parallelism splits seq_len={config.seq_len} over tp={t}: "
                "make seq_len a multiple of tp, or turn sequence_parallel off"
            )
        self.config, self.axis, self.sequence_parallel = config, axis, sequence_parallel
        self.rng = TPRandom(seed, axis)
        sp = sequence_parallel
        self.wte = VocabParallelEmbedding(
            config.vocab_size, config.d_model, axis, sequence_parallel=sp
        )
        self.wpe = nn.Embedding(config.seq_len, config.d_model)  # replicated
        self.drop = ParallelDropout(config.dropout, self.rng, sharded=sp)
        self.blocks = nn.ModuleList(
            ParallelBlock(config, axis, self.rng, sp, f"blocks.{i}")
            for i in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        # the head is column-parallel over the vocabulary; its logits stay split
        V_pad = self.wte.padded_size
        self.head = ColumnParallelLinear(
            config.d_model, V_pad, axis, bias=False, sequence_parallel=sp, name="head"
        )
        if config.tied_head:
            self.head.weight = self.wte.weight  # same rows, same shard
        for p in (*self.wpe.parameters(), *self.ln_f.parameters()):
            p.sequence_parallel = sp
        self._sp_grads_pending = False

    # -- the three parts, as GPT has them
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(
                f"sequence length {T} exceeds seq_len={self.config.seq_len}"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        if self.sequence_parallel:
            pos = _split(pos, 0, self.axis)  # (T/t,): the positions of my tokens
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) or (B, T/t, C)

    def output(self, x, targets=None):
        logits = self.head(self.ln_f(x))  # (B, T, V'/t): never the whole vocabulary
        if targets is None:
            return logits, None
        loss = vocab_parallel_cross_entropy(
            logits, targets, self.axis, self.config.vocab_size
        )
        return logits, loss

    def forward(self, idx, targets=None):
        if self.sequence_parallel and idx.shape[1] % self.axis.size:
            raise ValueError(
                f"sequence parallelism needs T={idx.shape[1]} divisible by "
                f"tp={self.axis.size}"
            )
        if self.sequence_parallel and torch.is_grad_enabled():
            self._sp_grads_pending = True
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.output(x, targets)

    # -- gradients and full tensors
    def finish_gradient_synchronization(self) -> None:
        """Under sequence parallelism, sum the partial gradients of the parameters
        that live in the sequence-sharded regions (LayerNorms, row-parallel biases,
        position embeddings) over tp, in one coalesced all-reduce, as Megatron does
        after backward. Idempotent: a second call before the next forward is free."""
        if not self._sp_grads_pending:
            return
        self._sp_grads_pending = False
        grads = [
            p.grad
            for p in self.parameters()
            if getattr(p, "sequence_parallel", False) and p.grad is not None
        ]
        if not grads or self.axis.size == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=self.axis, tag="sp_grads")
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The whole ``(B, T, V)`` logits (for tests and sampling, not training)."""
        full = gather_from_tp(local_logits.detach(), self.axis, "logits")
        return full[..., : self.config.vocab_size]

    def full_tensors(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """``{name: whole tensor}`` of every parameter (or its gradient), gathered
        over tp and trimmed of vocabulary padding: comparable with ``GPT``'s."""
        out = {}
        for name, p in self.named_parameters():
            t = p.grad if grads else p
            if t is None:
                continue
            t = t.detach()
            dim = getattr(p, "tensor_parallel_dim", None)
            if dim is not None and self.axis.size > 1:
                t = _all_gather(t, dim, self.axis, "gather_full")
            if name in ("wte.weight", "head.weight"):
                t = t[: self.config.vocab_size]  # drop the padding rows
            out[name] = t
        return out


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


class TensorParallelStage(nn.Module):
    """One pipeline stage (:class:`dtlab.pipeline.StageModule`) split over the tp axis:
    3D parallelism's stage (chapter 07). The vocab-parallel embedding if it is the
    first stage, :class:`ParallelBlock` s for its layers, the final LayerNorm and the
    column-parallel head if it is the last, whose logits stay split over the
    vocabulary; :meth:`loss` is :func:`vocab_parallel_cross_entropy` on them.

    Parameter names are the stage's (``blocks.5.attn.q.weight``), so
    :meth:`from_stage` loads this rank's slices of a plain stage with
    :func:`load_shards_`. A tied head on a last stage that is not the first is a copy
    of ``wte`` split like it (rows of the padded vocabulary); the pipeline sums the
    two copies' gradients over the first and last stage, shard by shard.
    """

    def __init__(
        self, config, layers, axis, *, first, last, sequence_parallel=False, seed=0
    ) -> None:
        super().__init__()
        t = axis.size
        _check_divides("n_heads", config.n_heads, t)
        self.config, self.axis, self.sequence_parallel = config, axis, sequence_parallel
        self.first, self.last = first, last
        self.rng = TPRandom(seed, axis)
        sp = sequence_parallel
        with torch.random.fork_rng(devices=[]):  # wpe's default init draws
            if first:
                self.wte = VocabParallelEmbedding(
                    config.vocab_size, config.d_model, axis, sequence_parallel=sp
                )
                self.wpe = nn.Embedding(config.seq_len, config.d_model)
                self.drop = ParallelDropout(config.dropout, self.rng, sharded=sp)
            self.blocks = nn.ModuleDict(
                {
                    str(i): ParallelBlock(config, axis, self.rng, sp, f"blocks.{i}")
                    for i in layers
                }
            )
            if last:
                self.ln_f = nn.LayerNorm(config.d_model)
                self.head = ColumnParallelLinear(
                    config.d_model, padded_vocab(config.vocab_size, t), axis,
                    bias=False, sequence_parallel=sp, name="head",
                )  # fmt: skip
        if first and last and config.tied_head:
            self.head.weight = self.wte.weight
        replicated = [*self.ln_f.parameters()] if last else []
        if first:
            replicated += list(self.wpe.parameters())
        for q in replicated:
            q.sequence_parallel = sp

    @classmethod
    def from_stage(cls, stage, axis, *, sequence_parallel=False, seed=0):
        """This rank's tp slices of a plain :class:`~dtlab.pipeline.StageModule`."""
        layers = [int(i) for i in stage.blocks]
        tp_stage = cls(
            stage.config, layers, axis, first=stage.first, last=stage.last,
            sequence_parallel=sequence_parallel, seed=seed,
        )  # fmt: skip
        load_shards_(tp_stage, stage, axis)
        tp_stage.train(stage.training)
        return tp_stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids or activations ``(B, T, C)`` (``(B, T/t, C)`` under SP) ->
        activations, or this rank's ``(B, T, V'/t)`` logits on the last stage."""
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)  # (T,)
            if self.sequence_parallel:
                pos = _split(pos, 0, self.axis)  # (T/t,): the positions of my tokens
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C) or (B, T/t, C)
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))  # (B, T, V'/t)
        return x

    def loss(self, local_logits: torch.Tensor, targets: torch.Tensor):
        """Mean cross-entropy over the whole vocabulary, from the logit shards."""
        return vocab_parallel_cross_entropy(
            local_logits, targets, self.axis, self.config.vocab_size
        )


def tensor_parallel_gpt(model, topo, *, sequence_parallel: bool = False, seed=0):
    """Split a :class:`dtlab.model.GPT` (or ``GPT(config, seed)`` when given a
    :class:`~dtlab.model.GPTConfig`) over ``topo``'s tp axis.

    Every rank passes the same full model (its weights are deterministic, seeded
    per parameter name) and keeps its own slices of it, so the result starts from
    exactly the weights of the single-process model and parity is testable.
    ``seed`` also seeds dropout (:class:`TPRandom`).
    """
    from dtlab.model import GPT, GPTConfig

    if isinstance(model, GPTConfig):
        model = GPT(model, seed=seed)
    tp_model = TensorParallelGPT(
        model.config, topo, sequence_parallel=sequence_parallel, seed=seed
    )
    load_shards_(tp_model, model, topo.axis("tp"))
    tp_model.train(model.training)
    return tp_model


def tp_grad_norm(model: nn.Module, axis) -> float:
    """Global gradient norm of a tensor-parallel model: sharded gradients count on
    every rank, replicated ones once (on tp index 0); one all-reduce sums them."""
    device = next(model.parameters()).device  # nccl reduces device tensors only
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "tensor_parallel_dim", None) is not None or axis.index == 0:
            sq += p.grad.double().pow(2).sum()
    if axis.size > 1:
        comm.all_reduce(sq, group=axis, tag="grad_norm")
    return float(sq.sqrt())


def tp_train_step(model, optimizer, x, y, grad_clip: float | None = None) -> dict:
    """One step: forward, backward, SP gradient sums, (clip,) update. Every tp rank
    gets the same batch. Returns ``{"loss", "grad_norm"}`` like
    :func:`dtlab.reference.reference_step`."""
    rec = telemetry.current()
    optimizer.zero_grad(set_to_none=True)
    with rec.span("F"):
        _, loss = model(x, y)
    with rec.span("B"):
        loss.backward()
        model.finish_gradient_synchronization()
    norm = tp_grad_norm(model, model.axis)
    if grad_clip is not None:
        if grad_clip <= 0:
            raise ValueError(f"grad_clip must be positive, got {grad_clip}")
        scale = min(1.0, grad_clip / (norm + 1e-6))  # clip_grad_norm_'s rule
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    with rec.span("opt"):
        optimizer.step()
    if rec.enabled:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        params = list(model.parameters())
        rec.memory(
            "step",
            params=nbytes(params),
            grads=nbytes(p.grad for p in params if p.grad is not None),
            optimizer=nbytes(
                v for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            ),
        )  # fmt: skip
    return {"loss": loss.item(), "grad_norm": norm}


# the public name of the all-gather along a dimension that dtlab.parallelize uses
all_gather_along = _all_gather

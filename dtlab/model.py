"""The models every chapter trains, and the synthetic data they learn from.

Taught in chapter 00 (what a GPT is made of, and how much memory each piece takes) and
used by every later chapter: the DDP and ZeRO chapters train :class:`GPT` as it is,
the tensor-parallel chapter swaps the Linear layers of ``block.attn`` and ``block.mlp``
for sharded ones, and the pipeline chapter hands each stage a slice of ``model.blocks``.

The GPT follows GPT-2 / nanoGPT: token and learned position embeddings, pre-norm
blocks (``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``), a final LayerNorm and a head
that is tied to the token embedding by default (Press & Wolf 2017).

**Deterministic init.** Every parameter is drawn from its *own* ``torch.Generator``,
seeded from ``(seed, parameter name)``. The global RNG is never advanced, the same seed
gives bit-identical weights in any process, and a pipeline stage that builds only
``blocks.2`` gets exactly the weights that ``blocks.2`` has in the full model.

**Synthetic data.** :class:`SyntheticTokens` samples sequences from a fixed, sparse
random Markov chain: each token has only a few possible successors. A model that
learns the chain's transition table drives the loss from ``ln(vocab_size)`` towards
the chain's entropy (:meth:`SyntheticTokens.entropy_floor`), visibly within a few
dozen AdamW steps. Batches are a pure function of ``(seed, step)``.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.checks import integer, positive_int
from dtlab.estimate import model_spec
from dtlab.moe import MoE, check_moe_config, moe_aux_loss

__all__ = [
    "GPTConfig",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "TinyMLP",
    "SyntheticTokens",
    "shard_batch",
    "regression_batch",
    "param_generator",
    "init_gpt_weights",
]

INIT_STD = 0.02  # GPT-2's init scale for weights and embeddings


# ---- configuration -------------------------------------------------------------------
@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`. ``d_ff=None`` means ``4 * d_model`` (GPT-2).

    ``bias`` adds biases to every Linear except the head (GPT-2 has them, LLaMA does
    not); the tensor-parallel chapter uses them to show why a row-parallel layer adds
    its bias once, after the all-reduce.

    ``n_experts > 1`` makes every MLP a mixture of experts (:class:`dtlab.moe.MoE`,
    chapter 11): ``top_k`` (1 or 2) experts per token, ``capacity_factor`` (None:
    drop nothing), and the load-balancing loss times ``aux_loss_coef`` added to the
    loss. The default, one expert, is the plain MLP.
    """

    vocab_size: int = 64
    seq_len: int = 32
    n_layers: int = 2
    n_heads: int = 4
    d_model: int = 64
    d_ff: int | None = None
    dropout: float = 0.0
    tied_head: bool = True
    bias: bool = True
    n_experts: int = 1
    top_k: int = 1
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layers", "n_heads", "d_model"):
            positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}: "
                "every head needs the same width d_model / n_heads"
            )
        if self.d_ff is None:
            # frozen dataclass: resolve the default once, so users read one number
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        else:
            positive_int("d_ff", self.d_ff)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_moe_config(
            self.n_experts, self.top_k, self.capacity_factor, self.aux_loss_coef
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_params(self) -> int:
        """The exact number of parameters of ``GPT(self)`` (tied weights counted once).

        Same count as :func:`dtlab.estimate.model_params` with this config's options
        (:func:`dtlab.estimate.model_spec`; experts and router included); roughly
        ``12 * n_layers * d_model**2 + vocab_size * d_model``.
        """
        return model_spec(self).n_params


# ---- deterministic init --------------------------------------------------------------
def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator private to one parameter: seeded from ``(seed, name)``.

    ``crc32`` (unlike Python's ``hash``) is stable across processes, so every rank
    computes the same seed for the same name.
    """
    mixed = (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
    return torch.Generator(device="cpu").manual_seed(mixed)


@torch.no_grad()
def init_gpt_weights(model: nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2 init: N(0, 0.02) weights and embeddings, zero biases, unit LayerNorms,
    and the residual projections (``attn.proj``, ``mlp.proj``) scaled by
    ``1/sqrt(2 * n_layers)`` so the residual stream's variance does not grow with
    depth (GPT-2 paper, §2.3)."""
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    done: set[int] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        weight = getattr(module, "weight", None)
        if weight is None or id(weight) in done:
            continue  # a tied head: its weight was drawn once, as ``wte.weight``
        done.add(id(weight))
        if isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            is_residual = mod_name.endswith(("attn.proj", "mlp.proj")) or (
                ".experts." in mod_name and mod_name.endswith(".proj")  # MoE's MLPs
            )
            std = residual_std if is_residual else INIT_STD
            gen = param_generator(seed, prefix + "weight")
            module.weight.normal_(0.0, std, generator=gen)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()


@contextmanager
def _global_rng_untouched():
    """Run PyTorch's default init (which draws from the global RNG) and then restore
    the global RNG, so that building a model never changes anyone else's random
    numbers. The values drawn inside are overwritten by our seeded init anyway.

    (Building on the meta device would avoid the wasted init, but ``to_empty`` then
    imports sympy through torch's reference ops: about a second per process.)"""
    with torch.random.fork_rng(devices=[]):
        yield


# ---- the GPT -------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017, §3.2) with separate
    ``q``, ``k``, ``v`` projections and an output projection ``proj``.

    Separate projections let tensor parallelism split them column-wise by heads
    (Megatron-LM, Shoeybi et al. 2019, §3): the number of heads is read from ``q``'s
    output width, so the same math runs on a rank that holds ``n_heads / tp`` of them.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, b = config.d_model, config.bias
        self.head_dim = config.head_dim
        self.q = nn.Linear(d, d, bias=b)
        self.k = nn.Linear(d, d, bias=b)
        self.v = nn.Linear(d, d, bias=b)
        self.proj = nn.Linear(d, d, bias=b)
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        hs = self.head_dim
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, nh*hs) each
        nh = q.shape[-1] // hs  # all heads here, or this rank's share under TP
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)

        y = self.core(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # (B, T, nh*hs)
        return self.resid_drop(self.proj(y))  # (B, T, C)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention core ``dropout(softmax(QK^T / sqrt(hs) + causal)) V``:
        ``(B, nh, T, hs)`` each -> ``(B, nh, T, hs)``.

        A method of its own because it is what *selective* recomputation re-runs in
        backward (Korthikanti et al. 2022, §4.2; :mod:`dtlab.recompute`): its
        ``(B, nh, T, T)`` tensors are the ``5·a·s/h`` term of the activation memory.
        """
        T, hs = q.shape[-2], q.shape[-1]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
        # causal: position t may only look at positions <= t
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        return att @ v  # (B, nh, T, hs)


class MLP(nn.Module):
    """The position-wise feed-forward network ``proj(gelu(fc(x)))``: d -> d_ff -> d.

    In Megatron-LM's tensor parallelism ``fc`` is split by columns and ``proj`` by
    rows, so the GELU runs on local data and one all-reduce finishes the block.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x))  # (B, T, d_ff)
        return self.drop(self.proj(h))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MoE(config) if config.n_experts > 1 else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """A small GPT-2-style language model with deterministic, seeded init.

    ``forward(idx, targets=None) -> (logits, loss)``: ``idx`` and ``targets`` are
    ``(B, T)`` token ids with ``T <= seq_len``; ``logits`` is ``(B, T, vocab_size)``
    and ``loss`` the mean next-token cross-entropy (``None`` without targets).

    Pipeline stages use the three parts separately: :meth:`embed`, ``blocks``,
    :meth:`output`. ``GPT(config, seed)`` twice gives bit-identical weights.
    """

    def __init__(self, config: GPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        config = config or GPTConfig()
        self.config = config
        with _global_rng_untouched():
            self.wte = nn.Embedding(config.vocab_size, config.d_model)
            self.wpe = nn.Embedding(config.seq_len, config.d_model)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tied_head:
            # one tensor, two uses: the head's weight *is* the embedding
            self.head.weight = self.wte.weight
        init_gpt_weights(self, seed, config.n_layers)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings: ``(B, T)`` ids -> ``(B, T, C)``."""
        B, T = idx.shape
        if T > self.config.seq_len:
            raise ValueError(
                f"sequence length {T} exceeds the model's seq_len={self.config.seq_len}"
            )
        pos = self.positions(T, idx.device)  # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)

    def positions(self, T: int, device=None) -> torch.Tensor:
        """The positions of ``T`` tokens: ``0..T-1`` (under context parallelism,
        :func:`dtlab.context_parallel.apply_context_parallel` replaces this with
        the global positions of the rank's tokens)."""
        return torch.arange(T, device=device)

    def output(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final LayerNorm, head and loss: ``(B, T, C)`` -> ``(logits, loss)``."""
        logits = self.head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        V = logits.shape[-1]
        # the loss in fp32 whatever the logits' dtype, as autocast computes it: a
        # 16-bit loss's gradient S = 2^16 is already inf in fp16 (dtlab.amp)
        loss = F.cross_entropy(logits.view(-1, V).float(), targets.reshape(-1))
        if self.config.n_experts > 1:  # the MoE layers' load-balancing losses
            loss = loss + moe_aux_loss(self)
        return logits, loss

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.output(x, targets)

    def n_params(self) -> int:
        """Parameters actually held (a tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())


# ---- a tiny MLP for the simplest examples --------------------------------------------
class TinyMLP(nn.Module):
    """``proj(gelu(fc(x)))``: the smallest model worth distributing.

    The first chapters use it where a GPT would distract (a first all-reduce, DDP).
    Weights are N(0, 1/fan_in), biases zero, each drawn from its own seeded generator
    like :class:`GPT`'s.
    """

    def __init__(
        self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8, seed: int = 0
    ) -> None:
        super().__init__()
        with _global_rng_untouched():
            self.fc = nn.Linear(d_in, d_hidden)
            self.act = nn.GELU()
            self.proj = nn.Linear(d_hidden, d_out)
        with torch.no_grad():
            for name in ("fc", "proj"):
                layer = getattr(self, name)
                std = 1.0 / math.sqrt(layer.in_features)
                gen = param_generator(seed, f"{name}.weight")
                layer.weight.normal_(0.0, std, generator=gen)
                layer.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))  # (B, d_in) -> (B, d_out)


def regression_batch(
    step: int, batch_size: int, d_in: int = 16, d_out: int = 8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression batch for :class:`TinyMLP`: ``y = tanh(x @ W)``
    for a fixed teacher ``W`` (from ``seed``) and fresh ``x`` (from ``seed, step``)."""
    integer("step", step)
    positive_int("batch_size", batch_size)
    teacher = torch.randn(d_in, d_out, generator=param_generator(seed, "teacher"))
    x = torch.randn(
        batch_size, d_in, generator=param_generator(seed, f"x/{step}")
    )  # (B, d_in)
    return x, torch.tanh(x @ teacher / math.sqrt(d_in))  # (B, d_in), (B, d_out)


# ---- synthetic tokens ----------------------------------------------------------------
class SyntheticTokens:
    """Token sequences from a fixed sparse random Markov chain.

    Each token ``i`` has ``branching`` possible successors with fixed random
    probabilities, so the best achievable loss is the chain's entropy rate
    (:meth:`entropy_floor`), far below the ``ln(vocab_size)`` of an untrained model.

    ``batch(step, global_batch_size)`` is a pure function of ``(seed, step)``: the same
    step gives the same global batch whatever was asked before, on every rank. Each
    data-parallel rank then keeps its slice with :func:`shard_batch`.
    """

    def __init__(
        self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 3
    ) -> None:
        positive_int("vocab_size", vocab_size)
        positive_int("seq_len", seq_len)
        positive_int("branching", branching)
        if branching > vocab_size:
            raise ValueError(f"branching={branching} exceeds vocab_size={vocab_size}")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        gen = param_generator(seed, "markov-chain")
        # successors[i] = the `branching` tokens that may follow token i
        self.successors = torch.stack(
            [
                torch.randperm(vocab_size, generator=gen)[:branching]
                for _ in range(vocab_size)
            ]
        )  # (V, k)
        # uneven probabilities make some transitions worth learning first
        weights = torch.rand(vocab_size, branching, generator=gen) + 0.1  # (V, k)
        self.probs = weights / weights.sum(dim=1, keepdim=True)  # (V, k)

    def batch(
        self, step: int, global_batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``: ``x`` and ``y = x`` shifted by one, each
        ``(global_batch_size, seq_len)`` int64."""
        integer("step", step)
        positive_int("global_batch_size", global_batch_size)
        gen = param_generator(self.seed, f"batch/{step}")
        B, T = global_batch_size, self.seq_len
        seq = torch.empty(B, T + 1, dtype=torch.long)  # one extra token for y
        seq[:, 0] = torch.randint(self.vocab_size, (B,), generator=gen)
        for t in range(T):
            cur = seq[:, t]  # (B,)
            choice = torch.multinomial(self.probs[cur], 1, generator=gen)  # (B, 1)
            seq[:, t + 1] = self.successors[cur].gather(1, choice).squeeze(1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)

    def shard(
        self, step: int, global_batch_size: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the global batch of ``step``."""
        x, y = self.batch(step, global_batch_size)
        return shard_batch(x, y, rank, world_size)

    def entropy_floor(self) -> float:
        """The chain's entropy rate in nats: the lowest mean loss any model can reach
        (averaged over the chain's stationary distribution)."""
        V = self.vocab_size
        P = torch.zeros(V, V, dtype=torch.float64)  # transition matrix
        P.scatter_add_(1, self.successors, self.probs.double())
        pi = torch.full((V,), 1.0 / V, dtype=torch.float64)
        for _ in range(500):  # power iteration towards the stationary distribution
            pi = pi @ P
        h = -(self.probs.double() * self.probs.double().log()).sum(dim=1)  # (V,)
        return float(pi @ h)


def shard_batch(
    x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a global batch along dim 0 into ``world_size`` contiguous slices and
    return slice ``rank``, as its own tensors: the rank keeps its rows only, as a
    data loader would hand them (a view would keep the whole global batch alive).
    Concatenating all ranks' slices in rank order gives the global batch back, which
    is what makes DP parity with one process possible."""
    positive_int("world_size", world_size)
    if (
        isinstance(rank, bool)
        or not isinstance(rank, int)
        or not 0 <= rank < world_size
    ):
        raise ValueError(f"rank {rank!r} is outside 0..{world_size - 1}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x has {x.shape[0]} rows but y has {y.shape[0]}")
    B = x.shape[0]
    if B % world_size:
        raise ValueError(
            f"global batch size {B} is not divisible by world_size={world_size}: "
            "every rank must get the same number of samples"
        )
    per_rank = B // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows].clone(), y[rows].clone()  # (B / world_size, T) each

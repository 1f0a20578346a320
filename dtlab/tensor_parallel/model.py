"""dtlab's GPT split over the tp axis: one class for the whole model and for each
pipeline stage of it.

Taught in chapter 04 (the whole GPT: :func:`tensor_parallel_gpt`) and chapter 07
(3D parallelism: :meth:`TensorParallelStage.from_stage`, composed by
:mod:`dtlab.parallelize`). A whole GPT is the stage that is the first and the last
at once, so one class serves both: the vocab-parallel embedding on a first stage,
:class:`ParallelBlock` s for its layers, the final LayerNorm and the
column-parallel head on a last stage, whose logits stay split over the vocabulary
and meet :func:`~dtlab.tensor_parallel.vocab_parallel_cross_entropy`.

Under sequence parallelism (Korthikanti et al. 2022, §4.2.2) the LayerNorms,
dropouts and residual additions see ``(B, T/t, C)``: this rank's tokens only. The
parameters living there (LayerNorms, row-parallel biases, position embeddings) get
partial gradients, summed over tp after backward.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import comm
from dtlab.gradsync import all_reduce_flat
from dtlab.model import GPT, GPTConfig
from dtlab.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from dtlab.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    ParallelSelfAttention,
    VocabParallelEmbedding,
    load_shards_,
)
from dtlab.tensor_parallel.ops import all_gather_along, gather_from_tp, split_along
from dtlab.tensor_parallel.rng import ParallelDropout, TPRandom
from dtlab.topology import padded_vocab

__all__ = [
    "ParallelBlock",
    "TensorParallelStage",
    "tensor_parallel_gpt",
    "TensorParallelGPT",
]


class ParallelBlock(nn.Module):
    """Pre-norm block ``x + attn(ln_1(x))``, ``x + mlp(ln_2(x))``. The LayerNorms
    run on whole activations (replicated), or on a sequence shard under SP, where
    their gradients are partial sums and must be added over tp."""

    def __init__(
        self, config, axis, rng: TPRandom, sequence_parallel: bool, name: str
    ) -> None:
        super().__init__()
        C, sp = config.d_model, sequence_parallel
        common = dict(bias=config.bias, dropout=config.dropout, sequence_parallel=sp)
        self.ln_1 = nn.LayerNorm(C)
        self.attn = ParallelSelfAttention(
            C, config.n_heads, axis, rng, name=f"{name}.attn", **common
        )
        self.ln_2 = nn.LayerNorm(C)
        self.mlp = ParallelMLP(C, config.d_ff, axis, rng, name=f"{name}.mlp", **common)
        for ln in (self.ln_1, self.ln_2):
            for p in ln.parameters():
                p.sequence_parallel = sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C), or (B, T/t, C) under SP
        return x + self.mlp(self.ln_2(x))


class Blocks(nn.ModuleDict):
    """A stage's blocks keyed by their layer in the whole GPT, as
    :class:`~dtlab.pipeline.StageModule` keeps them: parameter names are the GPT's
    (``blocks.5.attn.q.weight``) on every stage. ``blocks[5]`` takes the int too."""

    def __getitem__(self, layer: int | str) -> nn.Module:
        return super().__getitem__(str(layer))


class TensorParallelStage(nn.Module):
    """:class:`dtlab.model.GPT`, or one :class:`~dtlab.pipeline.StageModule` of it,
    split over the tp axis ``axis``.

    ``layers`` (default: all of them) are the GPT's layer numbers this stage holds;
    ``first`` / ``last`` give it the embedding / the head. The defaults are the
    whole GPT. Each rank holds a slice of the sharded parameters
    (``param.tensor_parallel_dim`` says along which dim) and a copy of the rest,
    under the GPT's names, so :func:`load_shards_` fills it from a plain model.

    ``forward(x, targets=None)``: ``(B, T)`` ids on a first stage, activations
    ``(B, T, C)`` (``(B, T/t, C)`` under SP) on the others -> activations, or this
    rank's ``(B, T, V'/t)`` logits on a last stage. Given ``targets``, a last stage
    returns ``(local_logits, loss)`` as ``GPT.forward`` does: the full mean
    cross-entropy, the same on every tp rank.

    A tied head on a stage that is also first *is* ``wte``'s weight (same rows,
    same shard); on a last stage that is not the first it is a copy split like it
    (rows of the padded vocabulary), whose gradient the pipeline sums with the first
    stage's, shard by shard.
    """

    def __init__(
        self,
        config: GPTConfig,
        axis,
        layers=None,
        *,
        first: bool = True,
        last: bool = True,
        sequence_parallel: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        t, sp = axis.size, sequence_parallel
        if sp and config.seq_len % t:
            raise ValueError(
                f"sequence parallelism splits seq_len={config.seq_len} over tp={t}: "
                "make seq_len a multiple of tp, or turn sequence_parallel off"
            )
        layers = range(config.n_layers) if layers is None else layers
        self.config, self.axis, self.sequence_parallel = config, axis, sp
        self.first, self.last = first, last
        self.rng = TPRandom(seed, axis)
        with torch.random.fork_rng(devices=[]):  # wpe's default init draws
            if first:
                self.wte = VocabParallelEmbedding(
                    config.vocab_size, config.d_model, axis, sequence_parallel=sp
                )
                self.wpe = nn.Embedding(config.seq_len, config.d_model)  # replicated
                self.drop = ParallelDropout(config.dropout, self.rng, sharded=sp)
            self.blocks = Blocks(
                {
                    str(i): ParallelBlock(config, axis, self.rng, sp, f"blocks.{i}")
                    for i in layers
                }
            )
            if last:
                self.ln_f = nn.LayerNorm(config.d_model)
                # column-parallel over the vocabulary; its logits stay split
                V_pad = padded_vocab(config.vocab_size, t)
                self.head = ColumnParallelLinear(
                    config.d_model,
                    V_pad,
                    axis,
                    bias=False,
                    sequence_parallel=sp,
                    name="head",
                )
        if first and last and config.tied_head:
            self.head.weight = self.wte.weight
        replicated = [*self.wpe.parameters()] if first else []
        replicated += [*self.ln_f.parameters()] if last else []
        for p in replicated:
            p.sequence_parallel = sp
        self._sp_grads_pending = False
        self._sp_grads_in_backward = False

    @classmethod
    def from_stage(cls, stage, axis, *, sequence_parallel=False, seed=0):
        """This rank's tp slices of a plain :class:`~dtlab.pipeline.StageModule`
        (or of anything with its ``config``, ``first``, ``last`` and ``blocks``)."""
        tp_stage = cls(
            stage.config,
            axis,
            [int(i) for i in stage.blocks],
            first=stage.first,
            last=stage.last,
            sequence_parallel=sequence_parallel,
            seed=seed,
        )
        load_shards_(tp_stage, stage, axis)
        tp_stage.train(stage.training)
        return tp_stage

    # -- the three parts, as GPT has them
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings (a first stage): ``(B, T)`` ids ->
        ``(B, T, C)``, or this rank's ``(B, T/t, C)`` under SP."""
        T, t = idx.shape[1], self.axis.size
        if T > self.config.seq_len:
            raise ValueError(
                f"sequence length {T} exceeds seq_len={self.config.seq_len}"
            )
        if self.sequence_parallel and T % t:
            raise ValueError(f"sequence parallelism needs T={T} divisible by tp={t}")
        pos = self.positions(T, idx.device)  # (T,)
        if self.sequence_parallel:
            pos = split_along(pos, 0, self.axis)  # (T/t,): the positions of my tokens
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C) or (B, T/t, C)

    def positions(self, T: int, device=None) -> torch.Tensor:
        """As :meth:`dtlab.model.GPT.positions`: ``0..T-1``, or under context
        parallelism the global positions of this rank's ``T`` tokens (which sequence
        parallelism then splits over tp)."""
        return torch.arange(T, device=device)

    def output(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        """Final LayerNorm, head and loss (a last stage), as ``GPT.output``:
        ``(B, T, C)`` -> ``(local_logits, loss or None)``."""
        logits = self.head(self.ln_f(x))  # (B, T, V'/t): never the whole vocabulary
        return logits, None if targets is None else self.loss(logits, targets)

    def loss(self, local_logits: torch.Tensor, targets: torch.Tensor):
        """Mean cross-entropy over the whole vocabulary, from the logit shards."""
        return vocab_parallel_cross_entropy(
            local_logits, targets, self.axis, self.config.vocab_size
        )

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        if self.first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C), or (B, T/t, C) under SP
        if self.sequence_parallel and torch.is_grad_enabled():
            self._sp_grads_pending = not self._sp_grads_in_backward
        if not self.last:
            return x
        logits, loss = self.output(x, targets)
        return logits if targets is None else (logits, loss)

    # -- gradients and full tensors
    def finish_gradient_synchronization(self) -> None:
        """Under sequence parallelism, sum the partial gradients of the parameters
        that live in the sequence-sharded regions (LayerNorms, row-parallel biases,
        position embeddings) over tp, in one coalesced all-reduce, as Megatron does
        after backward. Idempotent: a second call before the next forward is free.
        Nothing to do after :meth:`sum_sequence_parallel_grads_in_backward`."""
        if not self._sp_grads_pending:
            return
        self._sp_grads_pending = False
        all_reduce_flat(
            [p.grad for p in self._sequence_parallel_params() if p.grad is not None],
            self.axis,
            tag="sp_grads",
        )

    def sum_sequence_parallel_grads_in_backward(self) -> None:
        """The same sum, moved into backward: each of those gradients is summed over
        tp as backward produces it (a hook before accumulation), and
        :meth:`finish_gradient_synchronization` has nothing left to do. What a
        data-parallel wrapper that takes gradients during backward needs (DDP's
        buckets, ZeRO-2/3's reduce-scatter: :func:`dtlab.parallelize.parallelize`
        asks for it), at a price: one all-reduce per parameter and per microbatch,
        where the coalesced sum is one per step (dtlab.estimate counts it so)."""
        if self._sp_grads_in_backward:
            return
        self._sp_grads_in_backward, self._sp_grads_pending = True, False
        for p in self._sequence_parallel_params():
            p.register_hook(self._sum_over_tp)

    def _sequence_parallel_params(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if getattr(p, "sequence_parallel", False)]

    def _sum_over_tp(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(grad, group=self.axis, tag="sp_grads")
        return grad

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
                t = all_gather_along(t, dim, self.axis, "gather_full")
            if name in ("wte.weight", "head.weight"):
                t = t[: self.config.vocab_size]  # drop the padding rows
            out[name] = t
        return out

    def global_named_parameters(self):
        """``(name in GPT, parameter)``, as :class:`~dtlab.pipeline.StageModule`
        reports them: a tied head copy is ``wte.weight``."""
        for name, param in self.named_parameters():
            if name == "head.weight" and self.config.tied_head:
                name = "wte.weight"
            yield name, param


def tensor_parallel_gpt(model, topo, *, sequence_parallel: bool = False, seed=0):
    """Split a :class:`dtlab.model.GPT` (or ``GPT(config, seed)`` when given a
    :class:`~dtlab.model.GPTConfig`) over ``topo``'s tp axis: the whole GPT as one
    :class:`TensorParallelStage`.

    Every rank passes the same full model (its weights are deterministic, seeded
    per parameter name) and keeps its own slices of it, so the result starts from
    exactly the weights of the single-process model and parity is testable.
    ``seed`` also seeds dropout (:class:`TPRandom`).
    """
    if isinstance(model, GPTConfig):
        model = GPT(model, seed=seed)
    axis = topo.axis("tp")
    tp_model = TensorParallelStage(
        model.config, axis, sequence_parallel=sequence_parallel, seed=seed
    )
    load_shards_(tp_model, model, axis)
    tp_model.train(model.training)
    return tp_model


def TensorParallelGPT(
    config: GPTConfig, topo, *, sequence_parallel: bool = False, seed: int = 0
) -> TensorParallelStage:
    """The whole GPT split over ``topo``'s tp axis, each layer drawing its own
    weights (the old class's name and signature; :func:`tensor_parallel_gpt` starts
    from a GPT's weights instead)."""
    return TensorParallelStage(
        config, topo.axis("tp"), sequence_parallel=sequence_parallel, seed=seed
    )

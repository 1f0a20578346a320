"""Stand-ins for published models, and Llama 3 405B's published layouts.

dtlab's :class:`~dtlab.model.GPT` is GPT-2-shaped: multi-head attention, a GELU
MLP, LayerNorms, learned positions. :func:`stand_in` builds the GPT that stands in
for a published architecture in a dry run: the same width, heads, vocabulary and
context, untied head and biases as published, an MLP as wide in parameters (a
gated MLP's three ``h x d_ff`` matrices become two ``h x 1.5·d_ff`` ones: the same
parameters and matmul FLOPs), and the layers rounded up to a multiple of pp
(dtlab's pipeline gives every stage the same number of blocks). Its ``reason``
says what differs, in words the dry run's report repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.estimate.models import ModelPreset, model_spec
from dtlab.model import GPTConfig

__all__ = ["StandIn", "stand_in", "llama3_405b", "LLAMA3_405B_LAYOUTS"]


@dataclass(frozen=True)
class StandIn:
    """``model``: the GPT that runs; ``preset``: the published architecture;
    ``reason``: what differs between them."""

    name: str
    preset: ModelPreset
    model: GPTConfig
    reason: str


def stand_in(model="405B", *, pp: int = 1, seq_len: int | None = None) -> StandIn:
    """The :class:`StandIn` GPT of a published model (a preset name or a
    :class:`~dtlab.estimate.models.ModelPreset`) for a pipeline of ``pp`` stages."""
    spec = model_spec(model)
    if spec.n_experts > 1:
        raise ValueError(
            f"{spec.name} is a mixture of experts: dtlab does not compose experts "
            "with tp or pp, so no stand-in is made for it"
        )
    layers = -(-spec.n_layers // pp) * pp
    d_ff = spec.d_ff * 3 // 2 if spec.gated_mlp else spec.d_ff
    gpt = GPTConfig(
        vocab_size=spec.vocab_size, seq_len=seq_len or spec.seq_len,
        n_layers=layers, n_heads=spec.n_heads, d_model=spec.d_model, d_ff=d_ff,
        tied_head=spec.tied_embeddings, bias=spec.bias, dropout=0.0,
    )  # fmt: skip
    if seq_len:
        spec = ModelPreset(**{**spec.__dict__, "seq_len": seq_len})
    diffs = []
    if spec.n_kv_heads and spec.n_kv_heads != spec.n_heads:
        diffs.append(
            f"multi-head attention ({spec.n_heads} K/V heads) where {spec.name} "
            f"uses GQA ({spec.n_kv_heads} K/V heads): larger k, v and activations"
        )
    if spec.gated_mlp:
        diffs.append(
            f"a GELU MLP h->{d_ff}->h for SwiGLU's three h x {spec.d_ff} matrices "
            "(same parameters and FLOPs; SwiGLU saves more activations)"
        )
    if not spec.layernorm:
        diffs.append("LayerNorm with bias where it has RMSNorm")
    if not spec.learned_positions:
        diffs.append("learned positions (s x h on the first stage) for RoPE")
    if layers != spec.n_layers:
        diffs.append(
            f"{layers} layers for {spec.n_layers}: dtlab's pp={pp} stages hold "
            "equal blocks"
        )
    reason = f"GPT stand-in for {spec.name}: " + "; ".join(diffs or ["none"])
    return StandIn(spec.name, spec, gpt, reason)


# Dubey et al. 2024 (The Llama 3 Herd of Models), Table 4: GPUs, tp, cp, pp, dp,
# sequence length, sequences per dp rank (16M tokens a batch)
LLAMA3_405B_LAYOUTS = {
    ("8k", 8192): (8, 1, 16, 64, 8192, 32),
    ("8k", 16384): (8, 1, 16, 128, 8192, 16),
    ("128k", 16384): (8, 16, 16, 8, 131072, 16),
}


def llama3_405b(context: str = "8k", gpus: int = 8192, *, strategy: str = "zero2",
                precision: str = "bf16", checkpointing: str = "none",
                schedule: str = "1f1b"):  # fmt: skip
    """``(config, world_size, stand_in)`` of one of Llama 3 405B's published
    layouts (:data:`LLAMA3_405B_LAYOUTS`): one sequence per microbatch, the
    sequences of a dp rank as pipeline microbatches, 16M tokens a step. The
    default ``zero2`` is Meta's FSDP as the paper describes it (optimizer states
    and gradients sharded, weights kept after the forward)."""
    from dtlab.topology import Layout
    from dtlab.train import TrainConfig

    key = (str(context).lower(), gpus)
    if key not in LLAMA3_405B_LAYOUTS:
        raise ValueError(
            f"no published Llama 3 405B layout for {context} context on {gpus} "
            f"GPUs: choose from {sorted(LLAMA3_405B_LAYOUTS)}"
        )
    tp, cp, pp, dp, seq, per_dp = LLAMA3_405B_LAYOUTS[key]
    s = stand_in("405B", pp=pp, seq_len=seq)
    config = TrainConfig(
        model=s.model, layout=Layout(dp=dp, tp=tp, pp=pp, cp=cp),
        strategy=strategy, precision=precision, steps=1,
        global_batch_size=dp * per_dp, microbatches=per_dp, schedule=schedule,
        activation_checkpointing=checkpointing,
    )  # fmt: skip
    return config, tp * cp * pp * dp, s

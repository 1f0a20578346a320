"""Context parallelism: what ring attention and Ulysses send, and what a rank keeps.

Taught in chapter 11 (long context), checked against dtlab.context_parallel's
measured bytes and saved activations. With b the microbatch, s the sequence, h the
model width, h_kv the width of K and V (h without grouped-query attention) and cp
the group:

- **Ring** (Liu et al. 2023; dtlab's ring passes dK/dV accumulators the way
  Megatron-LM does): a rank's K/V block is ``2·b·(s/cp)·h_kv`` values. Forward it
  goes ``cp-1`` hops; backward the blocks go round again (``cp-1``) and the dK/dV
  sums follow (``cp-1`` hops, the last one home): ``3·(cp-1)`` blocks per layer,
  ``3·(cp-1)/cp · 2·b·s·h_kv`` values, constant in cp.
- **Ulysses** (Jacobs et al. 2023, §3.2): an all-to-all of q, k, v and one of the
  output forward, the same two backward; each sends ``(cp-1)/cp`` of its input:
  ``2·(cp-1)/cp · b·(s/cp)·(2h + 2h_kv)`` values, which shrinks as ``1/cp``.

The weights are replicated over cp: their gradients are all-reduced as dp's are
(``2·(cp-1)/cp · Ψ``, :func:`cp_bytes_per_step`).
"""

from __future__ import annotations

from dtlab.checks import one_of, positive_int
from dtlab.estimate.activations import activation_bytes_per_layer
from dtlab.estimate.collectives import wire_bytes
from dtlab.estimate.models import model_spec
from dtlab.events import CP_VARIANTS

__all__ = [
    "cp_bytes_per_layer",
    "cp_bytes_per_step",
    "cp_activation_bytes_per_layer",
]


def _kv_width(d_model: int, n_heads: int | None, n_kv_heads: int | None) -> float:
    return d_model if not n_kv_heads else d_model * n_kv_heads / (n_heads or 1)


def cp_bytes_per_layer(
    micro_batch: int,
    seq_len: int,
    d_model: int,
    cp: int,
    *,
    variant: str = "ring",
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    bytes_per_value: int = 4,
) -> dict[str, float]:
    """Wire bytes one rank sends for one attention layer and microbatch, forward
    and backward: ``{"forward", "backward", "wire_bytes", "ops"}`` (``ops``: the
    sends (ring) or all-to-alls (Ulysses) of forward + backward)."""
    variant = one_of("context-parallel variant", variant, CP_VARIANTS)
    positive_int("micro_batch", micro_batch)
    positive_int("seq_len", seq_len)
    positive_int("d_model", d_model)
    positive_int("cp", cp)
    if seq_len % cp:
        raise ValueError(f"seq_len={seq_len} does not split over cp={cp} ranks")
    tokens = micro_batch * seq_len // cp  # this rank's tokens
    kv = _kv_width(d_model, n_heads, n_kv_heads)
    if variant == "ring":
        block = 2 * tokens * kv * bytes_per_value  # K and V: one message per hop
        fwd, bwd = (cp - 1) * block, 2 * (cp - 1) * block
        ops = 3 * (cp - 1)
    else:
        qkv = tokens * (d_model + 2 * kv) * bytes_per_value
        out = tokens * d_model * bytes_per_value
        fwd = bwd = wire_bytes("all_to_all", qkv, cp) + wire_bytes(
            "all_to_all", out, cp
        )
        ops = 4 if cp > 1 else 0
    return {"forward": fwd, "backward": bwd, "wire_bytes": fwd + bwd, "ops": ops}


def cp_bytes_per_step(
    model,
    cp: int,
    *,
    variant: str = "ring",
    micro_batch_size: int = 1,
    microbatches: int = 1,
    bytes_per_value: int = 4,
    seq_len: int | None = None,
) -> dict[str, float]:
    """Wire bytes one rank of a cp group sends per optimizer step of a whole model
    (a preset name, a ModelPreset, a ``GPTConfig``): ``{"attention": every layer's
    ring or all-to-alls, every microbatch; "gradients": the all-reduce of the
    replicated weights' gradients, once per step; "total"}``. Alone on its axis
    (dp = tp = pp = 1); a composed layout reduces the gradients over dp·cp."""
    spec = model_spec(model)
    positive_int("microbatches", microbatches)
    per_layer = cp_bytes_per_layer(
        micro_batch_size,
        seq_len or spec.seq_len,
        spec.d_model,
        cp,
        variant=variant,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        bytes_per_value=bytes_per_value,
    )["wire_bytes"]
    attention = microbatches * spec.n_layers * per_layer
    gradients = wire_bytes("all_reduce", spec.n_params * bytes_per_value, cp)
    total = attention + gradients
    return {"attention": attention, "gradients": gradients, "total": total}


def cp_activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    cp: int,
    *,
    variant: str = "ring",
    bytes_per_value: int = 2,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    **layer,
) -> float:
    """Activation bytes one rank keeps per layer under context parallelism
    (Korthikanti et al. 2022, §4.1, on this rank's ``s/cp`` tokens; ``tp``,
    ``sequence_parallel``, ``recompute`` and the layer's shape, ``layer``: ``d_ff``,
    ``n_kv_heads``, ``gated_mlp``, ``dropout``, as in
    :func:`activation_bytes_per_layer`):

    - Ulysses: that count ``/ cp``: everything is split, the score matrices
      too (``a/cp`` heads of ``s × s`` each);
    - ring: no score matrix is kept whatever ``recompute`` says (each block's
      probabilities are recomputed in backward from the log-sum-exp, as
      selective recomputation does), but the attention output and its ``lse``
      are: ``(selective count + (sbh + asb)/t) / cp``. No ``s²`` term at all:
      what lets Llama 3 405B train on 128K tokens.
    - full recomputation keeps the layer's input, ``2sbh/cp`` (``/t`` under
      sequence parallelism), either way.
    """
    variant = one_of("context-parallel variant", variant, CP_VARIANTS)
    positive_int("cp", cp)
    kw = dict(
        bytes_per_value=bytes_per_value, tp=tp, sequence_parallel=sequence_parallel,
        **layer,
    )  # fmt: skip
    args = (seq_len, micro_batch, d_model, n_heads)
    if variant == "ulysses" or recompute == "full":
        return activation_bytes_per_layer(*args, recompute=recompute, **kw) / cp
    linear = activation_bytes_per_layer(*args, recompute="selective", **kw)
    sb = seq_len * micro_batch
    kept = (sb * d_model + n_heads * sb) * bytes_per_value / tp  # output and lse
    return (linear + kept) / cp

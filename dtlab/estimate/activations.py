"""Activations: the bytes a transformer layer keeps for the backward pass.

Korthikanti et al. 2022, with tensor and sequence parallelism and selective or
full recomputation (:func:`activation_bytes_per_layer`, the paper's count, for the
planner's large models), and what dtlab's own GPT really keeps
(:func:`dtlab_saved_bytes_per_layer`, exact against the saved-tensor hooks of
:class:`dtlab.memory.SavedBytes`). They differ in four terms, each said below.

Taught in chapter 00 (why distribute); chapters 04, 05 and 08 set it next to
measured peaks.
"""

from __future__ import annotations

from dtlab.checks import one_of
from dtlab.events import CHECKPOINTING

# ---- activations ---------------------------------------------------------------------


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_value: int = 2,
    d_ff: int | None = None,
    n_kv_heads: int | None = None,
    gated_mlp: bool = False,
    dropout: bool = True,
) -> float:
    """Activation bytes one transformer layer keeps for the backward pass
    (Korthikanti et al. 2022, §4.1 and Table 2).

    With s = ``seq_len``, b = ``micro_batch``, h = ``d_model``, a = ``n_heads`` and
    16-bit activations, one GPT layer stores::

        s·b·h·(34 + 5·a·s/h)   bytes

    34·sbh is the linear part (attention 11sbh, MLP 19sbh, two LayerNorms 4sbh,
    dropout masks included); 5·a·s²·b is the attention score matrices (softmax output,
    its dropout mask and dropout output), the part that grows with s².

    Tensor parallelism over t ranks divides everything but the LayerNorm/dropout
    inputs: ``sbh(10 + 24/t + 5as/(ht))``; with sequence parallelism those are split
    too: ``sbh/t · (34 + 5as/h)``. Selective recomputation drops the ``5as/h`` term;
    full recomputation keeps only each layer's input, ``2sbh`` (divided by t under
    sequence parallelism).

    ``bytes_per_value`` rescales from the paper's 2-byte activations (use 4 for fp32).
    Embeddings, the final LayerNorm and the logits are not counted here.

    Llama-style layers, the paper's count term by term (in 2-byte sbh): the two
    norms' inputs (4) and the inputs of q/k/v and of the MLP (2 + 2) stay whole
    under tp; q (2), k and v (``2·h_kv/h`` each, grouped-query attention: ``d_ff``,
    ``n_kv_heads``), the output projection's input (2) and the MLP's are split:
    a GELU MLP keeps ``4·d_ff/h`` (Korthikanti's 16), a SwiGLU one
    (``gated_mlp=True``) ``6·d_ff/h``: the gate and up projections, whose SiLU and
    product the fused kernel recomputes (Megatron-LM's ``bias_swiglu``), and the
    down projection's input. ``dropout=False`` (Llama) drops the two 1-byte masks
    (``2sbh``) and, in the scores, the mask and the dropout output: ``2as/h``
    instead of ``5as/h``. With the defaults (``d_ff = 4h``, multi-head, GELU,
    dropout) this is exactly Korthikanti's count.
    """
    for name, value in (
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("d_model", d_model),
        ("n_heads", n_heads),
        ("tp", tp),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if bytes_per_value <= 0:
        raise ValueError(f"bytes_per_value must be positive, got {bytes_per_value}")
    recompute = one_of("recompute mode", recompute, CHECKPOINTING)
    s, b, h, a, t = seq_len, micro_batch, d_model, n_heads, tp
    sbh = s * b * h
    paper = (d_ff in (None, 4 * h)) and not n_kv_heads and not gated_mlp and dropout
    if recompute != "full" and not paper:
        f = (d_ff or 4 * h) / h
        kv = (n_kv_heads / a) if n_kv_heads else 1.0
        whole = 8 + (2 if dropout else 0)  # norms, q/k/v and MLP inputs, masks
        split = 2 + 4 * kv + 2 + (6 if gated_mlp else 4) * f
        score = 0.0 if recompute == "selective" else (5 if dropout else 2) * a * s / h
        if sequence_parallel:
            per_layer = sbh / t * (whole + split + score)
        else:
            per_layer = sbh * (whole + (split + score) / t)
        return per_layer * bytes_per_value / 2
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        per_layer = 2 * sbh / (t if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = sbh / t * (34 + scores)
    else:
        per_layer = sbh * (10 + 24 / t + scores / t)
    return per_layer * bytes_per_value / 2


def dtlab_saved_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    *,
    d_ff: int | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_value: int = 4,
    dropout: bool = False,
    cp: int = 1,
    cp_variant: str = "ring",
    dropout_mask_bytes: int = 1,
) -> float:
    """The bytes one block of :class:`dtlab.model.GPT` saves for backward, exactly
    (the saved-tensor hooks of chapter 08 measure this number).

    Context parallelism over ``cp`` ranks (chapter 11) divides everything by cp,
    but the attention core: ring attention keeps no score matrix at all, only its
    output and log-sum-exp on the rank's ``a/t`` heads (``v·(sbh/t + a·s·b/t)/cp``,
    recomputing the blocks in backward); Ulysses runs the plain core on ``a/(t·cp)``
    heads of the whole sequence (scores ``/(t·cp)``) and builds the whole ``s²``
    causal mask. The rest is the count below with ``s/cp`` tokens.

    The paper's terms in values of ``bytes_per_value`` bytes (v), with
    ``f = d_ff / d_model`` (4 in GPT-2), tp = t:

    - replicated over tp: the two LayerNorms' inputs and the inputs of q/k/v and of
      fc, ``4·sbh`` values; divided by t: q and k (the scores' inputs), v, the
      output projection's input, and the MLP's GELU input and output, ``(4 +
      2f)·sbh/t``; the score matrix ``a·s²·b/t`` (softmax output);
    - dropout, when on: its three masks (``2·sbh`` + ``as²b/t`` of
      ``dropout_mask_bytes`` each) and the attention dropout's output (``as²b/t``
      values). dtlab's GPT defaults to no dropout: the paper always counts them.
      A mask is 1 byte on a GPU (torch's fused dropout keeps a bool), as the
      paper counts; on a CPU torch keeps the scaled mask in the values' dtype, so
      pass ``dropout_mask_bytes=bytes_per_value`` there (:func:`dropout_mask_bytes`);
    - beyond the paper: each LayerNorm's mean and 1/std (``2·2·sb`` values) and
      the causal mask, ``s²`` bools (built per layer, not divided by tp).

    Sequence parallelism divides by t everything but the causal mask and the inputs
    of q/k/v and fc: dtlab keeps those as the all-gather made them, whole
    (``2·sbh``), where Megatron-LM keeps the local shard and all-gathers it again in
    backward (Korthikanti §4.2.2), a collective traded for ``2·sbh·(1 - 1/t)``.
    Selective recomputation drops the score terms and the mask; full recomputation
    keeps the block's input only (``sbh`` values, divided by t under sequence
    parallelism). With v = 2, f = 4, dropout on and no LayerNorm statistics or
    mask, this is Korthikanti's ``sbh(10 + 24/t + 5as/(ht))``.
    """
    for name, value in (
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("d_model", d_model),
        ("n_heads", n_heads),
        ("tp", tp),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    recompute = one_of("recompute mode", recompute, CHECKPOINTING)
    if cp > 1 and (recompute == "selective" or dropout):
        raise ValueError("dtlab composes cp with full or no recomputation, no dropout")
    s, b, h, a, t, v = seq_len, micro_batch, d_model, n_heads, tp, bytes_per_value
    f = (d_ff or 4 * d_model) / d_model
    sbh, sb = s * b * h / cp, s * b / cp  # this rank's tokens: s/cp of each sequence
    split = t if sequence_parallel else 1  # what the replicated terms are divided by
    if recompute == "full":
        return v * sbh / split
    # LayerNorm inputs (2), q/k/v and fc inputs (2, gathered whole under SP), the
    # tp-split inputs (q, k, v, proj: 4; GELU in and out: 2f), LayerNorm statistics
    linear = v * sbh * (2 / split + 2 + (4 + 2 * f) / t) + v * 2 * 2 * sb / split
    if cp > 1:  # the core on this rank's a/t heads
        if one_of("cp variant", cp_variant, ("ring", "ulysses")) == "ring":
            return linear + v * (sbh / t + a / t * sb)  # output, log-sum-exp
        return linear + v * a / t * s * s * b / cp + s * s  # a/(t·cp) heads, all s
    mb = dropout_mask_bytes
    masks = mb * 2 * sbh / split if dropout else 0.0
    if recompute == "selective":
        return linear + masks
    scores = v * a * s * s * b / t * (2 if dropout else 1)
    scores += mb * a * s * s * b / t if dropout else 0.0  # attention dropout's mask
    return linear + masks + scores + s * s


def dropout_mask_bytes(device, bytes_per_value: int) -> int:
    """Bytes per value of a dropout mask torch saves on ``device``: 1 on CUDA (its
    fused ``native_dropout`` keeps a bool mask), else the values' own size (the
    unfused path multiplies by a scaled mask of the input's dtype and saves it)."""
    kind = device.type if hasattr(device, "type") else str(device).split(":")[0]
    return 1 if kind == "cuda" else bytes_per_value


def dtlab_saved_bytes_outside_layers(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    vocab_size: int,
    *,
    first: bool = True,
    last: bool = True,
    tp: int = 1,
    sequence_parallel: bool = False,
    bytes_per_value: int = 4,
    logits_bytes: int = 4,
) -> float:
    """What :class:`dtlab.model.GPT` saves outside its blocks: on the first stage
    the token ids and positions (int64); on the last the final LayerNorm's input
    and statistics, the head's input, the log-softmax of the cross-entropy
    (``logits_bytes`` a value: 4 where the loss is computed in fp32) and the
    targets (int64). Under tp the vocabulary is split: each rank's log-softmax is
    its ``V/t`` columns, and the vocab-parallel embedding and cross-entropy each
    keep a bool mask of the ids outside the rank's rows (instead of the one scalar
    ``F.cross_entropy`` keeps). Sequence parallelism splits the final LayerNorm's
    input and statistics; it also saves a few hundred bytes less than counted here
    (256 at s = 32, b = 4, t = 2), which is not modelled."""
    s, b, h, v = seq_len, micro_batch, d_model, bytes_per_value
    split = tp if sequence_parallel else 1
    out = 0.0
    if first:
        out += 8 * s * b + 8 * s  # ids (B, T) and positions (T,)
        out += s * b if tp > 1 else 0  # the embedding's out-of-range mask
    if last:
        out += v * s * b * h * (1 + 1 / split) + 2 * v * s * b / split  # ln_f, head
        vocab = -(-vocab_size // tp)  # padded to a multiple of tp, this rank's
        out += logits_bytes * s * b * vocab + 8 * s * b  # log-softmax, targets
        out += s * b if tp > 1 else logits_bytes  # the target mask, or total weight
    return out


def activation_bytes(
    n_layers: int, seq_len: int, micro_batch: int, d_model: int, n_heads: int, **kwargs
) -> float:
    """Activation bytes of ``n_layers`` layers: ``L · s·b·h·(34 + 5as/h)`` for the
    defaults; keyword options as in :func:`activation_bytes_per_layer`."""
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, got {n_layers}")
    return n_layers * activation_bytes_per_layer(
        seq_len, micro_batch, d_model, n_heads, **kwargs
    )

"""Activations: the bytes a transformer layer keeps for the backward pass.

Korthikanti et al. 2022, with tensor and sequence parallelism and selective or
full recomputation.

Taught in chapter 00 (why distribute); chapters 04, 05 and 08 set it next to
measured peaks.
"""

from __future__ import annotations

from dtlab.checks import one_of

# ---- activations ---------------------------------------------------------------------
RECOMPUTE = ("none", "selective", "full")


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
    recompute = one_of("recompute mode", recompute, RECOMPUTE)
    s, b, h, a, t = seq_len, micro_batch, d_model, n_heads, tp
    sbh = s * b * h
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        per_layer = 2 * sbh / (t if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = sbh / t * (34 + scores)
    else:
        per_layer = sbh * (10 + 24 / t + scores / t)
    return per_layer * bytes_per_value / 2


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

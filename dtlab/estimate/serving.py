"""Serving: the weights and the KV cache per device.

Taught in chapter 09 (planning at scale).
"""

from __future__ import annotations

from dtlab.checks import positive_int
from dtlab.estimate.models import model_spec


# ---- serving: weights and the KV cache (chapter 09) ----------------------------------
def kv_cache_bytes(
    model, batch: int, context: int, *, tp: int = 1, bytes_per_value: float = 2
) -> float:
    """Bytes of the key/value cache of ``batch`` sequences of ``context`` tokens:
    ``2 · L · batch · context · h_kv · bytes / tp`` (a key and a value per layer
    and token; grouped-query attention shrinks ``h_kv = h · n_kv_heads/n_heads``;
    tensor parallelism splits the heads)."""
    spec = model_spec(model)
    for name, value in (("batch", batch), ("context", context), ("tp", tp)):
        positive_int(name, value)
    kv = spec.d_model * (spec.n_kv_heads or spec.n_heads) / spec.n_heads
    return 2 * spec.n_layers * batch * context * kv * bytes_per_value / tp


def serving_memory(
    model, *, tp: int = 1, batch: int = 1, context: int | None = None,
    bytes_per_value: float = 2,
) -> dict[str, float]:  # fmt: skip
    """Bytes per device to *serve* ``model`` with tensor parallelism ``tp``: the
    16-bit weights (``2Ψ/tp``; no gradients, no optimizer state) and the KV cache
    (:func:`kv_cache_bytes`). Activations of one decoding step are negligible next
    to these. Returns ``{"weights", "kv_cache", "total"}``."""
    spec = model_spec(model)
    context = context or spec.seq_len
    weights = bytes_per_value * spec.n_params / tp
    kv = kv_cache_bytes(spec, batch, context, tp=tp, bytes_per_value=bytes_per_value)
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}

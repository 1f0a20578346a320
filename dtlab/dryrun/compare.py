"""A dry run's measurements beside :mod:`dtlab.estimate`, difference by difference.

For each rank: the bytes held by category beside :func:`dtlab.estimate.layout_memory`
(dtlab's own counts: ``states="dtlab"``, ``activations="dtlab"``, the rank's
pipeline stage) and the bytes sent per axis beside
:func:`dtlab.estimate.layout_traffic`. Every difference is either zero or carries
the reason it has, checked against the measurement itself:

- **optimizer**: torch's AdamW keeps a step counter (a 4-byte tensor) for every
  tensor it steps; the estimate leaves it out. The difference must equal those
  counters' bytes, read from the optimizer.
- **activations** under 16-bit precision: the meta device's LayerNorm keeps its
  mean and 1/std in fp32, as CUDA does (a CPU rank keeps them in the compute
  dtype, which is what the estimate counts): 2 more bytes for each of the 2
  statistics of each LayerNorm, per token of every microbatch in flight. The
  difference must equal that count.
- **traffic**: the collectives of scalars (the loss broadcast along the pipeline,
  the gradient norm's sums, the mean loss over the replicas, the overflow flag
  over the world) are real bytes the estimate does not model; the difference on an
  axis must equal the scalars' bytes on it.
- **published** (a stand-in for a published model, :func:`dtlab.dryrun.stand_in`):
  the estimate of the published architecture differs by what the stand-in
  changes; the stand-in's own reason says what.

A difference without one of these reasons is reported with ``reason=None``: a
disagreement between dtlab's code and its formulas.
"""

from __future__ import annotations

from dtlab import estimate, measure
from dtlab.dryrun.child import SCALAR_TAGS
from dtlab.estimate.layouts import value_bytes
from dtlab.estimate.pipeline import pipeline_in_flight
from dtlab.events import schedule_name

__all__ = ["compare_memory", "compare_traffic", "STEP_COUNTER"]

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
HOST = ("host_params", "host_grads", "host_optimizer")
AXES = ("dp", "tp", "pp", "cp", "ep", "edp")
LN_STATS = (
    "the meta device keeps LayerNorm's mean and 1/std in fp32 (as CUDA does; a CPU "
    "rank, and the estimate, keep them in the compute dtype)"
)
STEP_COUNTER = "AdamW keeps a 4-byte step counter per tensor it steps"
SCALARS = "collectives of scalars (loss, gradient norm, overflow flag)"


def _close(a: float, b: float) -> bool:
    """Equal to the byte (wire bytes are ``(N-1)/N`` fractions summed in floats:
    their rounding stays far below a byte at 1e12 bytes)."""
    return abs(a - b) < 0.5


def _row(category, measured, predicted, reason=None, **extra) -> dict:
    diff = measured - predicted
    if _close(measured, predicted):
        diff, reason = 0, None
    return {
        "category": category,
        "measured": measured,
        "estimate": predicted,
        "difference": diff,
        "reason": reason,
        **extra,
    }


def compare_memory(config, layout, stage: int, measured: dict, counters: int,
                   published=None, meta: bool = True) -> list[dict]:  # fmt: skip
    """Rows ``{category, measured, estimate, difference, reason[, published,
    published_difference, published_reason]}`` for the bytes this rank holds."""
    est = measure.predicted_memory(config, layout, stage=stage, device="cpu")
    pub = _published_memory(config, layout, stage, published)
    rows = []
    for c in CATEGORIES:
        got, want = measured.get(c, 0), est.get(c, 0.0)
        reason = None
        if c == "optimizer" and _close(got - want, counters):
            reason = f"{STEP_COUNTER} ({counters} bytes); the estimate leaves it out"
        if c == "activations" and meta:
            extra = layernorm_stats_extra(config, layout, stage)
            if extra and _close(got - want, extra):
                reason = f"{LN_STATS}: {extra} bytes"
        rows.append(_row(c, got, want, reason, **_pub(pub, c, got, published)))
    if config.offload:
        got = sum(measured.get(c, 0) for c in HOST)
        rows.append(_row("host", got, est.get("host", 0.0)))
    return rows


def layernorm_stats_extra(config, layout, stage: int) -> int:
    """Bytes the meta device's fp32 LayerNorm statistics add over the estimate's
    count in the compute dtype, on pipeline stage ``stage`` at its peak: every
    block's two LayerNorms for each microbatch in flight (none under full
    recomputation: a block then saves only its input), and the final one on the
    last stage."""
    extra = 4 - value_bytes(config.precision)
    if not extra:
        return 0
    run = estimate.Run.of(config, layout)
    mc = config.model
    tokens = run.micro_batch_size * mc.seq_len // layout.cp
    if config.sequence_parallel:
        tokens //= layout.tp
    layers = mc.n_layers // layout.pp
    last_in_flight = 1
    if layout.pp > 1:
        key = schedule_name(config.schedule)
        v = config.chunks if key == "interleaved" else 1
        in_flight = pipeline_in_flight(layout.pp, stage, run.per_flush, key, v)
        layers = in_flight * layers // v
        last_in_flight = run.per_flush if key == "gpipe" else 1
    per_norm = 2 * extra * tokens  # mean and 1/std
    blocks = 0 if config.activation_checkpointing == "full" else 2 * layers
    final = last_in_flight if stage == layout.pp - 1 else 0
    return per_norm * (blocks + final)


def _published_memory(config, layout, stage, published):
    if published is None:
        return None
    run = estimate.Run.of(config, layout, model=published.preset)
    return run.memory(stage, activations="dtlab")


def _pub(pub, key, got, published) -> dict:
    if pub is None or key not in pub:
        return {}
    want = pub[key]
    same = _close(got, want)
    return {
        "published": want,
        "published_difference": 0 if same else got - want,
        "published_reason": None if same else published.reason,
    }


def measured_axes(traffic: dict) -> dict[str, dict[str, float]]:
    """``{axis: {"wire_bytes", "scalar_bytes", "ops": {op: wire bytes}}}`` from a
    measurement's ``{(axis, op, tag): row}`` (``dp_cp`` is the estimate's dp)."""
    out: dict[str, dict] = {}
    for (axis, op, tag), row in traffic.items():
        name = "dp" if axis == "dp_cp" else axis
        a = out.setdefault(name, {"wire_bytes": 0.0, "scalar_bytes": 0.0, "ops": {}})
        a["wire_bytes"] += row["wire_bytes"]
        if tag in SCALAR_TAGS:
            a["scalar_bytes"] += row["wire_bytes"]
        a["ops"][op] = a["ops"].get(op, 0.0) + row["wire_bytes"]
    return out


def compare_traffic(config, layout, stage: int, traffic: dict,
                    published=None) -> list[dict]:  # fmt: skip
    """Rows ``{category: axis, measured, estimate, difference, reason, ops}``:
    the wire bytes this rank sent in the step, per axis and op."""
    run = estimate.Run.of(config, layout)
    est = run.traffic(stage)
    pub = None
    if published is not None:
        pub = estimate.Run.of(config, layout, model=published.preset).traffic(stage)
    got = measured_axes(traffic)
    rows = []
    for axis in [a for a in AXES if a in got or est.get(a)] + sorted(
        set(got) - set(AXES)
    ):
        m = got.get(axis, {"wire_bytes": 0.0, "scalar_bytes": 0.0, "ops": {}})
        want = est.get(axis, 0.0)
        reason = None
        if m["scalar_bytes"] and _close(m["wire_bytes"] - want, m["scalar_bytes"]):
            reason = f"{SCALARS}: {m['scalar_bytes']:.0f} bytes the estimate leaves out"
        extra = _pub(pub, axis, m["wire_bytes"], published) if pub else {}
        if pub is not None and not extra:
            extra = _pub({axis: 0.0}, axis, m["wire_bytes"], published)
        rows.append(_row(axis, m["wire_bytes"], want, reason, ops=m["ops"], **extra))
    return rows

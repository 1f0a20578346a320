"""Measurement next to prediction: from a run's telemetry events, the bytes each
rank sent per step and held, beside :mod:`dtlab.estimate`'s numbers for the same
config; the summary ``dtlab run`` prints and writes.

Used by ``dtlab run`` (:mod:`dtlab.run`), ``dtlab bench telemetry`` and the lab's
dashboard; taught in chapter 07, where every figure has its estimate beside it.
"""

from __future__ import annotations

import statistics

import torch

from dtlab import estimate
from dtlab.estimate.layouts import value_bytes
from dtlab.events import MEMORY_CATEGORIES, Kind
from dtlab.topology import Layout

__all__ = [
    "predicted_traffic",
    "predicted_memory",
    "measured_traffic",
    "measured_memory",
    "summarize",
    "format_summary",
]


def predicted_traffic(config, layout: Layout) -> dict:
    """Wire bytes one rank sends per optimizer step, by axis
    (:meth:`dtlab.estimate.Run.traffic`), named as the run's telemetry names them
    (the gradients travel on ``dp_cp`` when cp > 1)."""
    out = estimate.Run.of(config, layout).traffic()
    if layout.cp > 1:
        out["dp_cp"] = out.pop("dp")
    return out


def predicted_memory(config, layout: Layout, stage=None, device=None) -> dict:
    """Bytes per rank by category (:meth:`dtlab.estimate.Run.memory`), at pipeline
    stage ``stage`` or, by default, the most loaded one, for ranks on ``device``
    (default: a GPU if this process sees one, else the CPU; with dropout on, the
    masks' size depends on it)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    masks = estimate.dropout_mask_bytes(device, value_bytes(config.precision))
    return estimate.Run.of(config, layout).memory(
        stage, activations="dtlab", dropout_mask_bytes=masks
    )


def measured_traffic(events, steps=None) -> dict[str, float]:
    """Wire bytes the busiest rank sent per step, by axis (what
    :func:`predicted_traffic` predicts), averaged over ``steps``: by default every
    step but the first, the steady state (ZeRO-1/2 all-gather a step's updated
    shards lazily, at the start of the next step's forward, so step 0 sends less
    than the others). Set-up traffic is left out."""
    seen = {e["step"] for e in events if e.get("kind") == Kind.STEP}
    if steps is None:
        steps = seen - {min(seen)} if len(seen) > 1 else seen
    per: dict[tuple[str, int], float] = {}
    for e in events:
        if e.get("kind") == Kind.COMM and e["step"] in steps and e["wire_bytes"]:
            key = (e["axis"], e["rank"])
            per[key] = per.get(key, 0.0) + e["wire_bytes"]
    out: dict[str, float] = {}
    for (axis, _), total in per.items():
        out[axis] = max(out.get(axis, 0.0), total / max(len(steps), 1))
    return out


def measured_memory(events) -> dict[str, int] | None:
    """The most any rank held of each category in any memory sample (what
    :func:`predicted_memory` predicts for the most loaded rank)."""
    samples = [e for e in events if e.get("kind") == Kind.MEMORY]
    if not samples:
        return None
    return {c: max((e.get(c) or 0) for e in samples) for c in MEMORY_CATEGORIES}


def summarize(config, layout: Layout, events) -> dict:
    """The run in numbers: losses (rank 0's records), median step time and
    throughput, bytes per step and memory per rank next to the estimate."""
    records = sorted(
        (e for e in events if e.get("kind") == Kind.STEP and e["rank"] == 0),
        key=lambda e: e["step"],
    )
    times = [r["time_s"] for r in records]
    tokens = config.global_batch_size * config.model.seq_len
    step_s = statistics.median(times) if times else None
    traffic = measured_traffic(events)
    predicted = predicted_traffic(config, layout)
    return {
        "world_size": layout.world_size,
        "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
        "strategy": config.strategy,
        "steps": len(records),
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "step_s_median": step_s,
        "tokens_per_s": tokens / step_s if step_s else None,
        "wire_bytes_per_step": traffic,
        "wire_bytes_per_step_estimate": predicted,
        "memory_bytes_max_over_ranks": measured_memory(events),
        "memory_bytes_estimate": predicted_memory(config, layout),
        "events": {
            k: sum(1 for e in events if e.get("kind") == k)
            for k in ("step", "comm", "span", "memory")
        },
    }


def _mb(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.3f} MB" if x >= 1e4 else f"{x:,.0f} B"


def format_summary(s: dict) -> str:
    lay = s["layout"]
    lines = [
        f"done: {s['steps']} steps on {s['world_size']} ranks "
        f"(dp={lay['dp']} tp={lay['tp']} pp={lay['pp']}, {s['strategy']})",
    ]
    if s["losses"]:
        lines.append(f"  loss {s['losses'][0]:.4f} -> {s['losses'][-1]:.4f}")
    if s["step_s_median"]:
        lines.append(
            f"  step time (median) {s['step_s_median'] * 1e3:.1f} ms, "
            f"{s['tokens_per_s']:,.0f} tokens/s"
        )
    est = s["wire_bytes_per_step_estimate"] or {}
    for axis, b in sorted(s["wire_bytes_per_step"].items()):
        e = est.get(axis)
        pred = f"  estimate {_mb(e)}  ratio {b / e:.3f}" if e else ""
        lines.append(f"  sent per rank per step on {axis:<5} {_mb(b)}{pred}")
    mem, mest = s["memory_bytes_max_over_ranks"], s["memory_bytes_estimate"] or {}
    if mem:
        for c, b in mem.items():
            e = mest.get(c)
            if not b and not e:
                continue
            pred = f"  estimate {_mb(e)}" if e is not None else ""
            lines.append(f"  memory {c:<11} {_mb(b)}{pred}")
    lines.append(
        "  telemetry: " + ", ".join(f"{n} {k} events" for k, n in s["events"].items())
    )
    for f in s.get("files", []):
        lines.append(f"  wrote {f}")
    return "\n".join(lines)

"""``dtlab bench``: every comparison the course makes, in one run, in one table.

Taught in chapter 02 (how to read a benchmark) and quoted by every chapter that
puts dtlab next to PyTorch. Two kinds of row:

- **against PyTorch's own implementation**, same model, same processes, steps
  interleaved or back to back: DDP vs ``torch.nn.parallel.DistributedDataParallel``
  (:mod:`dtlab.bench.ddp`), ZeRO-1 vs ``ZeroRedundancyOptimizer``, ZeRO-3 vs
  FSDP2 ``fully_shard`` and HSDP vs FSDP2 on a 2D mesh (4+ ranks;
  :mod:`dtlab.bench.zero`), tensor parallelism vs DTensor
  (:mod:`dtlab.bench.tensor_parallel`), 1F1B vs ``torch.distributed.pipelining``
  (:mod:`dtlab.bench.pipeline`), and the composition dp2·tp2 with ZeRO-3 vs FSDP2
  over DTensor TP (:mod:`dtlab.bench.composed`). Ratio = dtlab / torch (lower
  is faster).
- **measurement against prediction**: bytes each rank sent per step (telemetry comm
  events) vs :func:`dtlab.estimate.layout_traffic`, bytes held per rank (telemetry
  memory events) vs :func:`dtlab.estimate.layout_memory`, the measured pipeline
  bubble vs ``(p-1)/(m+p-1)``, and the cost of telemetry itself (step time with
  recording on vs off, alternating steps of one run). Ratio = measured / predicted.

A benchmark, not a test: the times depend on the machine and its load; the bytes
and the bubble formula do not. ``--quick`` runs a small version of everything.
"""

from __future__ import annotations

import os
import platform
import sys
import time
import traceback

__all__ = ["PARTS", "collect", "assemble", "format_table", "report"]

PARTS = ("ddp", "zero", "tp", "pp", "2d", "telemetry", "cluster")


def _settings(quick: bool) -> dict:
    """Sizes of each part; ``quick`` is a small run of the same comparisons."""
    if quick:
        return {
            "ddp": dict(world_sizes=(2,), steps=4, warmup=1),
            "zero": dict(world_sizes=(2,), steps=3, warmup=1),
            "tp": dict(world_size=2, d_model=64, n_heads=4, batch=4, seq_len=32,
                       steps=3, warmup=1),
            "pp": dict(p=2, steps=3, bubble_p=None),
            "2d": dict(steps=3, warmup=1, n_layers=2),
            "telemetry": dict(world_size=2, steps=3, overhead_steps=6),
            "cluster": dict(world_size=2, repeats=1, steps=5),
        }  # fmt: skip
    return {
        "ddp": dict(world_sizes=(2, 4), steps=20, warmup=3),
        "zero": dict(world_sizes=(2, 4), steps=10, warmup=3),
        "tp": dict(world_size=2),
        "pp": dict(p=4, steps=5),
        "2d": dict(steps=8, warmup=2),
        "telemetry": dict(world_size=4, steps=4, overhead_steps=20),
        "cluster": dict(world_size=4, repeats=3, steps=20),
    }


# ---- running the parts ---------------------------------------------------------------
def _run_part(part: str, s: dict):
    """One part's raw results (fresh processes each)."""
    from dtlab.bench import (
        cluster,
        composed,
        ddp,
        pipeline,
        telemetry,
        tensor_parallel,
        zero,
    )

    runners = {
        "ddp": ddp.run,
        "zero": zero.run,
        "tp": lambda **s: {"world_size": s.get("world_size", 2),
                           **tensor_parallel.run(**s)},
        "pp": pipeline.run,
        "2d": composed.run,
        "telemetry": telemetry.run,
        "cluster": cluster.run,
    }  # fmt: skip
    if part not in runners:
        raise ValueError(f"unknown part {part!r}: expected some of {PARTS}")
    return runners[part](**s)


def collect(
    quick: bool = False, parts=PARTS, *, steps: int | None = None, echo: bool = True
) -> dict:
    """Run each part (fresh processes each); a part that fails is reported with its
    error, and the others still run. ``steps`` overrides every part's number of
    timed steps. Returns ``{part: result or {"error": ...}}``."""
    settings = _settings(quick)
    if steps is not None:
        settings = {k: {**v, "steps": steps} for k, v in settings.items()}
    results, seconds = {}, {}
    for part in parts:
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}: expected some of {PARTS}")
        if echo:
            print(f"bench {part} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            results[part] = _run_part(part, settings[part])
        except Exception as exc:  # noqa: BLE001 - one broken part must not hide all
            results[part] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        seconds[part] = time.perf_counter() - t0
    return {"quick": quick, "results": results, "seconds": seconds}


# ---- the table -----------------------------------------------------------------------
def _row(section, what, n, dtlab, ref, unit, against, note=""):
    ratio = dtlab / ref if dtlab is not None and ref else None
    return {
        "section": section,
        "what": what,
        "n": n,
        "dtlab": dtlab,
        "reference": ref,
        "unit": unit,
        "against": against,
        "ratio": ratio,
        "note": note,
    }


def _error_row(section, error):
    return _row(section, "(failed)", None, None, None, "", "", error.splitlines()[0])


def assemble(collected: dict) -> list[dict]:
    """Rows of the table from :func:`collect`'s results (a pure function, tested on
    synthetic results). Each row: ``section, what, n, dtlab, reference, unit,
    against, ratio, note``; times in ms, bytes in MB."""
    res = collected["results"]
    rows: list[dict] = []
    if "ddp" in res:
        r = res["ddp"]
        if isinstance(r, dict) and "error" in r:
            rows.append(_error_row("speed", r["error"]))
        else:
            for x in r:
                rows.append(_row(
                    "speed", "DDP step", x["world_size"], x["dtlab_step_s"] * 1e3,
                    x["torch_step_s"] * 1e3, "ms", "torch DDP",
                    f"overlap {x['overlap']:.0%}",
                ))  # fmt: skip
    if "zero" in res:
        r = res["zero"]
        if isinstance(r, dict) and "error" in r:
            rows.append(_error_row("speed", r["error"]))
        else:
            by = {(x["world_size"], x["variant"]): x["step_s"] for x in r}
            pairs = (
                ("ZeRO-1 step", "dtlab stage 1", "torch ZeRO-1",
                 "ZeroRedundancyOptimizer"),
                ("ZeRO-3 step", "dtlab stage 3", "torch FSDP2", "FSDP2 fully_shard"),
                ("HSDP step", "dtlab HSDP", "torch FSDP2 HSDP", "FSDP2 HSDP (2D mesh)"),
            )  # fmt: skip
            for n in sorted({x["world_size"] for x in r}):
                for what, ours, theirs, against in pairs:
                    if (n, ours) in by and (n, theirs) in by:
                        rows.append(_row(
                            "speed", what, n, by[n, ours] * 1e3, by[n, theirs] * 1e3,
                            "ms", against,
                        ))  # fmt: skip
    if "tp" in res:
        r = res["tp"]
        if "error" in r:
            rows.append(_error_row("speed", r["error"]))
        else:
            for block in ("mlp", "attention"):
                x = r[block]
                rows.append(_row(
                    "speed", f"TP {block} fwd+bwd", r.get("world_size"),
                    x["dtlab_s"] * 1e3, x["dtensor_s"] * 1e3, "ms", "DTensor TP",
                    f"max|dy| {x['max_abs_diff']:.1e}",
                ))  # fmt: skip
    if "pp" in res:
        r = res["pp"]
        if "error" in r:
            rows.append(_error_row("speed", r["error"]))
        else:
            p, st = r["p"], r["step_s"]
            if "dtlab 1f1b" in st and "torch 1f1b" in st:
                rows.append(_row(
                    "speed", "PP 1F1B step", p, st["dtlab 1f1b"] * 1e3,
                    st["torch 1f1b"] * 1e3, "ms", "torch pipelining",
                ))  # fmt: skip
            runs = [(p, r["bubble"], "")]
            if "bubble_small" in r:  # a core per stage: where the formula can hold
                small = r["bubble_small"]
                runs.append((small["p"], small["bubble"], "a core per stage"))
            for stages, bubbles, note in runs:
                for m, b in bubbles.items():
                    rows.append(_row(
                        "bubble", f"1F1B bubble p={stages} m={m}", stages,
                        b["measured"], b["formula"], "fraction", "(p-1)/(m+p-1)",
                        note,
                    ))  # fmt: skip
    if "2d" in res:
        r = res["2d"]
        if "error" in r:
            rows.append(_error_row("speed", r["error"]))
        else:
            st = r["step_s"]
            rows.append(_row(
                "speed", "dp2·tp2 ZeRO-3 step", r["world_size"], st["dtlab"] * 1e3,
                st["torch"] * 1e3, "ms", "FSDP2 + DTensor TP",
                f"max rel loss diff {r['max_rel_loss_diff']:.1e}",
            ))  # fmt: skip
    if "telemetry" in res:
        r = res["telemetry"]
        if "error" in r:
            rows.append(_error_row("bytes", r["error"]))
        else:
            rows += _telemetry_rows(r)
    if "cluster" in res:
        r = res["cluster"]
        if "error" in r:
            rows.append(_error_row("lab", r["error"]))
        else:
            rows += _cluster_rows(r)
    return rows


# the goals of issue 17 for the live cluster (seconds)
START_GOAL, STOP_GOAL, LAG_GOAL = 3.0, 1.0, 0.5


def _cluster_rows(r: dict) -> list[dict]:
    """``cluster start`` (start to the first run returning, with its phases),
    ``cluster stop`` and ``dashboard lag`` (median; the max in the note), each
    against its goal."""
    n = r["world_size"]
    phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
    start = _row("lab", "cluster start", n, r["ready_s"], START_GOAL, "s", "goal")
    start["note"] = phases
    stop = _row("lab", "cluster stop", n, r["stop_s"], STOP_GOAL, "s", "goal")
    stop["note"] = "until every process exited"
    rows = [start, stop]
    if r.get("lag_median_s") is not None:
        lag = _row("lab", "dashboard lag", n, r["lag_median_s"], LAG_GOAL, "s", "goal")
        lag["note"] = f"median; max {r['lag_max_s']:.2f} s"
        rows.append(lag)
    return rows


def _telemetry_rows(r: dict) -> list[dict]:
    rows = []
    n = r["world_size"]
    for label, c in r["configs"].items():
        if "error" in c:
            rows.append(_row("bytes", label, n, None, None, "", "", c["error"][:90]))
            continue
        pred = c["bytes_predicted"] or {}
        for axis in sorted(
            set(c["bytes_measured"]) | {a for a, v in pred.items() if v}
        ):
            got = c["bytes_measured"].get(axis, 0.0)
            rows.append(_row(
                "bytes", f"{label}: sent on {axis}/step", n, got / 1e6,
                pred.get(axis, 0.0) / 1e6, "MB", "estimate.layout_traffic",
            ))  # fmt: skip
    for label, c in r["configs"].items():
        if "error" in c:
            continue
        for cat, got in c["memory_measured"].items():
            want = c["memory_predicted"].get(cat)
            if not got and not want:
                continue
            rows.append(_row(
                "memory", f"{label}: {cat}", n, got / 1e6,
                None if want is None else want / 1e6, "MB", "estimate.layout_memory",
            ))  # fmt: skip
    o = r["overhead"]
    rows.append(_row(
        "overhead", "DDP step, telemetry on vs off", n, o["on_s"] * 1e3,
        o["off_s"] * 1e3, "ms", "recording off",
        f"{o['events_per_step']:.0f} events/step to JSONL",
    ))  # fmt: skip
    return rows


def _fmt(x, unit) -> str:
    if x is None:
        return "-"
    if unit == "fraction":
        return f"{x:.3f}"
    if unit == "MB":
        if 0 < abs(x) < 1e-3:
            return f"{x:.1e}"  # a few bytes (a flag all-reduce): not 0.0000
        return f"{x:.4f}" if abs(x) < 10 else f"{x:.1f}"
    return f"{x:.2f}" if abs(x) < 100 else f"{x:.0f}"


def format_table(rows) -> str:
    """One table: every comparison and its ratio (dtlab / reference)."""
    head = ("section", "comparison", "N", "dtlab", "reference", "unit", "ratio",
            "against", "note")  # fmt: skip
    cells = [
        (r["section"], r["what"], "" if r["n"] is None else str(r["n"]),
         _fmt(r["dtlab"], r["unit"]), _fmt(r["reference"], r["unit"]), r["unit"],
         "-" if r["ratio"] is None else f"{r['ratio']:.3f}", r["against"],
         r["note"])
        for r in rows
    ]  # fmt: skip
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(head)]
    right = {2, 3, 4, 6}
    lines = []
    for row in [head, *cells]:
        lines.append(
            "  ".join(
                (c.rjust(w) if i in right else c.ljust(w))
                for i, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if row is head:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(collected: dict) -> dict:
    """What ``--json`` writes: the machine, the settings, the raw results and the
    table's rows."""
    import torch

    return {
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        },
        "quick": collected["quick"],
        "seconds": collected["seconds"],
        "rows": assemble(collected),
        "results": _json_safe(collected["results"]),
    }


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, float | int | str | bool) or x is None:
        return x
    return str(x)

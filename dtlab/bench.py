"""``dtlab bench``: every comparison the course makes, in one run, in one table.

Taught in chapter 02 (how to read a benchmark) and quoted by every chapter that
puts dtlab next to PyTorch. Two kinds of row:

- **against PyTorch's own implementation**, same model, same processes, steps
  interleaved or back to back: DDP vs ``torch.nn.parallel.DistributedDataParallel``
  (:func:`dtlab.train.bench`), ZeRO-1 vs ``ZeroRedundancyOptimizer`` and ZeRO-3 vs
  FSDP2 ``fully_shard`` (:func:`dtlab.zero.bench`), tensor parallelism vs DTensor
  (:func:`dtlab.tensor_parallel.bench`), 1F1B vs ``torch.distributed.pipelining``
  (:func:`dtlab.pipeline.bench`), and the composition dp2·tp2 with ZeRO-3 vs FSDP2
  over DTensor TP (:func:`dtlab.parallelize.bench`). Ratio = dtlab / torch (lower
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

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback

__all__ = ["PARTS", "collect", "assemble", "format_table", "report", "main"]

PARTS = ("ddp", "zero", "tp", "pp", "2d", "telemetry")


def _settings(quick: bool) -> dict:
    """Sizes of each part; ``quick`` is a small run of the same comparisons."""
    if quick:
        return {
            "ddp": dict(world_sizes=(2,), steps=4, warmup=1),
            "zero": dict(world_sizes=(2,), steps=3, warmup=1),
            "tp": dict(world_size=2, d_model=64, n_heads=4, batch=4, seq_len=32,
                       steps=3, warmup=1),
            "pp": dict(p=2, steps=3),
            "2d": dict(steps=3, warmup=1, n_layers=2),
            "telemetry": dict(world_size=2, steps=3, overhead_steps=6),
        }  # fmt: skip
    return {
        "ddp": dict(world_sizes=(2, 4), steps=20, warmup=3),
        "zero": dict(world_sizes=(2, 4), steps=10, warmup=3),
        "tp": dict(world_size=2),
        "pp": dict(p=4, steps=5),
        "2d": dict(steps=8, warmup=2),
        "telemetry": dict(world_size=4, steps=4, overhead_steps=20),
    }


# ---- telemetry part: bytes and memory vs estimate, recorder overhead ----------------
def _telemetry_configs(world_size: int) -> list[tuple[str, object]]:
    """(label, TrainConfig) pairs measured against the estimates: the data-parallel
    flavours over the whole world, then tensor and pipeline layouts."""
    from dtlab.model import GPTConfig
    from dtlab.topology import Layout
    from dtlab.train import TrainConfig

    model = GPTConfig(vocab_size=128, seq_len=32, n_layers=4, n_heads=4, d_model=64)
    base = TrainConfig(model=model, global_batch_size=4 * world_size, bucket_cap_mb=1)
    out = [(s, base.replace(strategy=s)) for s in ("ddp", "zero1", "zero2", "zero3")]
    half = world_size // 2
    out += [
        ("ddp tp=2", base.replace(layout=Layout(dp=half, tp=2))),
        ("ddp pp=2", base.replace(layout=Layout(dp=half, pp=2), microbatches=4)),
    ]
    return out


def _telemetry_rank(labels, steps: int, overhead_steps: int, workdir: str) -> dict:
    """On every rank: train each config under a recorder and return its events
    (rank 0's are enough for traffic; memory is compared per rank too); then time
    one run's steps with recording on and off, alternately."""
    import torch.distributed as dist

    from dtlab import comm, telemetry
    from dtlab.train import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    configs = dict(_telemetry_configs(world))
    out: dict = {"runs": {}, "overhead": {}}
    for label in labels:
        rec = telemetry.Recorder(rank)
        try:
            with telemetry.use(rec):
                rec.step = -1  # set-up traffic (initial broadcasts) is not per step
                trainer = Trainer(configs[label])
                trainer.fit(steps)
        except Exception as exc:  # noqa: BLE001 - reported as the row's note
            out["runs"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            comm.barrier()  # every rank raises at build: nothing is left in flight
            continue
        keep = ("comm", "memory")
        out["runs"][label] = [e for e in rec.events if e["kind"] in keep]
    # overhead: one DDP run, steps alternately recorded (as `dtlab run` records:
    # a JSONL file per rank) and not; the medians of each half
    trainer = Trainer(configs["ddp"])
    trainer.fit(2)  # warm-up
    sink = telemetry.JsonlSink(os.path.join(workdir, "overhead"), rank)
    rec = telemetry.Recorder(rank, [sink])
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * overhead_steps):
        on = i % 2 == 0
        comm.barrier()
        t0 = time.perf_counter()
        if on:
            with telemetry.use(rec):
                trainer.fit(1)
        else:
            trainer.fit(1)
        times["on" if on else "off"].append(time.perf_counter() - t0)
    rec.close()
    out["overhead"] = {k: statistics.median(v) for k, v in times.items()}
    out["overhead"]["events_per_step"] = len(telemetry.read_jsonl(sink.path)) / max(
        overhead_steps, 1
    )
    return out


def bench_telemetry(
    world_size: int = 2, *, steps: int = 3, overhead_steps: int = 10
) -> dict:
    """Measured bytes per step and bytes per rank of each telemetry config next to
    the estimate, and recording overhead; on ``world_size`` fresh processes."""
    from dtlab.launch import spawn
    from dtlab.run import (
        measured_memory,
        measured_traffic,
        predicted_memory,
        predicted_traffic,
    )

    configs = _telemetry_configs(world_size)
    runnable, skipped = [], {}
    for label, cfg in configs:
        try:
            cfg.check(world_size)
            runnable.append(label)
        except (ValueError, NotImplementedError) as exc:
            skipped[label] = f"{type(exc).__name__}: {exc}"
    with tempfile.TemporaryDirectory(prefix="dtlab-bench-") as tmp:
        results = spawn(
            _telemetry_rank, world_size, runnable, steps, overhead_steps, tmp,
            timeout=300,
        )  # fmt: skip
    report = {"world_size": world_size, "steps": steps, "configs": {}}
    for label, cfg in configs:
        if label in skipped:
            report["configs"][label] = {"error": skipped[label]}
            continue
        runs = [r["runs"][label] for r in results]
        if isinstance(runs[0], dict):
            report["configs"][label] = runs[0]
            continue
        events = [e for evs in runs for e in evs]
        # per-step averages over the ranks and the steady-state steps
        steady = set(range(1, steps)) or {0}
        events += [
            {"kind": "step", "rank": r, "step": s}
            for r in range(world_size)
            for s in range(steps)
        ]
        layout = cfg.resolve_layout(world_size)
        mem = measured_memory(events) or {}
        cats = ("params", "grads", "optimizer", "activations")
        report["configs"][label] = {
            "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
            "strategy": cfg.strategy,
            "bytes_measured": measured_traffic(events, steady),
            "bytes_predicted": predicted_traffic(cfg, layout),
            "memory_measured": {c: mem.get(c, 0) for c in cats},
            "memory_predicted": {
                c: v for c, v in predicted_memory(cfg, layout).items() if c in cats
            },
        }
    report["overhead"] = {
        "on_s": max(r["overhead"]["on"] for r in results),
        "off_s": max(r["overhead"]["off"] for r in results),
        "events_per_step": results[0]["overhead"]["events_per_step"],
    }
    return report


# ---- running the parts ---------------------------------------------------------------
def _run_part(part: str, s: dict):
    if part == "ddp":
        from dtlab.train import bench

        return bench("ddp", **s)
    if part == "zero":
        from dtlab.zero import bench

        return bench(**s)
    if part == "tp":
        from dtlab.tensor_parallel import bench

        return {"world_size": s.get("world_size", 2), **bench(**s)}
    if part == "pp":
        from dtlab.pipeline import bench

        return bench(**s)
    if part == "2d":
        from dtlab.parallelize import bench

        return bench(**s)
    if part == "telemetry":
        return bench_telemetry(**s)
    raise ValueError(f"unknown part {part!r}: expected some of {PARTS}")


def collect(quick: bool = False, parts=PARTS, *, echo: bool = True) -> dict:
    """Run each part (fresh processes each); a part that fails is reported with its
    error, and the others still run. Returns ``{part: result or {"error": ...}}``."""
    settings = _settings(quick)
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
            for m, b in r["bubble"].items():
                rows.append(_row(
                    "bubble", f"1F1B bubble m={m}", p, b["measured"], b["formula"],
                    "fraction", "(p-1)/(m+p-1)",
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


def main(argv=None) -> int:
    """``dtlab bench [--quick] [--only P,...] [--json PATH] [--plot PATH.png]``."""
    p = argparse.ArgumentParser(
        prog="dtlab bench",
        description="Every comparison in one run: dtlab against PyTorch's own DDP, "
        "ZeroRedundancyOptimizer, FSDP2, DTensor TP and pipelining, and "
        "measurements against dtlab.estimate; one table. (`dtlab bench "
        "ddp|zero|tp|pp` runs one comparison with its own table.)",
    )
    p.add_argument("--quick", action="store_true", help="a small, fast run")
    p.add_argument(
        "--only", default=",".join(PARTS),
        help=f"comma-separated parts to run (default: all of {','.join(PARTS)})",
    )  # fmt: skip
    p.add_argument("--out", default=".", help="folder for bench.json (default: .)")
    p.add_argument("--json", default=None, help="JSON path (default: OUT/bench.json)")
    p.add_argument("--plot", default=None, help="draw the table into this PNG")
    a = p.parse_args(argv)
    parts = [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        print(f"dtlab bench: unknown part(s) {unknown}: choose from {', '.join(PARTS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if a.plot and not a.plot.endswith(".png"):
        print("dtlab bench: --plot writes a PNG: give a path ending in .png",
              file=sys.stderr)  # fmt: skip
        return 2
    collected = collect(a.quick, parts)
    rep = report(collected)
    print(format_table(rep["rows"]))
    path = a.json or os.path.join(a.out, "bench.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=1)
    print(f"wrote {path}")
    if a.plot:
        from dtlab.lab.benchplot import write_png

        print(f"wrote {write_png(rep['rows'], a.plot)}")
    failed = [k for k, v in collected["results"].items() if "error" in v]
    for k in failed:
        print(f"dtlab bench: part {k} failed:\n{collected['results'][k]['traceback']}",
              file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

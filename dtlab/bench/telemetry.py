"""``dtlab bench telemetry``: bytes each rank sent per step and bytes it held,
measured by telemetry next to :func:`dtlab.estimate.layout_traffic` and
:func:`dtlab.estimate.layout_memory`, and the cost of recording itself."""

from __future__ import annotations

import os
import statistics
import tempfile
import time

__all__ = ["configs", "run"]


def configs(world_size: int) -> list[tuple[str, object]]:
    """(label, TrainConfig) pairs measured against the estimates: the data-parallel
    flavours over the whole world, then tensor, pipeline, context and expert
    parallel layouts."""
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
        ("ddp cp=2 ring", base.replace(layout=Layout(dp=half, cp=2))),
        (
            "ddp cp=2 ulysses",
            base.replace(layout=Layout(dp=half, cp=2), cp_variant="ulysses"),
        ),
    ]
    if world_size >= 2:  # a mixture of experts over ep = 2 (its routing: uniform?)
        moe = GPTConfig(
            vocab_size=128, seq_len=32, n_layers=4, n_heads=4, d_model=64,
            n_experts=4, top_k=2, capacity_factor=None, aux_loss_coef=0.0,
        )  # fmt: skip
        out.append(
            ("ddp ep=2", base.replace(model=moe, layout=Layout(dp=world_size, ep=2)))
        )
    return out


def _on_rank(labels, steps: int, overhead_steps: int, workdir: str) -> dict:
    """On every rank: train each config under a recorder and return its events
    (rank 0's are enough for traffic; memory is compared per rank too); then time
    one run's steps with recording on and off, alternately."""
    import torch.distributed as dist

    from dtlab import comm, telemetry
    from dtlab.train import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    by_label = dict(configs(world))
    out: dict = {"runs": {}, "overhead": {}}
    for label in labels:
        rec = telemetry.Recorder(rank)
        try:
            with telemetry.use(rec):
                rec.step = -1  # set-up traffic (initial broadcasts) is not per step
                trainer = Trainer(by_label[label])
                trainer.fit(steps)
        except Exception as exc:  # noqa: BLE001 - reported as the row's note
            out["runs"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            comm.barrier()  # every rank raises at build: nothing is left in flight
            continue
        keep = ("comm", "memory")
        out["runs"][label] = [e for e in rec.events if e["kind"] in keep]
    # overhead: one DDP run, steps alternately recorded (as `dtlab run` records:
    # a JSONL file per rank) and not; the medians of each half
    trainer = Trainer(by_label["ddp"])
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


def run(world_size: int = 2, *, steps: int = 3, overhead_steps: int = 10) -> dict:
    """Measured bytes per step and bytes per rank of each telemetry config next to
    the estimate, and recording overhead; on ``world_size`` fresh processes."""
    from dtlab.launch import spawn
    from dtlab.run import (
        measured_memory,
        measured_traffic,
        predicted_memory,
        predicted_traffic,
    )

    pairs = configs(world_size)
    runnable, skipped = [], {}
    for label, cfg in pairs:
        try:
            cfg.check(world_size)
            runnable.append(label)
        except (ValueError, NotImplementedError) as exc:
            skipped[label] = f"{type(exc).__name__}: {exc}"
    with tempfile.TemporaryDirectory(prefix="dtlab-bench-") as tmp:
        results = spawn(
            _on_rank, world_size, runnable, steps, overhead_steps, tmp,
            timeout=300,
        )  # fmt: skip
    report = {"world_size": world_size, "steps": steps, "configs": {}}
    for label, cfg in pairs:
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
            "layout": {a: layout.size(a) for a in ("dp", "tp", "pp", "cp", "ep")},
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

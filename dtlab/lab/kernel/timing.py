"""How long the live cluster makes a learner wait:
``python -m dtlab.lab.kernel.timing``.

Taught in chapter 01 (what starting a cluster costs) and read by ``dtlab bench
cluster`` (:mod:`dtlab.bench.cluster` runs this module in a fresh process, as a
kernel starts fresh, and prints its rows).

- **cluster start**: from ``LabCluster(...).start()`` to the first ``run`` that
  returns, split into the phases of
  :attr:`~dtlab.lab.kernel.cluster.LabCluster.start_phases` (controller, engines
  launched and registered, torch imported on every engine,
  the process group); and ``stop()`` until every process has exited;
- **dashboard lag**: a training run streams its telemetry into the chapter-07
  :class:`~dtlab.lab.figures.dashboard.Dashboard`; for each event that carries a
  time on its rank (comm and compute spans: ``t_end``, on the run's shared time
  axis), the lag is the wall-clock time of the first redraw that included it minus
  that time. It includes the rank's publication interval, the trip through
  ipyparallel, the dashboard's throttle and the redraw itself.

Prints one JSON object: ``{"starts": [...], "lag": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from dtlab.events import Kind


def _first_run() -> int:
    return 1


def time_starts(world_size: int, repeats: int) -> list[dict]:
    """``repeats`` cold starts of a ``world_size`` CPU cluster, each stopped."""
    from dtlab.lab.kernel.cluster import LabCluster

    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cluster = LabCluster(world_size, backend="gloo").start()
        cluster.run(_first_run)
        ready = time.perf_counter() - t0
        pids = list(cluster.pids.values())
        t1 = time.perf_counter()
        cluster.stop()
        out.append(
            {
                "world_size": world_size,
                "ready_s": ready,
                "phases": dict(cluster.start_phases),
                "first_run_s": ready - cluster.start_seconds,
                "stop_s": time.perf_counter() - t1,
                "engines": len(pids),
            }
        )
    return out


def time_dashboard_lag(world_size: int, steps: int) -> dict:
    """The lag of every timed event of a ``steps``-step run into the dashboard."""
    from dtlab.lab.figures.dashboard import Dashboard
    from dtlab.lab.kernel.cluster import LabCluster
    from dtlab.lab.kernel.training import start_run
    from dtlab.model import GPTConfig
    from dtlab.train import TrainConfig

    model = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, n_heads=4, d_model=32)
    config = TrainConfig(model=model, steps=steps, global_batch_size=8)
    arrivals: list[float] = []  # per event, in the order the dashboard got them
    with LabCluster(world_size, backend="gloo") as cluster:
        board = Dashboard(config, world_size)

        def on_events(batch):
            epoch = cluster.last_epoch
            for e in batch:
                t = e.get("t_end") if e.get("kind") in (Kind.COMM, Kind.SPAN) else None
                arrivals.append(epoch + t if t is not None else float("nan"))
            board.update(batch)

        run = start_run(cluster, config, on_events=on_events, pace=0.05)
        run.wait(600)
        board.flush()
    draws = [(u["t"], u["received"]) for u in board.updates if u["why"] != "reset"]
    lags = []
    for i, t_event in enumerate(arrivals):
        if t_event != t_event:  # no time on the rank (a step record)
            continue
        drawn = next((t for t, received in draws if received > i), None)
        if drawn is not None:
            lags.append(drawn - t_event)
    return {
        "world_size": world_size,
        "steps": steps,
        "events": len(lags),
        "redraws": len(draws),
        "median_s": statistics.median(lags) if lags else None,
        "max_s": max(lags) if lags else None,
        "p90_s": statistics.quantiles(lags, n=10)[-1] if len(lags) > 10 else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.lab.kernel.timing")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-lag", action="store_true", help="cluster start only")
    a = p.parse_args(argv)
    result = {"starts": time_starts(a.world_size, a.repeats)}
    if not a.no_lag:
        result["lag"] = time_dashboard_lag(a.world_size, a.steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

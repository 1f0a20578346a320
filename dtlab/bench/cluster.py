"""``dtlab bench cluster``: how long a learner waits for the live cluster, and how
late the live dashboard draws what the ranks did.

- **cluster start**: ``LabCluster(4).start()`` until the first ``run`` returns,
  cold (new controller, new engines, torch imported on each, the process group),
  the median of a few starts, with the phases of the median start; and ``stop()``
  until every process it started has exited;
- **dashboard lag**: from an event's time on its rank to the dashboard's redraw
  that shows it, median and max over a training run.

The measurement itself drives the notebook layer, which the core never imports:
it runs as ``python -m dtlab.lab.kernel.timing`` in a fresh process (a fresh kernel,
as a learner's) and hands back JSON, which :func:`run` returns raw.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

__all__ = ["run", "summary"]


def run(
    world_size: int = 4, repeats: int = 3, steps: int = 20, lag: bool = True
) -> dict:
    """Raw results of :mod:`dtlab.lab.kernel.timing` (``starts``: one dict per start;
    ``lag``: the dashboard's lag over a ``steps``-step run), plus their medians
    (:func:`summary`)."""
    options = [f"--world-size={world_size}", f"--repeats={repeats}", f"--steps={steps}"]
    cmd = [sys.executable, "-m", "dtlab.lab.kernel.timing", *options]
    if not lag:
        cmd.append("--no-lag")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(
            f"python -m dtlab.lab.kernel.timing failed ({done.returncode}):\n"
            f"{done.stderr[-3000:]}"
        )
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return {**raw, **summary(raw)}


def summary(raw: dict) -> dict:
    """The start and stop times of the median start (by time to ready), its
    phases, and the lag's median and max."""
    starts = sorted(raw["starts"], key=lambda s: s["ready_s"])
    middle = starts[len(starts) // 2]
    out = {
        "world_size": middle["world_size"],
        "ready_s": middle["ready_s"],
        "ready_all_s": [s["ready_s"] for s in raw["starts"]],
        "stop_s": statistics.median(s["stop_s"] for s in raw["starts"]),
        "phases": middle["phases"],
        "first_run_s": middle["first_run_s"],
    }
    lag = raw.get("lag")
    if lag:
        out["lag_median_s"], out["lag_max_s"] = lag["median_s"], lag["max_s"]
    return out

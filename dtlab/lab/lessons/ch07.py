"""Chapter 07's lesson helpers (``notebooks/07_3d_parallelism.ipynb``): every layout
of four ranks held against :mod:`dtlab.estimate`, and the two lines a launcher would
have done for HF accelerate on the lab's engines.

:func:`predicted_for` prices one run's config with ``est.layout_memory`` (stage 0,
the most loaded) and ``est.layout_traffic`` (bytes one rank sends per step on each
axis, averaged over the pipeline stages: the first and last send one way only).
:func:`layouts_vs_estimate` prints, per layout, rank 0's model states and the bytes
per axis beside those predictions and returns the pairs, so the chapter can compare
them with the learner's predictions and the suite can bound them.

:func:`as_if_launched` exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and the
rest) from the process group the engines already share, which is what ``torchrun``
or ``accelerate launch`` would have set; :func:`step_batches` is the job's global
batches, one per step, as a dataset a ``DataLoader`` of ``batch_size =
global_batch_size`` hands back in step order.
"""

from __future__ import annotations

import os

import torch

from dtlab import estimate as est
from dtlab.lab.predictions import Question

__all__ = [
    "QUESTIONS",
    "predicted_for",
    "layouts_vs_estimate",
    "as_if_launched",
    "step_batches",
]

QUESTIONS = [
    Question(
        "layout_tp_bytes_dp2tp2",
        "07",
        "bytes one rank sends per step on the tp axis under dp2·tp2 (the chapter's "
        "GPT, 8 sequences a step, fp32)",
        "kB",
    ),
    Question(
        "layout_dp_bytes_dp2tp2",
        "07",
        "bytes one rank sends per step on the dp axis under dp2·tp2 (the chapter's "
        "GPT, fp32 gradients)",
        "kB",
    ),
    Question(
        "layout_states_tp2pp2",
        "07",
        "bytes of model states (weights, gradients, AdamW) rank 0 holds under "
        "dp1·tp2·pp2 (fp32)",
        "kB",
    ),
]

AXES = ("dp", "tp", "pp")
STATES = ("params", "grads", "optimizer")


def predicted_for(config, model, n: int, zero_stage: int = 0):
    """``(memory, traffic)`` that :mod:`dtlab.estimate` predicts for ``config`` on
    ``n`` ranks: stage 0's ``layout_memory`` and the bytes one rank sends per step on
    each axis, averaged over the stages (each stage has dp·tp ranks)."""
    layout = config.resolve_layout(n)
    m = config.resolve_microbatches(layout) if layout.pp > 1 else 1
    kw = dict(
        micro_batch_size=config.global_batch_size // (layout.dp * m),
        microbatches=m,
        zero_stage=zero_stage,
    )
    stage0 = est.layout_memory(model, layout, stage=0, **kw)
    per_stage = [
        est.layout_traffic(model, layout, stage=s, **kw) for s in range(layout.pp)
    ]
    traffic = {a: sum(t[a] for t in per_stage) / layout.pp for a in AXES}
    return stage0, traffic


def layouts_vs_estimate(runs: dict, rows: list, model, n: int) -> dict:
    """Print each run's rank-0 model states and bytes per step on each axis (from
    ``compare_table``'s ``rows``) beside :func:`predicted_for`; return
    ``{layout name: {"states": (measured, predicted), "dp": (...), "tp": (...),
    "pp": (...)}}`` in bytes."""
    header = "".join(f"{a + ' kB/step':>13}{'(est.)':>9}" for a in AXES)
    print(f"{'layout':<14}{'states kB':>10}{'(est.)':>9}   " + header)
    found = {}
    for row, (name, run) in zip(rows, runs.items()):
        memory, traffic = predicted_for(run.config, model, n)
        rank0 = [e for e in run.events if e["kind"] == "memory" and e["rank"] == 0][-1]
        pair = {
            "states": (sum(rank0[k] for k in STATES), sum(memory[k] for k in STATES))
        }
        for axis in AXES:
            pair[axis] = (row["bytes_per_step"][axis], traffic[axis])
        found[name] = pair
        got, want = pair["states"]
        line = f"{name:<14}{got / 1e3:>10.1f}{want / 1e3:>9.1f}   "
        for axis in AXES:
            got, want = pair[axis]
            line += f"{got / 1e3:>13.1f}{want / 1e3:>9.1f}"
        print(line)
    return found


def as_if_launched() -> None:
    """Set the variables a launcher (``torchrun``, ``accelerate launch``) gives each
    process, from the process group the engines already share; nothing connects to
    ``MASTER_PORT`` since the group exists. One thread per rank, as the engines run."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def step_batches(config) -> torch.utils.data.TensorDataset:
    """The job's global batches in step order, ``(steps·B, T)`` inputs and targets:
    the sequences dtlab's trainer draws (:func:`dtlab.frameworks.job.build_data`)."""
    from dtlab.frameworks.job import build_data

    data = build_data(config)
    xs, ys = zip(
        *(data.batch(s, config.global_batch_size) for s in range(config.steps))
    )
    return torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))

"""Chapter 03's lesson helpers (``notebooks/03_zero.ipynb``): the real frameworks'
runs beside dtlab's ZeRO as one table, and DeepSpeed's memory estimators beside
dtlab's.

:func:`comparison_table` lines up runs of the same job (each a dict with
``losses``, ``memory`` and per-step ``traffic``, as :mod:`dtlab.frameworks`
returns them): the last loss and the largest relative gap to a baseline run, the
model-state bytes the rank holds, and the bytes each collective carried in one
step, counted by :mod:`dtlab.frameworks.traffic` for all of them alike.
:func:`estimates_table` prints :func:`dtlab.frameworks.deepspeed_run.estimates`.
"""

from __future__ import annotations

from dtlab.estimate import GB

__all__ = ["OPS", "max_gap", "comparison_table", "estimates_table"]

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def max_gap(losses, baseline) -> float:
    """The largest relative difference between two loss curves."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, baseline))


def _payload(run: dict, step: int, op: str) -> int:
    return int(run["traffic"][step].get(op, {}).get("payload_bytes", 0))


def comparison_table(runs: dict[str, dict], baseline: str, step: int = 1) -> str:
    """One line per run: last loss, gap to ``runs[baseline]``, bytes held (params,
    grads, optimizer; ``-`` where a framework frees them before it can be asked),
    and the payload bytes of each collective in ``step``."""
    base = runs[baseline]["losses"]
    head = (
        f"{'run':<26}{'last loss':>11}{'gap':>9}{'params':>9}{'grads':>9}"
        f"{'optim':>9}" + "".join(f"{op.replace('_', '-'):>15}" for op in OPS)
    )
    lines = [head, f"{'':<55}bytes held{'':>13}payload bytes in step {step}"]
    for name, run in runs.items():
        mem = run["memory"]
        held = "".join(
            f"{mem[k]:>9,}" if k in mem else f"{'-':>9}"
            for k in ("params", "grads", "optimizer")
        )
        sent = "".join(f"{_payload(run, step, op):>15,}" for op in OPS)
        lines.append(
            f"{name:<26}{run['losses'][-1]:>11.7f}"
            f"{max_gap(run['losses'], base):>9.1e}{held}{sent}"
        )
    return "\n".join(lines)


def estimates_table(found: dict) -> str:
    """DeepSpeed's estimate of model-state GB per GPU (and per node on the host)
    beside dtlab's and the ZeRO paper's, for one model of
    :func:`~dtlab.frameworks.deepspeed_run.estimates`."""
    lines = [
        f"{found['model']}: {found['params'] / 1e9:.2f}B parameters on "
        f"{found['gpus']} GPUs (largest layer {found['largest_layer'] / 1e6:.0f}M)",
        f"{'':<18}{'GPU, DeepSpeed':>15}{'dtlab':>8}{'paper':>8}"
        f"{'host/node, DS':>15}{'dtlab':>8}",
    ]
    for row in found["rows"]:
        name = f"ZeRO-{row['stage']}" + (" + offload" if row["offload"] else "")
        paper = "-" if row["paper_gpu"] is None else f"{row['paper_gpu'] / GB:.1f}"
        lines.append(
            f"{name:<18}{row['deepspeed_gpu'] / GB:>15.1f}{row['dtlab_gpu'] / GB:>8.1f}"
            f"{paper:>8}{row['deepspeed_host_per_node'] / GB:>15.1f}"
            f"{row['dtlab_host_per_node'] / GB:>8.1f}"
        )
    return "\n".join(lines)

"""Chapter 02's lesson helpers (``notebooks/02_data_parallel.ipynb``): the gradient
noise scale from what data-parallel ranks measure, and what each launcher tells its
processes, side by side.

:func:`noise_scale` is McCandlish et al. 2018 ("An Empirical Model of Large-Batch
Training", Appendix A): with the squared norm of a batch-``B/N`` gradient (one rank's,
averaged over the ranks) and of a batch-``B`` gradient (the all-reduced one), ::

    |G|²   ≈ (B·|g_B|² − (B/N)·|g_{B/N}|²) / (B − B/N)
    tr Σ   ≈ (|g_{B/N}|² − |g_B|²) / (N/B − 1/B)
    B_noise = tr Σ / |G|²

each estimate unbiased, their ratio taken of means (the paper averages numerator and
denominator separately, since each is noisy).
"""

from __future__ import annotations

import statistics

from dtlab.frameworks.job import LAUNCH_ENV

__all__ = ["noise_scale", "launcher_table"]


def noise_scale(rows: list[dict], n: int) -> float:
    """The gradient noise scale ``tr Σ / |G|²`` from ``rows`` of ``{"B", "local_sq",
    "global_sq"}`` (the global batch, the ranks' mean squared norm of their own
    gradient, the squared norm of the averaged gradient), ``n`` ranks."""
    traces, signals = [], []
    for batch in sorted({row["B"] for row in rows}):
        mine = [row for row in rows if row["B"] == batch]
        small = statistics.mean(row["local_sq"] for row in mine)  # |g_{B/N}|²
        big = statistics.mean(row["global_sq"] for row in mine)  # |g_B|²
        b_small, b_big = batch / n, batch
        signals.append((b_big * big - b_small * small) / (b_big - b_small))
        traces.append((small - big) / (1 / b_small - 1 / b_big))
    return statistics.mean(traces) / statistics.mean(signals)


def _cell(value, width: int = 12) -> str:
    text = "—" if value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def launcher_table(launched: dict[str, list[dict]], engines: list[dict]) -> str:
    """What each process found: ``launched`` maps a launcher's name to its ranks'
    records (:func:`dtlab.frameworks.torch_ddp.launch`), ``engines`` is the lab
    engines' :func:`~dtlab.frameworks.job.launch_env`, rank 0 and 1 shown."""
    columns = [
        (f"{name} r{r['rank']}", r)
        for name, records in launched.items()
        for r in records
    ]
    columns += [(f"engine r{i}", {"env": env}) for i, env in enumerate(engines[:2])]
    rows = [(key, [c[1]["env"].get(key) for c in columns]) for key in LAUNCH_ENV]
    rows.append(("start method", [c[1].get("start_method") for c in columns]))
    rows.append(("pid / parent", [_pids(c[1]) for c in columns]))
    head = f"{'':<20}" + "".join(f"{name:>13}" for name, _ in columns)
    lines = [head]
    for key, values in rows:
        lines.append(f"{key:<20}" + "".join(f"{_cell(v):>13}" for v in values))
    return "\n".join(lines)


def _pids(record: dict) -> str | None:
    if "pid" not in record:
        return None
    return f"{record['pid']}/{record['ppid']}"

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
denominator separately, since each is noisy). :func:`gradient_noise` is the probe
that measures those norms on the engines with dtlab's DDP, :func:`noise_table`
prints what it found beside the noise scale's predictions.

The rest are the chapter's measurements, kept out of the learner's cells:
:func:`gradients_are_bucket_views` (on every rank, after one backward: does every
``.grad`` share its bucket's storage?), :func:`first_launch_inside_backward` (did a
step's first bucket leave before its backward ended?), :func:`bucket_sweep` (a few
steps at each bucket cap, measured beside ``est.ddp_bucket_assignment`` and
``est.ddp_overlap`` with α and bandwidth fitted to all-reduces timed on the
cluster), :func:`bucket_size_explorer` (the sweep's timelines behind a slider) and
:func:`accumulation_counts` (backward passes, all-reduces and buckets per step of
an accumulating run).
"""

from __future__ import annotations

import statistics

from dtlab import telemetry
from dtlab.frameworks.job import LAUNCH_ENV
from dtlab.lab.predictions import Question

__all__ = [
    "QUESTIONS",
    "noise_scale",
    "gradient_noise",
    "noise_table",
    "launcher_table",
    "pair_table",
    "gradients_are_bucket_views",
    "first_launch_inside_backward",
    "time_all_reduce",
    "bucket_sweep",
    "bucket_size_explorer",
    "accumulation_counts",
]

QUESTIONS = [
    Question(
        "ddp_step_bytes_per_rank",
        "02",
        "bytes each rank sends in one DDP step of the chapter's GPT on 4 ranks "
        "(fp32 gradients, ring all-reduce)",
        "kB",
    ),
    Question(
        "ddp_hidden_one_bucket",
        "02",
        "share of the gradient all-reduce time hidden behind backward when every "
        "gradient goes in one 25 MiB bucket",
        "%",
    ),
]


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


def pair_table(theirs: dict, ours: dict, step: int = 1) -> str:
    """PyTorch's DDP beside dtlab's on one job: the losses of every step, the model
    state rank 0 holds and the bytes all-reduced in ``step`` (after torch's bucket
    rebuild), each run's dict holding ``losses``, ``memory`` and per-step
    ``traffic``."""
    lines = [f"{'step':>9} {'torch DDP':>12} {'dtlab DDP':>12}"]
    for s, (a, b) in enumerate(zip(theirs["losses"], ours["losses"])):
        lines.append(f"{s:>9} {a:>12.7f} {b:>12.7f}")
    lines.append(f"{'bytes':>9} {'torch DDP':>12} {'dtlab DDP':>12}   (rank 0)")
    for key in ("params", "grads", "optimizer"):
        lines.append(
            f"{key:>9} {theirs['memory'][key]:>12,} {ours['memory'][key]:>12,}"
        )
    reduced = [
        run["traffic"][step]["all_reduce"]["payload_bytes"] for run in (theirs, ours)
    ]
    lines.append(f"{'reduced':>9} {reduced[0]:>12,} {reduced[1]:>12,}   (per step)")
    return "\n".join(lines)


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


# ---- the chapter's measurements ----------------------------------------------------
def gradients_are_bucket_views(cfg, cap_mb: float, global_batch: int = 16) -> dict:
    """On this rank: one backward of dtlab's DDP on its slice; whether every
    ``.grad`` shares its storage with its bucket, the buckets' bytes and count."""
    import torch.distributed as dist

    from dtlab.ddp import DistributedDataParallel
    from dtlab.model import GPT, SyntheticTokens, shard_batch

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(GPT(cfg), bucket_cap_mb=cap_mb)
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len)
    x, y = shard_batch(*data.batch(0, global_batch), r, n)  # (B/N, T)
    ddp(x, y)[1].backward()

    def storage(t):
        return t.untyped_storage().data_ptr()

    grads = {storage(p.grad) for p in ddp.parameters()}
    buffers = {storage(b.buffer) for b in ddp.buckets}
    return {
        "views": all(
            storage(p.grad) == storage(b.buffer) for b in ddp.buckets for p in b.params
        ),
        "storages": grads == buffers,
        "bucket_bytes": sum(b.nbytes for b in ddp.buckets),
        "buckets": len(ddp.buckets),
    }


def first_launch_inside_backward(events: list[dict], rank: int, step: int) -> bool:
    """Whether ``rank``'s first bucket of ``step`` was launched before that step's
    backward span (``B``) ended."""
    b_end = next(
        e["t_end"]
        for e in events
        if e["kind"] == "span"
        and e["name"] == "B"
        and e["rank"] == rank
        and e["step"] == step
    )
    first = min(
        e["t_start"]
        for e in events
        if e["kind"] == "ddp_bucket" and e["rank"] == rank and e["step"] == step
    )
    return first < b_end


def time_all_reduce(numels: list[int], repeats: int = 5) -> list[float]:
    """On every rank: the median seconds of a ``dtlab.comm`` all-reduce of each
    size (fp32 elements), each timed after a barrier."""
    import time

    import torch

    from dtlab import comm

    out = []
    for numel in numels:
        buf, times = torch.ones(numel), []
        for _ in range(repeats):
            comm.barrier()
            t = time.perf_counter()
            comm.all_reduce(buf)
            times.append(time.perf_counter() - t)
        out.append(statistics.median(times))
    return out


def bucket_sweep(cluster, config, caps, steps: int = 6, skip: int = 2):
    """Train ``steps`` steps at each bucket cap (MiB) and measure, per cap, the
    all-reduces per step and the exposed communication (the wait after backward,
    median over the steps after ``skip`` warm-up ones), beside the predictions of
    ``est.ddp_bucket_assignment`` (PyTorch's rule) and ``est.ddp_overlap`` with
    α and bandwidth fitted to all-reduces timed on ``cluster``. Returns
    ``(fit, runs by cap, rows)``; each row also holds the hidden share of the
    communication, measured and modelled."""
    from dtlab import estimate as est
    from dtlab.ddp import MB
    from dtlab.lab.kernel.training import train_on_cluster
    from dtlab.model import GPT

    n = cluster.world_size
    numels = [256, 4096, 32768, 131072]
    times = cluster.run(time_all_reduce, numels, timeout=120)[0]
    fit = est.fit_alpha_beta(
        [est.wire_bytes("all_reduce", 4 * k, n) for k in numels], times
    )
    alpha_step = max(fit.alpha_s, 0.0) / est.latency_steps("all_reduce", n)
    sizes = [p.numel() * 4 for p in GPT(config.model).parameters()][::-1]
    runs, rows = {}, []
    for cap in caps:
        runs[cap] = train_on_cluster(
            cluster,
            config.replace(steps=steps, bucket_cap_mb=cap),
            live=False,
            timeout=120,
        )
        recs = [r for recs in runs[cap].records for r in recs[skip:]]
        groups = est.ddp_bucket_assignment(sizes, cap * MB)
        model = est.ddp_overlap(
            [sum(sizes[i] for i in g) for g in groups],
            n,
            backward_s=statistics.median(r["backward_s"] for r in recs),
            alpha_s=alpha_step,
            bandwidth_Bps=fit.bandwidth_Bps,
        )
        rows.append(
            {
                "bucket_cap_mb": cap,
                "buckets": recs[0]["buckets"],
                "predicted_buckets": len(groups),
                "exposed_s": statistics.median(r["exposed_comm_s"] for r in recs),
                "predicted_exposed_s": model["exposed_s"],
                "hidden": statistics.median(r["overlap"] for r in recs),
                "predicted_hidden": model["overlap"],
                "wire_bytes": recs[0]["wire_bytes"],
            }
        )
    return fit, runs, rows


def bucket_size_explorer(runs: dict, rows: list[dict], value: float):
    """A slider over the sweep's caps: one step's timeline at the chosen cap, with
    its all-reduce count and exposed communication beside their predictions."""
    import ipywidgets as W
    import plotly.graph_objects as go

    from dtlab.lab.figures.data_parallel import ddp_overlap_figure

    slider = W.SelectionSlider(
        options=list(runs), value=value, description="bucket MiB"
    )
    info = W.HTML()
    timeline = go.FigureWidget(ddp_overlap_figure(runs[value].events))

    def show_cap(change=None):
        cap = slider.value
        new = ddp_overlap_figure(runs[cap].events)
        with timeline.batch_update():
            timeline.data = ()
            timeline.add_traces(list(new.data))
            timeline.layout.update(new.layout.to_plotly_json())
        row = next(r for r in rows if r["bucket_cap_mb"] == cap)
        info.value = (
            f"<b>{row['buckets']}</b> all-reduces per step "
            f"(predicted {row['predicted_buckets']}), exposed communication "
            f"{row['exposed_s'] * 1e3:.2f} ms "
            f"(predicted {row['predicted_exposed_s'] * 1e3:.2f} ms)"
        )

    slider.observe(show_cap, names="value")
    show_cap()
    return W.VBox([slider, info, timeline])


def accumulation_counts(run, n: int, steps: int) -> set[tuple[int, int, int]]:
    """``{(backward passes, ddp all-reduces, buckets)}`` over every rank and step
    of an accumulating ``run``: one tuple when every step did the same."""
    calls = telemetry.comm_events(run.events, tag="ddp")
    counts = set()
    for r in range(n):
        for s in range(steps):
            backs = sum(
                1
                for e in run.events
                if e["kind"] == "span"
                and e["name"] == "B"
                and e["rank"] == r
                and e["step"] == s
            )
            reduced = sum(1 for e in calls if e["rank"] == r and e["step"] == s)
            counts.add((backs, reduced, run.records[r][s]["buckets"]))
    return counts


# ---- the gradient noise scale --------------------------------------------------------
def gradient_noise(cfg, batch_sizes, draws: int, reference_batch: int, train_steps):
    """On every rank, with dtlab's DDP on ``cfg``'s GPT: train ``train_steps``
    AdamW steps (batch 16), then for each global batch size ``draws`` batches,
    each rank's own gradient (under ``no_sync``) and the all-reduced one. Returns
    ``{"rows", "G_sq"}``: per draw the ranks' mean ``|g_{B/N}|²``, ``|g_B|²``, the
    squared error against a ``reference_batch`` gradient G and the cosine to it."""
    import torch
    import torch.distributed as dist

    from dtlab.ddp import DistributedDataParallel
    from dtlab.model import GPT, SyntheticTokens, shard_batch

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(GPT(cfg))
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    for step in range(train_steps):  # some training first (batch 16)
        x, y = shard_batch(*data.batch(50_000 + step, 16), r, n)
        opt.zero_grad(set_to_none=True)
        ddp(x, y)[1].backward()
        opt.step()

    def gradients(step, batch):  # (this rank's B/N, the all-reduced B)
        x, y = shard_batch(*data.batch(step, batch), r, n)
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            ddp(x, y)[1].backward()
        mine = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]).clone()
        ddp.finish_gradient_synchronization()  # DDP's all-reduce: the mean of N
        return mine, torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])

    _, G = gradients(10_000, reference_batch)  # (Ψ,) the "true" gradient
    rows = []
    for batch in batch_sizes:
        for d in range(draws):
            mine, g = gradients(1000 * batch + d, batch)
            local_sq = torch.tensor([mine.square().sum().item()])
            dist.all_reduce(local_sq)  # the ranks' |g_{B/N}|², averaged below
            rows.append(
                {
                    "B": batch,
                    "local_sq": local_sq.item() / n,
                    "global_sq": g.square().sum().item(),
                    "error_sq": (g - G).square().sum().item(),
                    "cos": torch.nn.functional.cosine_similarity(g, G, dim=0).item(),
                }
            )
    return {"rows": rows, "G_sq": G.square().sum().item()}


def noise_table(found: dict, batch_sizes, n: int) -> dict[int, float]:
    """Print, per batch size, the measured noise/signal ``E|g_B − G|²/|G|²`` and the
    cosine to G beside what the noise scale predicts (``B_noise/B`` and
    ``1/sqrt(1 + B_noise/B)``); return the measured noise/signal by batch size."""
    b_noise = noise_scale(found["rows"], n)
    print(
        f"{'B':>5} {'noise/signal':>13} {'(pred)':>7} {'cos(g, G)':>10} {'(pred)':>7}"
    )
    measured = {}
    for batch in batch_sizes:
        mine = [row for row in found["rows"] if row["B"] == batch]
        measured[batch] = (
            statistics.mean(row["error_sq"] for row in mine) / found["G_sq"]
        )
        cos = statistics.mean(row["cos"] for row in mine)
        print(
            f"{batch:>5} {measured[batch]:>13.2f} {b_noise / batch:>7.2f} {cos:>10.2f} "
            f"{(1 + b_noise / batch) ** -0.5:>7.2f}"
        )
    return measured

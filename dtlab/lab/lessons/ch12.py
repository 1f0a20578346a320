"""Chapter 12's lesson helpers (``notebooks/12_frontier.ipynb``): the numbers the
chapter asks the learner to predict (``QUESTIONS``) and the runs and tables behind
its three sections, kept out of the learner's cells.

- FP8 (:mod:`dtlab.fp8`): :func:`scaling_steps` casts a sequence of tensors under
  delayed and under current scaling and says what each cast lost;
  :func:`loss_curve_figure` draws :func:`dtlab.fp8.loss_curves`;
  :func:`fp8_weight_gather` (run on every rank) all-gathers every FP8 Linear weight
  of a GPT in FP8, bf16 and fp32, as FSDP would before a layer's forward.
- Zero-bubble pipelines (:mod:`dtlab.pipeline`): :func:`schedule_rows` and
  :func:`schedules_figure` simulate 1F1B, ZB-H1, ZB-V and DualPipeV beside
  :mod:`dtlab.estimate`'s formulas; :func:`torch_v_step` (run on every rank) runs
  one step of dtlab's V schedules and of ``torch.distributed.pipelining``'s on the
  same two chunks; :func:`peak_in_flight` reads a run's activations held.
- Sharded Muon (:mod:`dtlab.muon`): :func:`muon_steps` (run on every rank) trains
  with :class:`dtlab.muon.ShardedMuon` in either design; :func:`muon_reference` is
  the same steps in one process with ``torch.optim.Muon``.

The figures and tables run in the notebook's kernel; the functions marked "run on
every rank" are shipped to the engines by ``cluster.run``.
"""

from __future__ import annotations

import functools

import torch

from dtlab import estimate, pipeline
from dtlab.events import Kind
from dtlab.fp8 import CurrentScaling, DelayedScaling, saturated_fraction
from dtlab.fp8.formats import dequantize
from dtlab.lab.predictions import Question
from dtlab.model import GPT, GPTConfig, SyntheticTokens

__all__ = [
    "QUESTIONS",
    "SCHEDULES",
    "scaling_steps",
    "print_rows",
    "loss_curve_figure",
    "fp8_weight_gather",
    "schedule_rows",
    "schedules_figure",
    "peak_in_flight",
    "torch_v_step",
    "MUON_OPTIONS",
    "ADAMW_OPTIONS",
    "muon_steps",
    "muon_reference",
]

QUESTIONS = [
    Question(
        "fp8_all_gather_bytes",
        "12",
        "bytes one of 2 ranks sends to all-gather every FP8 Linear weight of the "
        "chapter's GPT once (98,304 parameters, each weight cut by rows)",
        "kB",
    ),
    Question(
        "zb_v_bubble",
        "12",
        "the bubble (idle share of the step) of ZB-V at p=2, m=4 when a chunk's "
        "F, B and W take equal times",
        "%",
    ),
    Question(
        "muon_naive_bytes",
        "12",
        "bytes one of 2 ranks sends in one step of the naive sharded Muon on the "
        "chapter's GPT (12 matrices, 24,576 elements; fp32 gradients and "
        "parameters, a bfloat16 Newton-Schulz input)",
        "kB",
    ),
]


def print_rows(rows, columns) -> None:
    """Print ``rows`` (dicts) as a table: ``columns`` is ``[(key, header, format)]``."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    print("  ".join(f"{h:>{w}}" for (_, h, _), w in zip(columns, widths)))
    for row in rows:
        cells = [format(row[k], f) for k, _, f in columns]
        print("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))


# ---- 1. FP8 --------------------------------------------------------------------------
def scaling_steps(amaxes, history_len: int = 4, fmt: str = "e4m3") -> list[dict]:
    """One tensor per entry of ``amaxes`` (4096 normal samples rescaled to that
    largest magnitude), cast in turn by one :class:`dtlab.fp8.DelayedScaling` and
    one :class:`dtlab.fp8.CurrentScaling`. Per step: the scale each used, the share
    of elements it clipped to ±max, and the relative error of the round trip
    (``‖dequantize(q) − x‖ / ‖x‖``)."""
    gen = torch.Generator().manual_seed(0)
    delayed, current = DelayedScaling(fmt, history_len), CurrentScaling(fmt)
    rows = []
    for step, a in enumerate(amaxes):
        x = torch.randn(4096, generator=gen)
        x = x / x.abs().max() * a  # amax exactly a
        row = {"step": step, "amax": a}
        for name, scaler in (("delayed", delayed), ("current", current)):
            q, scale = scaler.quantize(x)
            error = (dequantize(q, scale) - x).norm() / x.norm()
            row[f"{name}_scale"] = float(scale)
            row[f"{name}_clipped"] = saturated_fraction(x, fmt, scale)
            row[f"{name}_error"] = float(error)
        rows.append(row)
    return rows


def loss_curve_figure(curves: dict):
    """The loss per step of each precision in ``curves``
    (:func:`dtlab.fp8.loss_curves`), with the last five steps' mean in the legend."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, losses in curves.items():
        tail = sum(losses[-5:]) / 5
        fig.add_scatter(
            x=list(range(len(losses))),
            y=losses,
            mode="lines",
            name=f"{name} (last 5 steps: {tail:.4f})",
        )
    fig.update_layout(
        height=360,
        title="The same GPT, batches and AdamW; only the matmuls' rounding differs",
        xaxis_title="step",
        yaxis_title="loss",
    )
    return fig


def fp8_weight_gather(config: GPTConfig) -> dict:
    """Run on every rank: the weights :func:`dtlab.fp8.convert_to_float8` would
    cast (every Linear of ``GPT(config)`` but the head), each cut by rows into one
    shard per rank as FSDP2 shards it, then all-gathered three ways through
    :mod:`dtlab.comm`: in FP8 (a shared scale from one MAX all-reduce of the
    shards' amaxes, :func:`dtlab.fp8.sharded_scale`, then
    :func:`dtlab.fp8.all_gather_fp8`), in bf16 and in fp32. Returns the parameters
    gathered and whether every gathered FP8 weight equals the whole weight cast in
    one process, bit for bit."""
    import torch.distributed as dist

    from dtlab import comm
    from dtlab.fp8 import (
        Float8Linear,
        all_gather_fp8,
        convert_to_float8,
        quantize,
        sharded_scale,
    )

    r, n = dist.get_rank(), dist.get_world_size()
    model = convert_to_float8(GPT(config))
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    exact = True
    for w in weights:
        shard = w.detach().chunk(n)[r]  # (out/n, in): this rank's rows
        scale = sharded_scale(shard, "e4m3", tag="fp8-amax")
        q, _ = quantize(shard, "e4m3", scale)
        gathered = all_gather_fp8(q, tag="fp8 all-gather")
        whole, _ = quantize(w.detach(), "e4m3")  # one process, whole weight
        exact &= torch.equal(gathered.view(torch.uint8), whole.view(torch.uint8))
        for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            out = torch.empty(w.numel(), dtype=dtype)
            comm.all_gather(out, shard.reshape(-1).to(dtype), tag=f"{name} all-gather")
    return {
        "params": sum(w.numel() for w in weights),
        "weights": len(weights),
        "exact": exact,
    }


# ---- 2. zero-bubble pipelines --------------------------------------------------------
SCHEDULES = {
    "1F1B": "1f1b",
    "ZB-H1": "zb_h1",
    "ZB-V": "zb_v",
    "DualPipeV": "dualpipe_v",
}
"""The four schedules the chapter compares, by the names the papers use."""


def schedule_rows(p: int, m: int, t_f=1.0, t_b=2.0, t_w=1.0) -> list[dict]:
    """Per schedule of :data:`SCHEDULES` at ``p`` ranks and ``m`` microbatches:
    the simulated step and bubble (:func:`dtlab.pipeline.simulate`, ``t_f``,
    ``t_b`` per microbatch through one rank's layers, ``t_w`` of ``t_b`` for the
    weight pass where the backward is split), the step
    :func:`dtlab.estimate.pipeline_step_time` predicts, and the peak activations
    each rank holds, counted in microbatches of one rank's layers (a V's chunk is
    half of them), simulated (:func:`dtlab.pipeline.in_flight`) and estimated
    (:func:`dtlab.estimate.pipeline_in_flight`)."""
    rows = []
    for label, name in SCHEDULES.items():
        s = pipeline.make_schedule(name, p, m)
        spans = pipeline.simulate(s, t_f, t_b, t_w if s.split_backward else None)
        step = max(e["t_end"] for e in spans)
        w = t_w if s.split_backward else 0.0
        rows.append(
            {
                "schedule": label,
                "step": step,
                "estimate": estimate.pipeline_step_time(
                    p, m, t_f, t_b, schedule=name, t_w=w
                ),
                "bubble": pipeline.bubble(spans),
                "peak": [max(t) / s.v for t in pipeline.in_flight(s)],
                "peak_estimate": [
                    estimate.pipeline_in_flight(p, r, m, name) / s.v for r in range(p)
                ],
                "spans": spans,
            }
        )
    return rows


def schedules_figure(rows, p: int, m: int):
    """The simulated timelines of :func:`schedule_rows`, one Gantt chart per
    schedule on one time axis (labels: microbatch.chunk in a V)."""
    from plotly.subplots import make_subplots

    from dtlab.lab.figures.pipeline import pipeline_gantt

    fig = make_subplots(
        rows=len(rows),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=[f"{r['schedule']}: bubble {r['bubble']:.1%}" for r in rows],
    )
    for i, one in enumerate(rows, start=1):
        pipeline_gantt(
            one["spans"],
            fig=fig,
            row=i,
            col=1,
            scale=1,
            unit="t_f",
            showlegend=one["schedule"] == "ZB-H1",  # one row with F, B, W and idle
        )
        fig.update_xaxes(title_text="", row=i, col=1)
    fig.update_xaxes(title_text="time (units of t_f)", row=len(rows), col=1)
    fig.update_layout(
        barmode="overlay",
        height=170 * len(rows) + 80,
        title=f"p={p}, m={m}; a chunk's F, B and W take equal times",
    )
    return fig


def peak_in_flight(events) -> list[int]:
    """Each rank's most microbatch-chunks in flight over a training run, in rank
    order: the largest ``in_flight`` of the ``pp`` memory samples
    :class:`dtlab.pipeline.Pipeline` records after every pass."""
    peaks: dict[int, int] = {}
    for e in events:
        if e.get("kind") == Kind.MEMORY and e.get("phase") == "pp":
            peaks[e["rank"]] = max(peaks.get(e["rank"], 0), e["in_flight"])
    return [peaks[r] for r in sorted(peaks)]


def torch_v_step(config: GPTConfig, name: str, m: int, batch_size: int) -> dict:
    """Run on every rank of a pipeline over the whole world: one step of schedule
    ``name`` (``"zb_v"`` or ``"dualpipe_v"``) by dtlab's
    :class:`dtlab.pipeline.Pipeline`, and one by ``torch.distributed.pipelining``'s
    ``ScheduleZBVZeroBubble`` or ``ScheduleDualPipeV`` around fresh copies of the
    same two chunks (:func:`dtlab.pipeline.build_stages`, V placement), on batch 0.
    Returns each one's loss (on rank 0, where a V ends; ``None`` elsewhere), the
    largest difference between their weight gradients on this rank, and the
    actions PyTorch ran."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    from dtlab.topology import Layout, Topology

    p, rank = dist.get_world_size(), dist.get_rank()
    topo = Topology(Layout(pp=p))
    x, y = SyntheticTokens(config.vocab_size, config.seq_len).batch(0, batch_size)
    ours = pipeline.Pipeline(config, topo, name, microbatches=m)
    loss = ours.step(x, y)["loss"]
    grads = {n: q.grad for n, q in ours.named_parameters()}

    chunks = pipeline.build_stages(config, p, rank, 2, placement="v")
    stages = [
        PipelineStage(
            chunk,
            pipeline.virtual_stage(p, rank, c, "v"),  # chunk 1 of rank r: 2p-1-r
            2 * p,
            torch.device("cpu"),
            group=topo.group("pp"),
        )
        for c, chunk in enumerate(chunks)
    ]
    kind = {"zb_v": ScheduleZBVZeroBubble, "dualpipe_v": ScheduleDualPipeV}[name]
    runner = kind(stages, n_microbatches=m, loss_fn=chunks[0].loss)
    losses: list = []
    if rank == 0:  # stage 0 takes the input; the last stage (also here) the targets
        runner.step(x, target=y, losses=losses)
    else:
        runner.step()
    theirs = {n: q.grad for c in chunks for n, q in c.global_named_parameters()}
    gap = max((theirs[n] - g).abs().max().item() for n, g in grads.items())
    actions = [
        f"{sub.computation_type.value}{sub.microbatch_index}"
        for a in runner.pipeline_order[rank]
        if a is not None
        for sub in (a.sub_actions or (a,))
    ]
    return {
        "loss": loss,
        "torch_loss": torch.stack(losses).mean().item() if losses else None,
        "grad_gap": gap,
        "torch_actions": actions,
    }


# ---- 3. sharded Muon -----------------------------------------------------------------
MUON_OPTIONS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW_OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def _loss(model, config, step, rank, n, batch_size):
    x, y = SyntheticTokens(config.vocab_size, config.seq_len).shard(
        step, batch_size, rank, n
    )
    return model(x, y)[1]


def muon_steps(config: GPTConfig, design: str, steps: int, batch_size: int) -> dict:
    """Run on every rank: ``GPT(config)`` trained for ``steps`` steps on this rank's
    shard of each batch, its hidden matrices by
    :class:`dtlab.muon.ShardedMuon` (``design``: ``"naive"`` or ``"owner"``) and
    the rest by AdamW, whose gradients are averaged in one all-reduce as DDP would.
    Returns the parameters at the end, the matrices' shapes, the matrices this rank
    orthogonalized and the Newton-Schulz FLOPs it ran (the comm records travel with
    ``cluster.run(..., record=True)``)."""
    import torch.distributed as dist

    from dtlab import comm, telemetry
    from dtlab.muon import ShardedMuon, split_params

    r, n = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    split = split_params(model)
    muon = ShardedMuon(split.muon.values(), None, design, **MUON_OPTIONS)
    adamw = torch.optim.AdamW(split.adamw.values(), **ADAMW_OPTIONS)
    rest = list(split.adamw.values())
    for step in range(steps):
        telemetry.current().step = step
        model.zero_grad(set_to_none=True)
        _loss(model, config, step, r, n, batch_size).backward()
        bucket = torch.cat([q.grad.reshape(-1) for q in rest]).div_(n)
        comm.all_reduce(bucket, tag="adamw grads")  # the rest, as DDP would
        for q, g in zip(rest, bucket.split([q.numel() for q in rest])):
            q.grad.copy_(g.view_as(q))
        muon.step()  # reduce-scatters the matrices' gradients itself
        adamw.step()
    return {
        "params": {k: q.detach().clone() for k, q in model.named_parameters()},
        "shapes": muon.shapes,
        "owned": muon.owned,
        "flops": muon.flops_done // steps,
    }


@functools.cache
def _reference(config: GPTConfig, n: int, steps: int, batch_size: int) -> tuple:
    from dtlab.muon import split_params

    model = GPT(config)
    split = split_params(model)
    muon = torch.optim.Muon(split.muon.values(), **MUON_OPTIONS)
    adamw = torch.optim.AdamW(split.adamw.values(), **ADAMW_OPTIONS)
    for step in range(steps):
        parts = []
        for r in range(n):  # each rank's gradient, divided by n, in rank order
            model.zero_grad(set_to_none=True)
            _loss(model, config, step, r, n, batch_size).backward()
            parts.append({k: q.grad / n for k, q in model.named_parameters()})
        for k, q in model.named_parameters():
            q.grad = functools.reduce(torch.add, [part[k] for part in parts])
        muon.step()
        adamw.step()
    return tuple((k, q.detach().clone()) for k, q in model.named_parameters())


def muon_reference(config: GPTConfig, n: int, steps: int, batch_size: int) -> dict:
    """One process, the steps of :func:`muon_steps` on ``n`` ranks: each rank's
    shard's gradient computed on its own, divided by ``n`` and added in rank order
    (on 2 ranks a sum of two terms has one order, so the sharded runs can match it
    bit for bit), then PyTorch's ``torch.optim.Muon`` on the hidden matrices and
    AdamW on the rest, on one thread as the engines run. The parameters at the
    end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on every engine: the same sums in the same order
    try:
        return dict(_reference(config, n, steps, batch_size))
    finally:
        torch.set_num_threads(threads)

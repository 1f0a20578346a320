"""``dtlab bench pp``: dtlab's 1F1B against ``torch.distributed.pipelining`` on the
same stages and batch, and the measured bubble next to ``(p-1)/(m+p-1)`` (chapter 05).
:func:`torch_pipeline` is also the parity tests' PyTorch side."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtlab import comm, telemetry
from dtlab.model import GPTConfig, SyntheticTokens
from dtlab.pipeline import (
    Pipeline,
    StageModule,
    bubble,
    build_stages,
    measured_timeline,
)
from dtlab.topology import Layout, Topology

__all__ = ["torch_pipeline", "run"]


def torch_pipeline(stage: StageModule, topo, schedule: str, m: int):
    """``torch.distributed.pipelining``'s ``ScheduleGPipe`` or ``Schedule1F1B``
    around the same :class:`StageModule`, the comparison the tests and ``dtlab
    bench pp`` make. Returns ``step(x, y)``, which runs one step and returns the mean
    microbatch loss on the last stage (``None`` elsewhere).

    PyTorch back-propagates each ``L_i`` and divides the summed gradients by ``m``
    at the end (``scale_grads``); dtlab back-propagates ``L_i / m``. Same numbers,
    bit for bit when ``m`` is a power of two (scaling by one is exact in floats)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule not in kinds:
        raise ValueError(f"schedule must be one of {list(kinds)}, got {schedule!r}")
    pp = topo.axis("pp")
    pipe_stage = PipelineStage(
        stage, pp.index, pp.size, torch.device("cpu"), group=topo.group("pp")
    )
    runner = kinds[schedule](pipe_stage, n_microbatches=m, loss_fn=StageModule.loss)

    def step(x, y):
        losses: list = []
        if pp.index == 0:
            runner.step(x)
        elif pp.index == pp.size - 1:
            runner.step(target=y, losses=losses)
        else:
            runner.step()
        return torch.stack(losses).mean().item() if losses else None

    return step


# ---- benchmark: ``dtlab bench pp`` ---------------------------------------------------
def _on_rank(p, m_values, steps, cfg_kwargs):
    topo = Topology(Layout(pp=p))
    mb_rows = 4
    out = {"step_s": {}, "bubble": {}}

    def timed(fn):
        fn()  # warm-up (torch infers shapes on its first step)
        times = []
        for _ in range(steps):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            comm.barrier()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]  # median

    m = m_values[1] if len(m_values) > 1 else m_values[0]
    cfg = GPTConfig(n_layers=p, tied_head=False, **cfg_kwargs)
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(0, mb_rows * m)
    pipe = Pipeline(cfg, topo, "1f1b", microbatches=m)
    out["step_s"]["dtlab 1f1b"] = timed(lambda: (pipe.zero_grad(), pipe.step(x, y)))
    stage = build_stages(cfg, p, topo.coords["pp"])[0]
    theirs = torch_pipeline(stage, topo, "1f1b", m)
    out["step_s"]["torch 1f1b"] = timed(lambda: (stage.zero_grad(), theirs(x, y)))
    for mm in m_values:
        xb, yb = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(0, mb_rows * mm)
        pipe = Pipeline(cfg, topo, "1f1b", microbatches=mm)
        rec = telemetry.Recorder(dist.get_rank())
        with telemetry.use(rec):
            for n in range(steps):
                rec.step = n
                pipe.zero_grad()
                pipe.step(xb, yb)
        out["bubble"][mm] = rec.events
    return out


def run(p: int = 4, steps: int = 5, bubble_p: int | None = 2, **model) -> dict:
    """``dtlab bench pp``: on ``p`` fresh processes, the median step time of dtlab's
    1F1B and of ``torch.distributed.pipelining``'s ``Schedule1F1B`` on the same
    stages and batch, and the measured bubble of dtlab's 1F1B for ``m = p, 2p, 4p``
    next to ``(p-1)/(m+p-1)``. ``model``: :class:`GPTConfig` fields (default a
    GPT of width 128 and sequence 64, one block per stage).

    ``bubble_p``: the bubble once more on that many stages, with a model whose
    stages outweigh the executor's fixed cost per action (width 256, sequence 128):
    with one core per stage, where measurement and formula can meet
    (``report["bubble_small"]``)."""
    from dtlab.estimate import pipeline_bubble_fraction
    from dtlab.launch import spawn

    cfg_kwargs = {"d_model": 128, "n_heads": 4, "seq_len": 64, "vocab_size": 256}
    cfg_kwargs.update(model)
    m_values = [p, 2 * p, 4 * p]
    results = spawn(_on_rank, p, p, m_values, steps, cfg_kwargs, timeout=300)
    report = {"p": p, "steps": steps, "model": cfg_kwargs, "step_s": {}, "bubble": {}}
    for name in results[0]["step_s"]:
        report["step_s"][name] = max(r["step_s"][name] for r in results)
    for mm in m_values:
        events = [e for r in results for e in r["bubble"][mm]]
        measured = sorted(
            bubble(measured_timeline(events, step=n)) for n in range(1, steps)
        )
        report["bubble"][mm] = {
            "measured": measured[len(measured) // 2],
            "formula": pipeline_bubble_fraction(p, mm),
        }
    if bubble_p and bubble_p != p:
        wide = {**cfg_kwargs, "d_model": 256, "seq_len": 128}
        small = run(bubble_p, steps, bubble_p=None, **wide)
        report["bubble_small"] = {"p": bubble_p, "bubble": small["bubble"]}
    return report

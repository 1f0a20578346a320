"""Chapter 06's lesson helpers (``notebooks/06_mixed_precision.ipynb``): the
questions the chapter asks the learner to predict; :func:`train_policy`, the
chapter's DDP run under one of dtlab's precision policies, which also measures the
bytes of model state per parameter; :func:`scale_figure`, the loss scale per step
and rank from the scalers' events; :func:`one_adam_step`, an AdamW step taken on
bf16 weights and on an fp32 master copy of them; and :func:`autocast_state_bytes`,
what the model and AdamW hold after one step of PyTorch's autocast loop.

:func:`train_policy` runs on every engine (the cluster ships it); the others run
in the kernel. Nothing here is an exercise's answer: the scaler's rule and the
autocast step are the learner's to write.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from dtlab.lab.predictions import Question

__all__ = [
    "QUESTIONS",
    "train_policy",
    "scale_figure",
    "one_adam_step",
    "autocast_state_bytes",
]

QUESTIONS = [
    Question(
        "fp16_flushed_share",
        "06",
        "the share of the nonzero gradient values that an fp16 backward of the "
        "chapter's GPT flushes to zero without a loss scale (S = 1)",
        "%",
    ),
    Question(
        "fp16_skipped_steps",
        "06",
        "how many of 20 fp16 steps on four ranks are skipped, starting at S = 2^16 "
        "and doubling S after every 5 clean steps",
        "count",
    ),
    Question(
        "bf16_adam_bytes_per_param",
        "06",
        "bytes of model state per parameter (16-bit weights and gradients, fp32 "
        "master and Adam moments) that rank 0 holds in the bf16 run",
        "B",
    ),
]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def train_policy(
    precision, steps=20, batch=16, init_scale=2.0**16, growth_interval=5, lr=1e-3
):
    """On every rank: dtlab's DDP trains the chapter's GPT under a precision
    policy (``"fp32"``, ``"bf16"``, ``"fp16"``) through
    :class:`dtlab.amp.MixedPrecisionOptimizer`. Returns the step records (loss,
    the scale the step's backward used, skipped) and the bytes of model state per
    parameter this rank held after the last step: ``params``, ``grads``,
    ``optimizer`` (fp32 masters and Adam's moments) and, apart, the fp32
    ``master_grads`` the optimizer reads."""
    import torch.distributed as dist

    from dtlab import amp, comm, telemetry
    from dtlab.ddp import DistributedDataParallel
    from dtlab.model import GPT, GPTConfig, SyntheticTokens

    cfg = GPTConfig()
    rank, n = dist.get_rank(), dist.get_world_size()
    pol = amp.policy(precision)
    model = GPT(cfg).to(pol.compute_dtype)
    ddp = DistributedDataParallel(model)
    scaler = pol.scaler(init_scale=init_scale, growth_interval=growth_interval)
    opt = amp.MixedPrecisionOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        pol,
        scaler=scaler,
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        eps=1e-8,
    )
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len)
    rec, records = telemetry.current(), []
    for step in range(steps):
        rec.step = step
        opt.zero_grad()
        x, y = data.shard(step, batch, rank, n)  # (B/n, T)
        _, loss = ddp(x, y)
        scale = scaler.scale_value  # the scale this step's backward uses
        opt.backward(loss)
        stepped = opt.step()  # emits an "amp" event: scale, skipped
        total = torch.tensor([loss.float().item()])
        comm.all_reduce(total, tag="loss")
        records.append(
            dict(step=step, loss=total.item() / n, scale=scale, skipped=not stepped)
        )
    params = list(model.parameters())
    masters = opt.masters if pol.has_master_copy else []
    states = [  # Adam's moments, not its one-element step counters
        v
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    psi = sum(p.numel() for p in params)
    memory = dict(
        params=_nbytes(params) / psi,
        grads=_nbytes(p.grad for p in params) / psi,
        optimizer=(_nbytes(masters) + _nbytes(states)) / psi,
        master_grads=_nbytes(m.grad for m in masters if m.grad is not None) / psi,
    )
    return dict(records=records, memory=memory)


def scale_figure(events):
    """The loss scale per step and rank from the scalers' ``"amp"`` events;
    skipped steps as red crosses."""
    fig = go.Figure()
    evs = [e for e in events if e.get("kind") == "amp"]
    for r in sorted({e["rank"] for e in evs}):
        mine = [e for e in evs if e["rank"] == r]
        fig.add_scatter(
            x=[e["step"] for e in mine],
            y=[e["scale"] for e in mine],
            mode="lines",
            name=f"rank {r}",
            line_shape="hv",
        )
    skipped = [e for e in evs if e["skipped"] and e["rank"] == 0]
    fig.add_scatter(
        x=[e["step"] for e in skipped],
        y=[e["scale"] * 2 for e in skipped],
        mode="markers",
        marker=dict(symbol="x", size=11, color="red"),
        name="skipped step (scale before)",
    )
    fig.update_layout(
        title="Dynamic loss scale (after each step's update)",
        xaxis_title="step",
        yaxis_title="scale",
        yaxis_type="log",
        height=360,
    )
    return fig


def one_adam_step(config, x, y, lr) -> tuple[float, float]:
    """One AdamW step at ``lr`` on the bf16 weights of ``GPT(config)`` directly,
    and on an fp32 master copy of the same weights with the same gradients.
    Returns the share of the weights the masters moved that the bf16 weights did
    not move at all, and the median relative error of the bf16 weights' step."""
    from dtlab.model import GPT

    model = GPT(config).to(torch.bfloat16)
    model(x, y)[1].backward()  # the loss is fp32, the gradients bf16
    weights = [p for p in model.parameters() if p.grad is not None]
    masters = [p.detach().float().requires_grad_() for p in weights]
    for p, m in zip(weights, masters):
        m.grad = p.grad.float()
    before = torch.cat([m.detach().reshape(-1) for m in masters])
    for params in (weights, masters):
        torch.optim.AdamW(params, lr=lr, weight_decay=0.0).step()
    intended = torch.cat([m.detach().reshape(-1) for m in masters]) - before
    applied = torch.cat([p.detach().float().reshape(-1) for p in weights]) - before
    moving = intended != 0
    error = ((applied - intended).abs() / intended.abs())[moving]
    return (applied[moving] == 0).float().mean().item(), error.median().item()


def autocast_state_bytes(job) -> dict:
    """Bytes per parameter the fp32 model and AdamW hold after one step of the
    autocast loop in bf16 (``GradScaler`` disabled): weights, gradients, and
    Adam's two moments (not its one-element step counters)."""
    from dtlab.frameworks.job import build_data, build_model, build_optimizer

    model = build_model(job)
    opt = build_optimizer(model.parameters(), job)
    x, y = build_data(job).batch(0, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    params = list(model.parameters())
    moments = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    psi = sum(p.numel() for p in params)
    return dict(
        params=_nbytes(params) / psi,
        grads=_nbytes(p.grad for p in params) / psi,
        optimizer=_nbytes(moments) / psi,
    )

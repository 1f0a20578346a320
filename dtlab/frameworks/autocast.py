"""``torch.autocast`` + ``torch.amp.GradScaler``, the seeds' mixed-precision loop,
beside dtlab's policy (:mod:`dtlab.amp`) on the same job.

Taught in chapter 06 ("from dtlab to the real thing"). The two are different
designs of the same idea (Micikevicius et al. 2018):

- **autocast** keeps the parameters in fp32 and casts *per operator* on the way
  in: matmuls, linear layers, convolutions and attention run in 16 bits, a short
  list of operators is forced to fp32 (on CPU: ``cross_entropy``, ``nll_loss``,
  ``mse_loss``, ``prod``, ...), the rest follow their inputs.
  :func:`autocast_policy` measures which operator does what, :func:`module_dtypes`
  shows it on dtlab's GPT. The fp32 parameters are the master weights; what is
  saved for backward is 16-bit.
- **dtlab's policy** casts the *model* (``model.to(bf16)``): weights, activations
  and gradients are 16-bit everywhere, the optimizer steps an fp32 master copy
  (:class:`dtlab.amp.MixedPrecisionOptimizer`), and the loss is computed in fp32
  from 16-bit logits, as autocast does.

Both scale fp16's loss with the same dynamic rule (ZeRO's and GradScaler's: skip
and halve on an inf, double after ``growth_interval`` clean steps).
:func:`scale_schedules` runs both on the same job and lists, step by step, the
scale each used and whether it skipped: they agree. (Before dtlab computed its
loss in fp32 they did not: a 16-bit loss's gradient S = 2^16 is already inf in
fp16, so dtlab's fp16 runs skipped their first step, and every later step whose
scale grew back to 2^16.)

**On CPU** (torch 2.13): autocast takes bf16 and fp16, ``GradScaler("cpu")``
works, and every operator :func:`autocast_policy` probes runs in both; what did
not run is reported in its result as an ``"error: ..."`` entry rather than
skipped. bf16 needs no scaler: ``GradScaler(enabled=False)`` is the object that
does nothing (scale 1, ``step`` is ``optimizer.step``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from dtlab import amp
from dtlab.frameworks.job import (
    build_data,
    build_model,
    build_optimizer,
    check_job,
    local_batch,
    mean_over_world,
    world,
)

__all__ = [
    "AUTOCAST_DTYPES",
    "autocast_policy",
    "module_dtypes",
    "train_autocast",
    "train_dtlab",
    "scale_schedules",
]

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# one call per operator on small inputs: x (B, T, C) activations, w (C, C) weights,
# t (B,) class targets; each probe is fed fp32 inputs and 16-bit inputs in turn
_PROBES = {
    "linear": lambda x, w, t: F.linear(x, w),
    "matmul": lambda x, w, t: x @ w,
    "bmm": lambda x, w, t: torch.bmm(x, x.transpose(1, 2)),
    "conv1d": lambda x, w, t: F.conv1d(x, w[:4, : x.shape[1]].unsqueeze(-1)),
    "scaled_dot_product_attention": lambda x, w, t: F.scaled_dot_product_attention(
        x, x, x, is_causal=True
    ),
    "layer_norm": lambda x, w, t: F.layer_norm(x, x.shape[-1:]),
    "softmax": lambda x, w, t: torch.softmax(x, -1),
    "log_softmax": lambda x, w, t: F.log_softmax(x, -1),
    "gelu": lambda x, w, t: F.gelu(x),
    "embedding": lambda x, w, t: F.embedding(t, w.to(x.dtype)),
    "sum": lambda x, w, t: x.sum(),
    "exp": lambda x, w, t: x.exp(),
    "cumsum": lambda x, w, t: x.cumsum(-1),
    "prod": lambda x, w, t: x.prod(),
    "cross_entropy": lambda x, w, t: F.cross_entropy(x[:, 0], t),
    "nll_loss": lambda x, w, t: F.nll_loss(x[:, 0], t),
    "mse_loss": lambda x, w, t: F.mse_loss(x, x),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def autocast_policy(precision: str = "bf16") -> dict[str, str]:
    """What CPU autocast does with each probed operator, measured:
    ``"lower"`` (fp32 inputs computed in 16 bits), ``"fp32"`` (16-bit inputs
    computed in fp32), ``"follows input"`` (neither), or ``"error: ..."``."""
    dtype = _autocast_dtype(precision)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, generator=gen)  # (B, T, C)
    w = torch.randn(16, 16, generator=gen)  # (C, C)
    t = torch.randint(16, (4,), generator=gen)  # (B,)
    out = {}
    for name, probe in _PROBES.items():
        try:
            with torch.autocast("cpu", dtype=dtype):
                from_fp32 = probe(x, w, t).dtype
                from_16 = probe(x.to(dtype), w.to(dtype), t).dtype
        except Exception as exc:  # noqa: BLE001 - what does not run is the finding
            out[name] = f"error: {type(exc).__name__}: {exc}"
            continue
        if from_fp32 == dtype:
            out[name] = "lower"
        elif from_16 == torch.float32:
            out[name] = "fp32"
        else:
            out[name] = "follows input"
    return out


def _autocast_dtype(precision: str) -> torch.dtype:
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(
            f"autocast computes in bf16 or fp16: precision must be one of "
            f"{sorted(AUTOCAST_DTYPES)}, not {precision!r}"
        )
    return AUTOCAST_DTYPES[precision]


def module_dtypes(config, policy: str = "autocast") -> dict[str, str]:
    """``{module name: dtype of its output}`` for every leaf module of the config's
    GPT on one batch, plus ``"loss"``: under ``policy="autocast"`` (fp32 model,
    ``torch.autocast`` in ``config.precision``) or ``policy="dtlab"`` (the model
    cast to the precision, as :mod:`dtlab.amp` does)."""
    dtype = _autocast_dtype(config.precision)
    if policy not in ("autocast", "dtlab"):
        raise ValueError(f"policy must be 'autocast' or 'dtlab', not {policy!r}")
    model = build_model(config)
    if policy == "dtlab":
        model.to(dtype)
    seen: dict[str, str] = {}

    def record(name):
        def hook(module, args, out):  # returns None: the output is left alone
            seen.setdefault(name, _dtype_name(out.dtype))

        return hook

    hooks = [
        module.register_forward_hook(record(name))
        for name, module in model.named_modules()
        if not list(module.children())
    ]
    x, y = build_data(config).batch(0, 2)  # (2, T)
    casts = (
        torch.autocast("cpu", dtype=dtype) if policy == "autocast" else nullcontext()
    )
    with casts, torch.no_grad():
        _, loss = model(x, y)
    for h in hooks:
        h.remove()
    seen["loss"] = _dtype_name(loss.dtype)
    return seen


def _wrap_ddp(model):
    """torch's DDP over the world, or the model itself on one process."""
    _, n = world()
    if n == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model)


def train_autocast(
    config, *, init_scale: float = 2.0**16, growth_interval: int = 2000
) -> list[dict]:
    """The seeds' loop on every rank (torch DDP over the world when it has more
    than one rank): fp32 model and AdamW, forward under ``torch.autocast("cpu",
    dtype)``, ``GradScaler("cpu")`` for fp16 (``enabled=False`` for bf16).
    Returns per step ``{"step", "loss", "scale", "skipped"}``: ``scale`` is the
    one this step's backward used; a step is skipped exactly when the scaler
    backs off (GradScaler has no minimum scale)."""
    check_job(config, "train_autocast")
    dtype = _autocast_dtype(config.precision)
    model = _wrap_ddp(build_model(config))
    optimizer = build_optimizer(model.parameters(), config)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_interval=growth_interval,
        enabled=config.precision == "fp16",
    )
    data = build_data(config)
    records = []
    for step in range(config.steps):
        x, y = local_batch(data, step, config)  # (B/N, T)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            _, loss = model(x, y)  # an fp32 loss: cross_entropy is on the fp32 list
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        if config.grad_clip is not None:
            scaler.unscale_(optimizer)  # clip the true gradients, not scaled ones
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        scaler.step(optimizer)  # skipped if any gradient is inf/nan
        scaler.update()
        skipped = scaler.is_enabled() and scaler.get_scale() < scale
        records.append(
            {
                "step": step,
                "loss": mean_over_world(loss.item()),
                "scale": scale,
                "skipped": bool(skipped),
                "loss_dtype": _dtype_name(loss.dtype),
            }
        )
    return records


def train_dtlab(
    config, *, init_scale: float = 2.0**16, growth_interval: int = 2000
) -> list[dict]:
    """dtlab's run of the same job (:class:`dtlab.train.Trainer`, the precision
    policy of :mod:`dtlab.amp`), with its loss scaler built from the same
    ``init_scale`` and ``growth_interval``; the records of
    :func:`train_autocast`."""
    from dtlab.train import Trainer

    check_job(config, "train_dtlab")
    trainer = Trainer(config)
    scaler = amp.policy(config.precision).scaler(
        init_scale=init_scale, growth_interval=growth_interval
    )
    trainer.optimizer.scaler = scaler
    records = []
    for step in range(config.steps):
        scale = scaler.scale_value  # what this step's backward multiplies by
        record = trainer.fit(1)[-1]
        records.append(
            {
                "step": step,
                "loss": record["loss"],
                "scale": scale,
                "skipped": bool(record["skipped"]),
                "loss_dtype": "float32",
            }
        )
    return records


def scale_schedules(config, *, growth_interval: int = 5) -> list[dict]:
    """Both loops on every rank, side by side per step: ``{"step",
    "dtlab_scale", "torch_scale", "dtlab_skipped", "torch_skipped",
    "dtlab_loss", "torch_loss"}``. A short ``growth_interval`` lets the scale
    grow until it overflows within a few dozen steps."""
    ours = train_dtlab(config, growth_interval=growth_interval)
    theirs = train_autocast(config, growth_interval=growth_interval)
    return [
        {
            "step": a["step"],
            "dtlab_scale": a["scale"],
            "torch_scale": b["scale"],
            "dtlab_skipped": a["skipped"],
            "torch_skipped": b["skipped"],
            "dtlab_loss": a["loss"],
            "torch_loss": b["loss"],
        }
        for a, b in zip(ours, theirs)
    ]

"""The single-process trainer that every distributed strategy is compared against.

Taught in chapter 00 (the baseline) and used by the parity tests of every later
chapter: DDP, ZeRO, tensor and pipeline parallelism must reproduce these losses on the
same global batches, exactly (``torch.equal``) where the order of floating-point sums
allows it, within a stated tolerance otherwise.

One step is :func:`reference_step`: forward on the whole global batch, mean loss,
backward, optional global-norm clipping, AdamW update. Strategies reuse it (or its
parts) so the only difference between them and this file is the distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dtlab import amp
from dtlab.amp import grad_norm
from dtlab.model import GPT, GPTConfig, SyntheticTokens

__all__ = [
    "ReferenceResult",
    "make_optimizer",
    "grad_norm",
    "reference_step",
    "amp_reference_step",
    "train_reference",
    "accumulated_gradients",
]


def make_optimizer(
    params,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) over ``params`` with eps 1e-8.

    Weight decay applies to every parameter (nanoGPT exempts biases and LayerNorms);
    one group keeps the sharded optimizers of the ZeRO chapters simple.
    """
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, weight_decay=weight_decay, eps=1e-8
    )


def reference_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    grad_clip: float | None = None,
) -> dict[str, float]:
    """One training step on one process: zero grads, forward, backward, clip, update.

    ``model(x, y)`` must return ``(logits, loss)`` with ``loss`` the batch mean.
    Returns ``{"loss", "grad_norm"}`` (the norm before clipping).
    """
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip is not None:
        if grad_clip <= 0:
            raise ValueError(f"grad_clip must be positive, got {grad_clip}")
        # clip_grad_norm_ returns the norm it measured before scaling
        norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    else:
        norm = grad_norm(params)
    optimizer.step()
    return {"loss": loss.item(), "grad_norm": norm}


def amp_reference_step(
    model: nn.Module, optimizer: amp.MixedPrecisionOptimizer, x, y
) -> dict[str, float]:
    """:func:`reference_step` under a mixed-precision policy: scaled backward, fp32
    master step (skipped on overflow), masters copied back into the 16-bit model."""
    optimizer.zero_grad()
    _, loss = model(x, y)
    optimizer.backward(loss)
    scale = optimizer.scaler.scale_value
    stepped = optimizer.step()
    # the norm of the unscaled fp32 master gradients (inf when the step was skipped)
    norm = grad_norm(optimizer.masters) if stepped else math.inf
    return {"loss": loss.float().item(), "grad_norm": norm, "scale": scale,
            "skipped": not stepped}  # fmt: skip


@dataclass
class ReferenceResult:
    """What :func:`train_reference` returns: one record per step and the final state."""

    records: list[dict] = field(default_factory=list)
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]


def train_reference(
    model_config: GPTConfig | None = None,
    *,
    steps: int,
    global_batch_size: int,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    grad_clip: float | None = None,
    seed: int = 0,
    data_seed: int = 0,
    precision: str = "fp32",
) -> ReferenceResult:
    """Train ``GPT(model_config, seed)`` for ``steps`` AdamW steps on
    ``SyntheticTokens(..., seed=data_seed).batch(step, global_batch_size)``.

    ``precision`` ("fp32", "bf16", "fp16"; :mod:`dtlab.amp`) makes the same casts a
    mixed-precision strategy makes: the model computes in 16 bits, AdamW steps fp32
    master weights, fp16 scales the loss (records then carry ``scale`` and
    ``skipped``). Mixed-precision strategies are compared against this.

    Deterministic: the same arguments give bit-identical losses (and weights) in any
    run with the same torch build and thread count. Each record is
    ``{"step", "loss", "grad_norm", "lr", "tokens"}`` (``tokens`` seen so far).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    config = model_config or GPTConfig()
    model = GPT(config, seed=seed)
    model.train()
    pol = amp.policy(precision)
    if pol.has_master_copy:
        model.to(pol.compute_dtype)
        optimizer = amp.MixedPrecisionOptimizer(
            model.parameters(), torch.optim.AdamW, pol, groups=(),
            grad_clip=grad_clip, lr=lr, betas=betas, weight_decay=weight_decay,
            eps=1e-8,
        )  # fmt: skip
    else:
        optimizer = make_optimizer(model.parameters(), lr, weight_decay, betas)
    data = SyntheticTokens(config.vocab_size, config.seq_len, seed=data_seed)
    result = ReferenceResult(model=model, optimizer=optimizer)
    for step in range(steps):
        x, y = data.batch(step, global_batch_size)  # (B, T) each
        if pol.has_master_copy:
            out = amp_reference_step(model, optimizer, x, y)
        else:
            out = reference_step(model, optimizer, x, y, grad_clip)
        result.records.append(
            {
                "step": step,
                "lr": lr,
                "tokens": (step + 1) * x.numel(),
                **out,
            }
        )
    return result


def accumulated_gradients(
    config: GPTConfig, x: torch.Tensor, y: torch.Tensor, m: int, seed: int = 0
) -> tuple[float, dict[str, torch.Tensor]]:
    """What one pipeline step must compute, in one process: gradient accumulation
    of ``L_i / m`` over the ``m`` microbatches of ``(x, y)`` (``tensor_split``, as
    :class:`dtlab.pipeline.Pipeline` splits them), on the GPT ``config`` builds with
    ``seed``. Returns the mean loss and ``{name: gradient}``."""
    model = GPT(config, seed)
    losses = []
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
        _, loss = model(xi, yi)
        (loss / m).backward()
        losses.append(loss.detach())
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    return torch.stack(losses).mean().item(), grads

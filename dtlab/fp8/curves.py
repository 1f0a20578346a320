"""The course's GPT trained in fp32, bf16 and FP8 on the same batches: loss curves.

Taught in chapter 12 (the frontier), its FP8 section. One process, the same
seeded model and :class:`dtlab.model.SyntheticTokens` batches for every precision,
plain AdamW on fp32 parameters, so the only difference between the curves is how
the matmuls round:

- ``"fp32"``: nothing rounded;
- ``"bf16"``: ``torch.autocast`` to bfloat16, the way most LLMs train (matmuls and
  attention in bf16, parameters, softmax and loss in fp32);
- ``"fp8-delayed"``, ``"fp8-current"`` (or any :class:`dtlab.fp8.Recipe`): every
  Linear but the head swapped by :func:`dtlab.fp8.convert_to_float8`; attention's
  two batched matmuls, the softmax and the loss stay fp32.
"""

from __future__ import annotations

import contextlib

import torch

from dtlab.checks import positive_int
from dtlab.fp8.linear import convert_to_float8
from dtlab.fp8.scaling import recipe as _recipe
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.reference import make_optimizer

__all__ = ["PRECISIONS", "loss_curves"]

PRECISIONS = ("fp32", "bf16", "fp8-delayed", "fp8-current")
"""The curves :func:`loss_curves` draws by default."""


def _precision(name):
    """``(label, model -> model, autocast context factory)`` for one precision."""
    if name == "fp32":
        return "fp32", lambda m: m, contextlib.nullcontext
    if name == "bf16":
        return "bf16", lambda m: m, lambda: torch.autocast("cpu", torch.bfloat16)
    r = _recipe(name)  # an FP8 recipe, or a ValueError listing the names
    return r.name, lambda m: convert_to_float8(m, r), contextlib.nullcontext


def loss_curves(
    config: GPTConfig | None = None,
    steps: int = 30,
    recipes=PRECISIONS,
    *,
    batch_size: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
    data_seed: int = 0,
) -> dict[str, list[float]]:
    """``{precision: [loss of each step]}``: ``GPT(config, seed)`` trained for
    ``steps`` AdamW steps (``lr``, betas 0.9/0.95) on
    ``SyntheticTokens(..., seed=data_seed).batch(step, batch_size)`` under each of
    ``recipes`` (names in :data:`PRECISIONS`, or :class:`dtlab.fp8.Recipe`
    objects). The default config (2 layers, d_model 64) takes a few seconds on two
    CPU cores for all four curves."""
    positive_int("steps", steps)
    config = config or GPTConfig()
    data = SyntheticTokens(config.vocab_size, config.seq_len, seed=data_seed)
    batches = [data.batch(step, batch_size) for step in range(steps)]
    curves = {}
    for name in recipes:
        label, prepare, autocast = _precision(name)
        model = prepare(GPT(config, seed=seed))
        model.train()
        optimizer = make_optimizer(model.parameters(), lr=lr)
        losses = []
        for x, y in batches:  # (B, T) each
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                _, loss = model(x, y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        curves[label] = losses
    return curves

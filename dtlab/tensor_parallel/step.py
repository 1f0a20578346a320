"""One training step of a tensor-parallel model on its own, the loop of chapter 04
(sections 3 and 7): every tp rank gets the same batch.

:mod:`dtlab.parallelize` composes TP with the other axes and steps through
:class:`dtlab.amp.MixedPrecisionOptimizer` instead; this is the plain fp32 step,
shaped like :func:`dtlab.reference.reference_step` so the two compare line by line.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import comm, telemetry
from dtlab.events import Span

__all__ = ["tp_grad_norm", "tp_train_step"]


def tp_grad_norm(model: nn.Module, axis) -> float:
    """Global gradient norm of a tensor-parallel model: sharded gradients count on
    every rank, replicated ones once (on tp index 0); one all-reduce sums them."""
    device = next(model.parameters()).device  # nccl reduces device tensors only
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "tensor_parallel_dim", None) is not None or axis.index == 0:
            sq += p.grad.double().pow(2).sum()
    if axis.size > 1:
        comm.all_reduce(sq, group=axis, tag="grad_norm")
    return float(sq.sqrt())


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def tp_train_step(model, optimizer, x, y, grad_clip: float | None = None) -> dict:
    """One step of a :class:`~dtlab.tensor_parallel.TensorParallelStage` holding the
    whole GPT: forward, backward, SP gradient sums, (clip,) update. Returns
    ``{"loss", "grad_norm"}`` like :func:`dtlab.reference.reference_step`."""
    if grad_clip is not None and grad_clip <= 0:
        raise ValueError(f"grad_clip must be positive, got {grad_clip}")
    rec = telemetry.current()
    optimizer.zero_grad(set_to_none=True)
    with rec.span(Span.F):
        _, loss = model(x, y)
    with rec.span(Span.B):
        loss.backward()
        model.finish_gradient_synchronization()
    norm = tp_grad_norm(model, model.axis)
    if grad_clip is not None:
        scale = min(1.0, grad_clip / (norm + 1e-6))  # clip_grad_norm_'s rule
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    with rec.span(Span.OPT):
        optimizer.step()
    if rec.enabled:
        params = list(model.parameters())
        state = [
            v
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ]
        rec.memory(
            "step",
            params=_nbytes(params),
            grads=_nbytes(p.grad for p in params if p.grad is not None),
            optimizer=_nbytes(state),
        )
    return {"loss": loss.item(), "grad_norm": norm}

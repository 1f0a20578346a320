"""Chapter 06's reference solutions: a dynamic loss scaler whose overflow decision
is agreed across ranks, the underflow of gradients cast to fp16 or bf16
(Micikevicius et al. 2018, "Mixed Precision Training", §3.2), and one training
step of PyTorch's own loop, ``torch.autocast`` + ``torch.amp.GradScaler``.
``dtlab.exercises.solution(name)`` shows each; :mod:`.ch06_mixed_precision` checks
a learner's against them."""

from __future__ import annotations

import torch

__all__ = ["scaler_step", "underflow_fraction", "autocast_step"]


def scaler_step(grads, state):
    """One step of dynamic loss scaling on this rank. ``grads`` were computed from
    ``loss · state["scale"]``: divide them by the scale in place, find out whether
    *any* rank's gradients overflowed (inf or nan), update ``state`` (``scale``,
    ``clean_steps``, with ``growth_factor``, ``backoff_factor``,
    ``growth_interval``), and return that verdict: True means every rank skips
    this step together."""
    from dtlab import comm

    inv = 1.0 / state["scale"]
    local_inf = False
    for g in grads:
        g.mul_(inv)
        local_inf = local_inf or not bool(torch.isfinite(g).all())
    # one rank's inf is everyone's: a rank that steps while another skips diverges
    flag = torch.tensor([1.0 if local_inf else 0.0])
    comm.all_reduce(flag, op=comm.ReduceOp.MAX)
    found_inf = bool(flag.item() > 0)
    if found_inf:  # skip the step, back off
        state["scale"] *= state["backoff_factor"]
        state["clean_steps"] = 0
    else:
        state["clean_steps"] += 1
        if state["clean_steps"] == state["growth_interval"]:  # long clean: grow
            state["scale"] *= state["growth_factor"]
            state["clean_steps"] = 0
    return found_inf


def underflow_fraction(grads, dtype, scale=1.0):
    """The share of the nonzero values of ``grads`` (fp32) that become zero when
    ``grads · scale`` is cast to ``dtype``. Cast and look: fp16's subnormals reach
    down to 2⁻²⁴ (values above half of it round up to it), bf16 has fp32's 8
    exponent bits and flushes almost nothing."""
    nonzero = grads != 0
    flushed = (grads * scale).to(dtype) == 0
    return (flushed & nonzero).sum().item() / max(1, nonzero.sum().item())


def autocast_step(model, optimizer, scaler, x, y, max_norm):
    """One step of PyTorch's mixed-precision loop on an fp32 ``model``: zero the
    gradients, forward under ``torch.autocast("cpu", dtype=torch.float16)`` (the
    model returns ``(logits, loss)``), backward of the loss scaled by ``scaler`` (a
    ``torch.amp.GradScaler``), clip the *true* gradients to norm ``max_norm``, step
    ``optimizer`` unless a gradient overflowed, and update the scale. Returns the
    loss."""
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = model(x, y)  # an fp32 loss: cross_entropy runs in fp32
    scaler.scale(loss).backward()  # every gradient is S times the true one
    scaler.unscale_(optimizer)  # divide by S in place, note any inf/nan
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # true norms
    scaler.step(optimizer)  # skipped if unscale_ found an inf/nan
    scaler.update()  # back off after a skip, grow after N clean steps
    return loss

"""The mistakes learners make in chapter 06's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it)."""

from __future__ import annotations

import torch

from dtlab.exercises import ch06_mixed_precision  # noqa: F401 - declares the exercises
from dtlab.exercises.grading import mistake

__all__: list[str] = []


def _scaler(
    grads,
    state,
    *,
    agree=True,
    back_off=True,
    reset=True,
    unscale="divide",
    check="all",
):
    """A scaler step with one of the learners' mistakes switched on."""
    from dtlab import comm

    for g in grads:
        if unscale == "divide":
            g.div_(state["scale"])
        else:
            g.mul_(state["scale"])
    checked = grads if check == "all" else grads[:1]
    found = any(not bool(torch.isfinite(g).all()) for g in checked)
    if agree:
        flag = torch.tensor([float(found)])
        comm.all_reduce(flag, op=comm.ReduceOp.MAX)
        found = bool(flag.item() > 0)
    if found:
        if back_off:
            state["scale"] *= state["backoff_factor"]
        if reset:
            state["clean_steps"] = 0
    else:
        state["clean_steps"] += 1
        if state["clean_steps"] % state["growth_interval"] == 0:
            state["scale"] *= state["growth_factor"]
    return found


# ---- loss_scaler -------------------------------------------------------------------
@mistake("loss_scaler", expect="the ranks disagree")
def decides_on_each_rank(grads, state):
    """Checks this rank's gradients only: the rank with the inf skips, the others
    step, and the replicas drift apart."""
    return _scaler(grads, state, agree=False)


@mistake("loss_scaler", expect="multiplies it by backoff_factor")
def never_backs_off(grads, state):
    """Skips an overflowed step but keeps the scale: it overflows again and again."""
    return _scaler(grads, state, back_off=False)


@mistake("loss_scaler", expect="restarts the count of clean steps")
def keeps_counting_through_an_overflow(grads, state):
    """Does not reset the count of clean steps on an overflow: the scale grows
    again too soon after backing off."""
    return _scaler(grads, state, reset=False)


@mistake("loss_scaler", expect="not unscaled")
def multiplies_instead_of_dividing(grads, state):
    """Multiplies the gradients by the scale a second time instead of dividing."""
    return _scaler(grads, state, unscale="multiply")


@mistake("loss_scaler", expect="check every gradient")
def checks_only_the_first_gradient(grads, state):
    """Looks for inf/nan in the first gradient only, missing the others'."""
    return _scaler(grads, state, check="first")


# ---- underflow ---------------------------------------------------------------------
@mistake("underflow", expect="subnormal, not zero")
def flushes_below_the_smallest_normal(grads, dtype, scale=1.0):
    """Treats everything below fp16's smallest *normal* (2⁻¹⁴) as lost."""
    nonzero = grads != 0
    return ((grads * scale).abs() < 2.0**-14)[nonzero].float().mean().item()


@mistake("underflow", expect="apply it")
def ignores_the_loss_scale(grads, dtype, scale=1.0):
    """Casts the gradients as they are: the point of the loss scale missed."""
    nonzero = grads != 0
    return (grads.to(dtype) == 0)[nonzero].float().mean().item()


@mistake("underflow", expect="8 exponent bits")
def treats_bf16_like_fp16(grads, dtype, scale=1.0):
    """One threshold for both 16-bit formats, as if bf16 had fp16's range."""
    nonzero = grads != 0
    return ((grads * scale).to(torch.float16) == 0)[nonzero].float().mean().item()


@mistake("underflow", expect="nonzero gradients")
def counts_the_zeros_too(grads, dtype, scale=1.0):
    """Divides by every value, zeros included, which were never gradients to lose."""
    return ((grads * scale).to(dtype) == 0).float().mean().item()


@mistake("underflow", expect="rounds up")
def thresholds_at_the_smallest_subnormal(grads, dtype, scale=1.0):
    """Everything below 2⁻²⁴ counts as lost, but round to nearest takes what lies
    above 2⁻²⁵ up to 2⁻²⁴ (and bf16 is not fp16)."""
    nonzero = grads != 0
    return ((grads * scale).abs() < 2.0**-24)[nonzero].float().mean().item()


# ---- autocast_step -----------------------------------------------------------------
def _amp_step(
    model,
    optimizer,
    scaler,
    x,
    y,
    max_norm,
    *,
    dtype=torch.float16,
    zero=True,
    scaled=True,
    unscale_first=True,
    through_scaler=True,
    update=True,
):
    """A step of the autocast + GradScaler loop with one mistake switched on."""
    from contextlib import nullcontext

    if zero:
        optimizer.zero_grad(set_to_none=True)
    casts = torch.autocast("cpu", dtype=dtype) if dtype else nullcontext()
    with casts:
        _, loss = model(x, y)
    (scaler.scale(loss) if scaled else loss).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if through_scaler:
        scaler.step(optimizer)
    else:
        optimizer.step()
    if update:
        scaler.update()
    return loss


@mistake("autocast_step", expect="scaler.unscale_(optimizer) before clip_grad_norm_")
def clips_before_unscaling(model, optimizer, scaler, x, y, max_norm):
    """Clips the gradients while they are still multiplied by the scale, then lets
    scaler.step unscale them: clipped S times too hard."""
    return _amp_step(model, optimizer, scaler, x, y, max_norm, unscale_first=False)


@mistake("autocast_step", expect="call scaler.update()")
def never_updates_the_scale(model, optimizer, scaler, x, y, max_norm):
    """Scales, unscales, clips and steps, but never calls scaler.update(): the scale
    neither backs off after an overflow nor grows."""
    return _amp_step(model, optimizer, scaler, x, y, max_norm, update=False)


@mistake("autocast_step", expect="scaler.scale(loss).backward()")
def backward_outside_the_scaler(model, optimizer, scaler, x, y, max_norm):
    """Calls loss.backward() on the unscaled loss: small fp16 gradients underflow,
    and unscale_ then divides true gradients by S."""
    return _amp_step(model, optimizer, scaler, x, y, max_norm, scaled=False)


@mistake("autocast_step", expect="call scaler.step(optimizer)")
def steps_the_optimizer_itself(model, optimizer, scaler, x, y, max_norm):
    """Unscales and clips correctly, then calls optimizer.step() directly: an
    overflowed step is applied and the weights become inf."""
    return _amp_step(model, optimizer, scaler, x, y, max_norm, through_scaler=False)


@mistake("autocast_step", expect="inside torch.autocast")
def forgets_autocast(model, optimizer, scaler, x, y, max_norm):
    """Scales the loss of a plain fp32 forward: no matmul runs in 16 bits."""
    return _amp_step(model, optimizer, scaler, x, y, max_norm, dtype=None)


@mistake("autocast_step", expect="bf16 needs no GradScaler")
def autocasts_to_bf16(model, optimizer, scaler, x, y, max_norm):
    """Runs the forward in bf16, whose range needs no loss scale, under an fp16
    GradScaler loop."""
    return _amp_step(model, optimizer, scaler, x, y, max_norm, dtype=torch.bfloat16)


@mistake("autocast_step", expect="call optimizer.zero_grad()")
def never_zeroes_the_gradients(model, optimizer, scaler, x, y, max_norm):
    """Never clears .grad: each backward adds to the last step's clipped
    gradients."""
    return _amp_step(model, optimizer, scaler, x, y, max_norm, zero=False)

"""Answers written from the exercises' stubs alone, by a learner who never saw the
reference: several right ones, written differently from each other, must be accepted;
common mistakes must be rejected.

- ``torch_ddp`` (chapter 02, live on a 4-engine cluster): the solutions travel to the
  engines by value (:func:`dtlab.lab.kernel.shipping.ship_by_value`), so each imports
  what it uses inside itself.
- ``autocast_step`` (chapter 06, local).
"""

import pytest

import dtlab.exercises
from dtlab.exercises import ExerciseFailed, check_autocast_step, check_torch_ddp
from dtlab.lab.kernel.shipping import ship_by_value

# ---------------------------------------------------------------------------
# torch_ddp: right answers
# ---------------------------------------------------------------------------


def ddp_plain(model, batches, lr):
    """Textbook: DDP(model) on the default group, optim.SGD, zero_grad() (set_to_none),
    slicing by r*B//N:(r+1)*B//N, loss.item()."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        b = x.shape[0]
        lo, hi = r * b // n, (r + 1) * b // n
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[lo:hi]), y[lo:hi])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_explicit_group_chunk(model, batches, lr):
    """The WORLD group passed explicitly, bucket_cap_mb=1,
    zero_grad(set_to_none=False), the slice taken with torch.chunk, an index loop
    over batches, float(loss.detach())."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    group = dist.group.WORLD
    r = dist.get_rank(group)
    n = dist.get_world_size(group)
    net = torch.nn.parallel.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=1
    )
    optimizer = torch.optim.SGD(net.parameters(), lr)
    losses = []
    for i in range(len(batches)):
        x, y = batches[i]
        xs, ys = torch.chunk(x, n, dim=0)[r], torch.chunk(y, n, dim=0)[r]
        optimizer.zero_grad(set_to_none=False)
        out = net(xs)
        loss = F.mse_loss(out, ys)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def ddp_manual_sgd_narrow(model, batches, lr):
    """No torch.optim: the SGD update written by hand (p -= lr * grad under no_grad),
    gradients cleared by setting .grad to None; gradient_as_bucket_view=True,
    broadcast_buffers=False; the slice with Tensor.narrow; the reduction spelled
    out (reduction="mean")."""
    import torch
    import torch.distributed as dist
    from torch.nn.functional import mse_loss
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    wrapped = DistributedDataParallel(
        model, gradient_as_bucket_view=True, broadcast_buffers=False
    )
    params = [p for p in wrapped.parameters() if p.requires_grad]
    losses = []
    for x, y in iter(batches):
        per = x.size(0) // world
        xs, ys = x.narrow(0, rank * per, per), y.narrow(0, rank * per, per)
        for p in params:
            p.grad = None
        loss = mse_loss(wrapped(xs), ys, reduction="mean")
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
        losses.append(loss.item())
    return losses


def ddp_new_group_foreach(model, batches, lr):
    """A process group of its own over all ranks (dist.new_group), SGD with
    foreach=False and momentum=0 spelled out, model.zero_grad() on the wrapper,
    tensor_split for the slice, losses collected then converted at the end."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    group = dist.new_group(ranks=list(range(n)))
    r = dist.get_rank(group)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.0, foreach=False)
    kept = []
    for x, y in batches:
        xs = torch.tensor_split(x, n)[r]
        ys = torch.tensor_split(y, n)[r]
        ddp.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(xs), ys)
        loss.backward()
        opt.step()
        kept.append(loss.detach())
    return [t.item() for t in kept]


def ddp_static_graph_zero_after(model, batches, lr):
    """static_graph=True; the SGD built on the unwrapped model's parameters (the same
    tensors); the gradients cleared after each step instead of before; enumerate."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model, static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = [0.0] * len(batches)
    for step, (x, y) in enumerate(batches):
        rows = slice(r * len(x) // n, (r + 1) * len(x) // n)
        loss = torch.nn.functional.mse_loss(ddp(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.item()
    return losses


def ddp_find_unused_split(model, batches, lr):
    """find_unused_parameters=True; the slice with Tensor.split(B // N)[r]."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(params=ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        per = x.shape[0] // n
        xs, ys = x.split(per)[r], y.split(per)[r]
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(xs), ys)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------
# torch_ddp: wrong answers
# ---------------------------------------------------------------------------


def ddp_whole_batch(model, batches, lr):
    """Wrong: every rank trains on the whole global batch (never slices)."""
    import torch
    import torch.distributed as dist  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_strided_slice(model, batches, lr):
    """Wrong: a strided slice x[r::N] instead of the contiguous rows."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[r::n]), y[r::n])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_forward_through_unwrapped(model, batches, lr):
    """Wrong: wraps the model but calls the unwrapped one, so the reducer never
    all-reduces and every rank steps on its own gradients."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)  # noqa: F841
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        b = x.shape[0] // n
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(
            model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]
        )
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp_never_zeroes(model, batches, lr):
    """Wrong: never clears the gradients, so they accumulate across steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        b = x.shape[0] // n
        loss = torch.nn.functional.mse_loss(
            ddp(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b]
        )
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


DDP_RIGHT = [
    ddp_plain,
    ddp_explicit_group_chunk,
    ddp_manual_sgd_narrow,
    ddp_new_group_foreach,
    ddp_static_graph_zero_after,
    ddp_find_unused_split,
]
DDP_WRONG = [
    ddp_whole_batch,
    ddp_strided_slice,
    ddp_forward_through_unwrapped,
    ddp_never_zeroes,
]
for _solution in DDP_RIGHT + DDP_WRONG:
    ship_by_value(_solution)  # a test module the engines cannot import


@pytest.mark.cluster
@pytest.mark.parametrize("answer", DDP_RIGHT, ids=lambda f: f.__name__)
def test_torch_ddp_right_answer_accepted(answer, lab_cluster):
    report = check_torch_ddp(answer, lab_cluster(4))
    assert report.passed, report


@pytest.mark.cluster
@pytest.mark.parametrize("answer", DDP_WRONG, ids=lambda f: f.__name__)
def test_torch_ddp_wrong_answer_rejected(answer, lab_cluster):
    with pytest.raises(dtlab.exercises.ExerciseFailed) as err:
        check_torch_ddp(answer, lab_cluster(4))
    print(f"{answer.__name__}: {err.value}")


# ---------------------------------------------------------------------------
# autocast_step: right answers
# ---------------------------------------------------------------------------


def amp_plain(model, optimizer, scaler, x, y, max_norm):
    """Textbook: optimizer.zero_grad(), torch.autocast(device_type="cpu",
    dtype=float16), scale/backward, unscale_, clip_grad_norm_, scaler.step, update."""
    import torch

    optimizer.zero_grad()
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss


def amp_torch_amp_foreach(model, optimizer, scaler, x, y, max_norm):
    """torch.amp.autocast("cpu", ...), zero_grad(set_to_none=False), the clip with
    foreach=True over the optimizer's own parameters, the loss returned detached."""
    import torch
    from torch.nn.utils import clip_grad_norm_

    optimizer.zero_grad(set_to_none=False)
    with torch.amp.autocast("cpu", dtype=torch.float16):
        logits, loss = model(x, y)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    clip_grad_norm_(params, max_norm=max_norm, norm_type=2.0, foreach=True)
    scaler.step(optimizer)
    scaler.update()
    return loss.detach()


def amp_grads_none_positional(model, optimizer, scaler, x, y, max_norm):
    """Gradients cleared by hand (p.grad = None) after the forward and before the
    backward (no gradient exists in between); torch.autocast("cpu", torch.float16)
    with the dtype positional; the clip with error_if_nonfinite=False spelled out."""
    import torch

    with torch.autocast("cpu", torch.float16):
        out = model(x, y)
    loss = out[1]
    for p in model.parameters():
        p.grad = None
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None],
        max_norm,
        error_if_nonfinite=False,
    )
    scaler.step(optimizer)
    scaler.update()
    return loss


def amp_model_zero_grad_item(model, optimizer, scaler, x, y, max_norm):
    """model.zero_grad() instead of the optimizer's; autocast entered with
    enabled=True and cache_enabled spelled out; the loss returned as a Python float."""
    import torch

    model.zero_grad(set_to_none=True)
    ctx = torch.autocast(
        device_type="cpu", dtype=torch.float16, enabled=True, cache_enabled=True
    )
    with ctx:
        _logits, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), float(max_norm))
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def amp_half_alias_step_result(model, optimizer, scaler, x, y, max_norm):
    """dtype=torch.half (the alias of float16); the norm clip_grad_norm_ returns and
    scaler.step's return value kept (unused); model.parameters() listed once."""
    import torch

    params = list(model.parameters())
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type="cpu", dtype=torch.half):
        logits, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    total_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # noqa: F841
    stepped = scaler.step(optimizer)  # noqa: F841  (None when skipped)
    scaler.update()
    return loss


def amp_zero_after_update(model, optimizer, scaler, x, y, max_norm):
    """The gradients cleared at the end of the step, after update(), instead of at
    the start (the common loop idiom: nothing is left in .grad between steps)."""
    import torch

    with torch.autocast(device_type="cpu", dtype=torch.float16):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


# ---------------------------------------------------------------------------
# autocast_step: wrong answers
# ---------------------------------------------------------------------------


def amp_clip_before_unscale(model, optimizer, scaler, x, y, max_norm):
    """Wrong: clips the *scaled* gradients (no unscale_ before the clip)."""
    import torch

    optimizer.zero_grad()
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss


def amp_fresh_scaler(model, optimizer, scaler, x, y, max_norm):
    """Wrong: makes a new GradScaler every step, so the scale never carries over
    (the one passed in is ignored)."""
    import torch

    s = torch.amp.GradScaler("cpu")
    optimizer.zero_grad()
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        _, loss = model(x, y)
    s.scale(loss).backward()
    s.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    s.step(optimizer)
    s.update()
    return loss


def amp_no_zero_grad(model, optimizer, scaler, x, y, max_norm):
    """Wrong: never clears the gradients (stale .grad accumulates)."""
    import torch

    with torch.autocast(device_type="cpu", dtype=torch.float16):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss


def amp_optimizer_step_directly(model, optimizer, scaler, x, y, max_norm):
    """Wrong: optimizer.step() instead of scaler.step(optimizer): steps even on the
    overflow."""
    import torch

    optimizer.zero_grad()
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    scaler.update()
    return loss


def amp_no_autocast(model, optimizer, scaler, x, y, max_norm):
    """Wrong: forgets the autocast context; the forward runs in fp32."""
    import torch

    optimizer.zero_grad()
    _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss


AMP_RIGHT = [
    amp_plain,
    amp_torch_amp_foreach,
    amp_grads_none_positional,
    amp_model_zero_grad_item,
    amp_half_alias_step_result,
    amp_zero_after_update,
]
AMP_WRONG = [
    amp_clip_before_unscale,
    amp_fresh_scaler,
    amp_no_zero_grad,
    amp_optimizer_step_directly,
    amp_no_autocast,
]


@pytest.mark.parametrize("answer", AMP_RIGHT, ids=lambda f: f.__name__)
def test_autocast_step_right_answer_accepted(answer):
    report = check_autocast_step(answer)
    assert report.passed, report


@pytest.mark.parametrize("answer", AMP_WRONG, ids=lambda f: f.__name__)
def test_autocast_step_wrong_answer_rejected(answer):
    with pytest.raises(ExerciseFailed) as err:
        check_autocast_step(answer)
    print(f"{answer.__name__}: {err.value}")

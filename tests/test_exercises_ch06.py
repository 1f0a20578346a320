"""Chapter 06's framework exercise, one step of ``torch.autocast`` +
``torch.amp.GradScaler``, is proven like the others in tests/test_exercises.py (its
reference accepted, every wrong step of its catalogue rejected with the message the
catalogue names); here, right steps written differently are accepted.

Beyond the catalogue: the step the checker forces to overflow really is skipped by
GradScaler and its schedule is dtlab's :class:`~dtlab.amp.LossScaler` rule, a stub
is "not attempted yet", and under the test command's switch the reference runs in
its place.
"""

import pytest
import torch

from dtlab import amp, exercises
from dtlab.exercises import REGISTRY
from dtlab.exercises import ch06_mixed_precision as ch06


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the engines and in the chapter
    yield
    torch.set_num_threads(threads)


def test_the_framework_exercise_is_local_with_its_catalogue():
    ex = REGISTRY["autocast_step"]
    assert ex.chapter == 6 and ex.local and ex.measures
    assert len(ex.mistakes) >= 4 and all(m.why for m in ex.mistakes)
    assert ex.checker is ch06.check_autocast_step
    assert exercises.check_autocast_step is ch06.check_autocast_step


# ---- right steps, written differently from the reference ---------------------------
def zeroes_after_the_step(model, optimizer, scaler, x, y, max_norm):
    """The gradients cleared at the end of the step (the first step has none)."""
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = model(x, y)[1]
        scaler.scale(loss).backward()  # backward inside autocast: the same ops
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.item()


def zeroes_to_zero_and_clips_by_hand(model, optimizer, scaler, x, y, max_norm):
    """zero_grad(set_to_none=False), and clip_grad_norm_'s rule written out."""
    model.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef)
    scaler.step(optimizer)
    scaler.update()
    return loss


@pytest.mark.parametrize(
    "right", [zeroes_after_the_step, zeroes_to_zero_and_clips_by_hand]
)
def test_checker_accepts_right_steps_written_differently(right):
    assert exercises.check_autocast_step(right).passed


def test_the_forced_overflow_is_skipped_and_the_schedule_is_loss_scalers():
    rig = ch06._Rig()
    data = ch06.SyntheticTokens(64, 32)
    scales = []
    for t in range(ch06.AMP_STEPS):
        rig.step = t
        before = len(rig.optimizer.stepped)
        REGISTRY["autocast_step"].reference(
            rig.model, rig.optimizer, rig.scaler, *data.batch(t, 8), ch06.MAX_NORM
        )
        stepped = len(rig.optimizer.stepped) - before
        assert stepped == (0 if t == ch06.OVERFLOW_AT else 1), t
        scales.append(rig.scaler.get_scale())
    scaler = amp.LossScaler(init_scale=ch06.AMP_INIT_SCALE, growth_interval=1)
    for t in range(ch06.AMP_STEPS):
        scaler.update(t == ch06.OVERFLOW_AT)
        assert scales[t] == scaler.scale_value, (t, scales)
    assert all(torch.isfinite(p).all() for p in rig.model.parameters())


def stub_step(model, optimizer, scaler, x, y, max_norm):
    """Your step."""
    raise NotImplementedError


def test_a_stub_is_not_attempted_and_substituted_under_the_switch(monkeypatch):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    assert exercises.check_autocast_step(stub_step).status == "not attempted yet"
    monkeypatch.setenv(exercises.SUBSTITUTE_ENV, "1")
    report = exercises.check_autocast_step(stub_step)
    assert report.status == "reference substituted" and report.lines

"""Chapter 06's exercises: a loss scaler whose found-inf is agreed across ranks,
fp16 versus bf16 underflow, and one step of PyTorch's own mixed-precision loop.

1. ``loss_scaler``: every rank replays the same run of steps with its own
   gradients, scaled by the current loss scale; at some steps the checker puts an
   inf (or a nan) into ONE rank's gradients only, a different rank and tensor each
   time. Every rank must return the same verdict at every step (the one that holds
   when any rank overflowed), the scale must follow :class:`dtlab.amp.LossScaler`'s
   rule step by step, clean steps' gradients must come out unscaled, and the comm
   events must show the agreement: one small all-reduce a step.
2. ``underflow``: the learner's share of gradients flushed to zero, against casting
   them, for fp16 and bf16 at several loss scales, on magnitudes spread over
   fourteen decades (and a few zeros, which do not count).
3. ``autocast_step``: the learner's step of the ``torch.autocast`` +
   ``torch.amp.GradScaler`` loop, run for a few steps in lockstep with the
   reference on an identical fp32 GPT, with an inf forced into one gradient at one
   step. Judged from what the step really did: the output dtype of a linear layer
   (autocast on, in fp16), what the gradients looked like when backward produced
   them (S times the true ones) and when the optimizer was asked to step (unscaled,
   then clipped; no step at all on the overflow), stale gradients left from the
   step before, the scale after each step (backed off after the overflow, grown
   after clean ones), and the loss.
"""

from __future__ import annotations

import torch

from dtlab import amp
from dtlab.exercises.ch06_solutions import (
    autocast_step,
    scaler_step,
    underflow_fraction,
)
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.watch import Watch
from dtlab.model import GPT, GPTConfig, SyntheticTokens, param_generator

__all__ = ["check_loss_scaler", "check_underflow", "check_autocast_step"]

STEPS, GROWTH_INTERVAL = 14, 3
OVERFLOWS = {2: "inf", 6: "nan", 7: "inf", 12: "inf"}  # step -> what one rank gets
SHAPES = ((5,), (3, 4), (7,))


def _initial_state() -> dict:
    return {
        "scale": 2.0**10,
        "clean_steps": 0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": GROWTH_INTERVAL,
    }


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    gen = param_generator(0, f"scaler/{step}/{rank}")
    return [torch.randn(*shape, generator=gen) for shape in SHAPES]


def _culprit(step: int, n: int) -> tuple[int, int]:
    """(rank, tensor) that overflows at ``step``: a different one each time."""
    return step % n, step % len(SHAPES)


def probe_scaler(solution) -> dict:
    r, n = rank_and_size()
    state = _initial_state()
    steps = []
    forbidden = {
        amp.LossScaler: "dtlab.amp.LossScaler",
        torch.amp.GradScaler: "torch.amp.GradScaler",
    }
    with Watch(forbidden) as seen:
        for t in range(STEPS):
            true = _grads(t, r)
            grads = [g * state["scale"] for g in true]
            if t in OVERFLOWS and _culprit(t, n)[0] == r:
                grads[_culprit(t, n)[1]][0] = float(OVERFLOWS[t])
            scale_before = state["scale"]
            launched = len(seen.launches)
            verdict = bool(solution(grads, state))
            unscaled = all(torch.allclose(g, w, rtol=1e-6) for g, w in zip(grads, true))
            steps.append(
                {
                    "verdict": verdict,
                    "scale": state["scale"],
                    "unscaled": verdict or unscaled,
                    "scale_before": scale_before,
                    "ops": [(e["op"], e["bytes"]) for e in seen.launches[launched:]],
                }
            )
    return {"steps": steps, "forbidden": seen.forbidden}


def _reference_scales(n: int) -> list[float]:
    scaler = amp.LossScaler(init_scale=2.0**10, growth_interval=GROWTH_INTERVAL)
    out = []
    for t in range(STEPS):
        scaler.update(t in OVERFLOWS)
        out.append(scaler.scale_value)
    return out


@exercise(
    "loss_scaler",
    chapter=6,
    reference=scaler_step,
    measures=(
        "an inf/nan on ONE rank only: every rank returns the same verdict every "
        "step (true when any rank overflowed); one small all_reduce per step; scale "
        "== amp.LossScaler's rule for 14 steps; clean steps' grads unscaled"
    ),
)
def check_loss_scaler(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_scaler, solution)
    want_scales = _reference_scales(n)
    for r, rep in enumerate(reports):
        if rep["forbidden"]:
            raise ExerciseFailed(
                f"rank {r}: you called {', '.join(rep['forbidden'])}: write the "
                "scaler's step yourself."
            )
    for t in range(STEPS):  # first of all: do the ranks agree?
        verdicts = [rep["steps"][t]["verdict"] for rep in reports]
        if len(set(verdicts)) > 1:
            skipped = [r for r, v in enumerate(verdicts) if v]
            raise ExerciseFailed(
                f"step {t}: the ranks disagree: rank(s) {skipped} skip the step, the "
                f"others step (only rank {_culprit(t, n)[0]} had an "
                f"{OVERFLOWS.get(t, 'inf')}). Their replicas diverge, and under ZeRO "
                "or TP they would call different collectives and hang. Agree on "
                "found-inf: all-reduce the flag with MAX across ranks."
            )
    for t in range(STEPS):
        verdict, overflow = reports[0]["steps"][t]["verdict"], t in OVERFLOWS
        culprit, tensor = _culprit(t, n)
        if verdict != overflow:
            raise ExerciseFailed(
                f"step {t}: every rank returned found_inf={verdict}, but "
                + (
                    f"rank {culprit} had an {OVERFLOWS[t]} in gradient {tensor}: "
                    "check every gradient with torch.isfinite (an inf and a nan)."
                    if overflow
                    else "no rank overflowed."
                )
            )
        for r, rep in enumerate(reports):
            step = rep["steps"][t]
            if not step["ops"]:
                raise ExerciseFailed(
                    f"step {t}, rank {r}: no collective, yet the verdict must be "
                    "the same on every rank: all-reduce the found-inf flag (MAX)."
                )
            if len(step["ops"]) > 1 or step["ops"][0][1] > 64:
                big = max(b for _, b in step["ops"]) > 64
                what = "the gradients" if big else "a flag per tensor"
                raise ExerciseFailed(
                    f"step {t}, rank {r} ran {step['ops']}: {what} all-reduced. The "
                    "agreement needs one all-reduce of one flag for all gradients."
                )
            if not step["unscaled"]:
                raise ExerciseFailed(
                    f"step {t}, rank {r}: the gradients are not unscaled: divide "
                    f"them by the scale ({step['scale_before']:g}) in place."
                )
            if step["scale"] != want_scales[t]:
                raise ExerciseFailed(
                    f"step {t}: the scale is {step['scale']:g} after "
                    f"{'an overflow' if overflow else 'a clean step'}, expected "
                    f"{want_scales[t]:g}. An overflow multiplies it by "
                    "backoff_factor and restarts the count of clean steps; "
                    "growth_interval clean steps in a row multiply it by "
                    "growth_factor."
                )
    return [
        f"every rank agreed at every one of {STEPS} steps, one rank overflowing at "
        f"{len(OVERFLOWS)} of them",
        "one one-element all-reduce per step; the scale followed amp.LossScaler",
    ]


# ---- 2. underflow ------------------------------------------------------------------
CASES = (
    (torch.float16, 1.0),
    (torch.float16, 2.0**10),
    (torch.float16, 2.0**16),
    (torch.bfloat16, 1.0),
)


def hidden_gradients() -> torch.Tensor:
    """Magnitudes from 1e-14 to 1, log-uniform, random signs, a few exact zeros
    and values right at fp16's edges."""
    gen = param_generator(0, "underflow")
    exponent = torch.rand(4000, generator=gen) * 14 - 14  # 1e-14 … 1
    sign = torch.where(torch.rand(4000, generator=gen) < 0.5, -1.0, 1.0)
    g = sign * 10.0**exponent
    g[:10] = 0.0
    g[10:14] = torch.tensor([2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14])
    return g


TOLERANCE = 1e-6  # one value of the 4000 is 2.5e-4: a float32 mean is fine


def _share(flushed: torch.Tensor, of: torch.Tensor) -> float:
    return (flushed & of).sum().item() / max(1, of.sum().item())


HINTS = {
    "scale": "The loss scale multiplies every gradient before the cast: apply it.",
    "bf16": "Bf16 keeps fp32's 8 exponent bits: its smallest values are near "
    "1e-38, far below fp16's.",
    "subnormal": "Values below 2⁻¹⁴ are subnormal, not zero: fp16 keeps them, "
    "with fewer bits, down to 2⁻²⁴.",
    "zeros": "Count a share of the nonzero gradients: an exact zero was never a "
    "gradient to lose.",
    "cast": "Cast (g · scale).to(dtype) and count the nonzero values that became "
    "0 (round to nearest: anything above 2⁻²⁵ rounds up to 2⁻²⁴).",
    "tie": "Exactly 2⁻²⁵ is halfway between 0 and 2⁻²⁴: round to nearest even "
    "takes it to 0, so it is lost too.",
    "percent": "That is the percentage: return the share itself, from 0 to 1.",
}


def _diagnose(got: float, g: torch.Tensor, dtype, scale: float) -> str:
    nonzero = g != 0
    scaled = g * scale
    alternatives = {"percent": 100 * underflow_fraction(g, dtype, scale)}
    if dtype == torch.bfloat16:
        alternatives["bf16"] = underflow_fraction(g, torch.float16, scale)
    else:
        alternatives.update(
            scale=underflow_fraction(g, dtype, 1.0),
            subnormal=_share(scaled.abs() < 2.0**-14, nonzero),
            zeros=_share(scaled.to(dtype) == 0, torch.ones_like(nonzero)),
            tie=_share(scaled.abs() < 2.0**-25, nonzero),
        )
    for key, value in alternatives.items():
        if abs(got - value) < TOLERANCE * max(1.0, value):
            return HINTS[key]
    return HINTS["cast"]


@exercise(
    "underflow",
    chapter=6,
    reference=underflow_fraction,
    local=True,
    measures=(
        "the share of nonzero gradients flushed to zero, == casting, for fp16 at "
        "scales 1, 2¹⁰, 2¹⁶ and bf16, on hidden magnitudes over 14 decades"
    ),
)
def check_underflow(solution, cluster=None):
    g = hidden_gradients()
    for dtype, scale in CASES:
        got = float(attempt(solution, g.clone(), dtype, scale))
        want = underflow_fraction(g, dtype, scale)
        if abs(got - want) > TOLERANCE:
            name = str(dtype).replace("torch.", "")
            raise ExerciseFailed(
                f"{name} at loss scale {scale:g}: you say {got:.4f}, casting says "
                f"{want:.4f}. {_diagnose(got, g, dtype, scale)}"
            )
    return [f"the flushed share is right for {len(CASES)} (precision, scale) pairs"]


# ---- 3. autocast_step --------------------------------------------------------------
# A GradScaler that grows after every clean step (growth_interval 1), so that one
# step already shows whether the scale was updated; an inf forced into one gradient
# at step OVERFLOW_AT. SGD, not Adam: Adam's update hardly depends on the
# gradients' size, so a clip by the wrong factor would go almost unseen.
AMP_STEPS, OVERFLOW_AT, AMP_INIT_SCALE, MAX_NORM, AMP_LR = 5, 2, 2.0**10, 0.25, 0.05
AMP_BATCH = 8


class _WatchedSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients each time it is asked to step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.stepped: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        self.stepped.append(
            [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        )
        return super().step(closure)


class _Rig:
    """An fp32 GPT, its optimizer and scaler, with hooks that see the step: the
    dtype a linear layer computed in, the gradients as backward hands them over
    (before they are added to ``.grad``) and whether ``.grad`` still held the last
    step's."""

    def __init__(self):
        self.model = GPT(GPTConfig(), seed=0)
        self.optimizer = _WatchedSGD(self.model.parameters(), lr=AMP_LR)
        self.scaler = torch.amp.GradScaler(
            "cpu", init_scale=AMP_INIT_SCALE, growth_interval=1
        )
        # GradScaler makes its scale tensor on the first scale(): made now, so that
        # a step that never scales its loss is judged, not refused by an assert
        self.scaler.scale(torch.zeros(()))
        self.step, self.dtypes, self.arrived, self.stale = 0, {}, {}, set()
        self.model.blocks[0].mlp.fc.register_forward_hook(self._saw_forward)
        params = list(self.model.parameters())
        for i, p in enumerate(params):
            p.register_hook(self._arriving(p, overflow=i == 0))

    def _saw_forward(self, module, args, out):
        self.dtypes.setdefault(self.step, out.dtype)

    def _arriving(self, p, overflow):
        def hook(grad):
            t = self.step
            if p.grad is not None and bool(p.grad.ne(0).any()):
                self.stale.add(t)
            self.arrived[t] = self.arrived.get(t, 0.0) + grad.double().pow(2).sum()
            if overflow and t == OVERFLOW_AT:
                return grad + float("inf")  # what an fp16 overflow leaves
            return None

        return hook


def _norm(grads) -> float:
    return float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))


def _close(a: float, b: float, rtol: float = 1e-3) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _judge_step(t, mine: _Rig, ref: _Rig, scale: float, calls: int, losses):
    overflow = t == OVERFLOW_AT
    dtype = mine.dtypes.get(t)
    if dtype is None:
        raise ExerciseFailed(f"step {t}: the model's forward never ran.")
    if dtype != torch.float16:
        how = (
            "bf16 needs no GradScaler; this loop is fp16's: "
            'torch.autocast("cpu", dtype=torch.float16)'
            if dtype == torch.bfloat16
            else 'run the forward inside torch.autocast("cpu", dtype=torch.float16)'
        )
        raise ExerciseFailed(
            f"step {t}: the linear layers computed in {str(dtype)[6:]}, so autocast "
            f"was not on in fp16: {how}."
        )
    if t in mine.stale:
        raise ExerciseFailed(
            f"step {t}: backward added this step's gradients to step {t - 1}'s, still "
            "in .grad: call optimizer.zero_grad() before the forward."
        )
    arrived = float(mine.arrived.get(t, 0.0)) ** 0.5
    true = float(ref.arrived[t]) ** 0.5 / scale  # the reference scaled by `scale`
    if arrived == 0.0:
        raise ExerciseFailed(f"step {t}: no gradient arrived: call backward.")
    if not _close(arrived, true * scale):
        hint = (
            "backward ran on the unscaled loss, so small fp16 gradients underflow "
            "and unscale_ then divides true gradients by S: call "
            "scaler.scale(loss).backward()"
            if _close(arrived, true)
            else f"expected {scale:g} times the true gradients: scale the loss "
            "with the scaler you were given (a GradScaler of your own starts at "
            "its own scale and never learns of this run's overflows)"
        )
        raise ExerciseFailed(
            f"step {t}: the gradients arrived at {arrived / true:.4g}× the true "
            f"ones, at scale {scale:g}: {hint}."
        )
    calls = len(mine.optimizer.stepped) - calls
    if overflow and calls:
        raise ExerciseFailed(
            f"step {t}: a gradient was inf, and the optimizer stepped anyway (the "
            "weights are now inf): call scaler.step(optimizer), which skips the "
            "step when unscale_ found an inf or a nan."
        )
    if not overflow and calls != 1:
        raise ExerciseFailed(
            f"step {t}: the optimizer stepped {calls} times on a clean step, "
            "expected once: scaler.step(optimizer)."
        )
    if not overflow:
        got, want = mine.optimizer.stepped[-1], ref.optimizer.stepped[-1]
        n_got, n_want = _norm(got), _norm(want)
        if not all(
            torch.allclose(g, w, rtol=1e-4, atol=1e-8) for g, w in zip(got, want)
        ):
            if _close(n_got * scale, n_want, 1e-2):
                why = (
                    "clipping saw the scaled gradients (S times too large), so they "
                    f"were cut to {MAX_NORM:g}/S once unscaled: call "
                    "scaler.unscale_(optimizer) before clip_grad_norm_"
                )
            elif n_got > MAX_NORM * 1.001:
                why = (
                    f"they were not clipped to max_norm = {MAX_NORM:g}: "
                    "scaler.unscale_(optimizer), then "
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)"
                )
            else:
                why = "they differ from the reference loop's"
            raise ExerciseFailed(
                f"step {t}: the optimizer stepped on gradients of norm {n_got:.4g} "
                f"(the true, clipped ones: {n_want:.4g}): {why}."
            )
    got, want = mine.scaler.get_scale(), ref.scaler.get_scale()
    if got != want:
        what = "an overflow" if overflow else "a clean step"
        hint = (
            "call scaler.update() once per step, after scaler.step(optimizer)"
            if got == scale
            else "let scaler.update() alone change the scale"
        )
        raise ExerciseFailed(
            f"step {t}: after {what} the scale is {got:g}, expected {want:g} "
            f"(backed off on an inf, grown after clean steps): {hint}."
        )
    mine_loss, ref_loss = losses
    if not _close(mine_loss, ref_loss, 1e-5):
        raise ExerciseFailed(
            f"step {t}: your step returned the loss {mine_loss:.6f}, the reference "
            f"loop {ref_loss:.6f}: return the loss of this step's forward."
        )


def _loss_scaler_schedule() -> list[float]:
    """dtlab's LossScaler under the same settings and the same overflow."""
    scaler = amp.LossScaler(init_scale=AMP_INIT_SCALE, growth_interval=1)
    out = []
    for t in range(AMP_STEPS):
        scaler.update(t == OVERFLOW_AT)
        out.append(scaler.scale_value)
    return out


@exercise(
    "autocast_step",
    chapter=6,
    reference=autocast_step,
    local=True,
    measures=(
        "5 steps in lockstep with the reference on an fp32 GPT, an inf forced at "
        "step 2: fp16 linear layers (autocast on); gradients S× the true ones in "
        "backward; no optimizer step on the overflow, the scale backed off; clip "
        "on unscaled gradients; no stale .grad; scales and losses == the reference"
    ),
)
def check_autocast_step(solution, cluster=None):
    torch.manual_seed(0)
    mine, ref = _Rig(), _Rig()
    data = SyntheticTokens(GPTConfig().vocab_size, GPTConfig().seq_len)
    scales, losses = [], []
    for t in range(AMP_STEPS):
        x, y = data.batch(t, AMP_BATCH)  # (8, T)
        mine.step = ref.step = t
        scale, calls = mine.scaler.get_scale(), len(mine.optimizer.stepped)
        got = attempt(solution, mine.model, mine.optimizer, mine.scaler, x, y, MAX_NORM)
        want = autocast_step(ref.model, ref.optimizer, ref.scaler, x, y, MAX_NORM)
        try:
            got = float(got.detach() if torch.is_tensor(got) else got)
        except (TypeError, ValueError, RuntimeError):
            raise ExerciseFailed(
                f"step {t}: your step returned {got!r}: return the loss."
            ) from None
        _judge_step(t, mine, ref, scale, calls, (got, float(want.detach())))
        scales.append(mine.scaler.get_scale())
        losses.append(got)
    norms = [_norm(g) for g in mine.optimizer.stepped]
    if scales != _loss_scaler_schedule():  # the library's rule is GradScaler's
        raise RuntimeError(f"GradScaler's schedule {scales} is not LossScaler's")
    half = GPT(GPTConfig(), seed=0).to(torch.float16)
    with torch.no_grad():
        dtlab_loss = float(half(*data.batch(0, AMP_BATCH))[1])
    return [
        f"the linear layers ran in fp16 under autocast; backward saw S× the true "
        f"gradients at every one of {AMP_STEPS} steps",
        f"the overflow at step {OVERFLOW_AT} was skipped and the scale backed off "
        f"({AMP_INIT_SCALE * 2**OVERFLOW_AT:g} → {scales[OVERFLOW_AT]:g}); the "
        "schedule is dtlab's LossScaler rule",
        f"clip_grad_norm_ saw unscaled gradients: norm {max(norms):.3g} ≤ "
        f"{MAX_NORM:g} at every step taken",
        f"losses == the reference loop's; the first, {losses[0]:.5f}, is within "
        f"{abs(losses[0] - dtlab_loss) / dtlab_loss:.1e} (relative) of dtlab's "
        "fp16 policy",
    ]

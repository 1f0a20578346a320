"""Chapter 06's exercises: a loss scaler whose found-inf is agreed across ranks, and
fp16 versus bf16 underflow.

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
"""

from __future__ import annotations

import torch

from dtlab import amp
from dtlab.exercises.ch06_solutions import scaler_step, underflow_fraction
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.watch import Watch
from dtlab.model import param_generator

__all__ = ["check_loss_scaler", "check_underflow"]

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
                raise ExerciseFailed(
                    f"step {t}, rank {r} ran {step['ops']}: the agreement needs one "
                    "all-reduce of a one-element flag, not of the gradients."
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
}


def _diagnose(got: float, g: torch.Tensor, dtype, scale: float) -> str:
    nonzero = g != 0
    scaled = g * scale
    alternatives = {
        "scale": underflow_fraction(g, dtype, 1.0),
        "subnormal": _share(scaled.abs() < 2.0**-14, nonzero),
        "zeros": _share(scaled.to(dtype) == 0, torch.ones_like(nonzero)),
    }
    if dtype == torch.bfloat16:
        alternatives = {"bf16": underflow_fraction(g, torch.float16, scale)}
    for key, value in alternatives.items():
        if abs(got - value) < TOLERANCE:
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

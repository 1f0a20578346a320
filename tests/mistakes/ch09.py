"""The mistakes learners make in chapter 09's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it).

The step-time model's mistakes start from the reference and get one part wrong."""

from __future__ import annotations

from dtlab.exercises import ch09_planning  # noqa: F401 - declares the exercises
from dtlab.exercises.ch09_solutions import step_time
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- step_time ---------------------------------------------------------------------
@mistake("step_time", expect="bubble_s is 0")
def forgets_the_bubble(model, layout, **knobs):
    """m(t_f + t_b): as if the pipeline were always full."""
    out = step_time(model, layout, **knobs)
    out["step_s"] -= out["bubble_s"]
    out["bubble_s"] = 0.0
    return out


@mistake("step_time", expect="tp_s is")
def counts_the_forward_collectives_only(model, layout, **knobs):
    """Two tp collectives per layer, the forward's, where backward has two more."""
    out = step_time(model, layout, **knobs)
    out["step_s"] -= out["tp_s"] / 2
    out["tp_s"] /= 2
    return out


@mistake("step_time", expect="dp_s is")
def overlaps_nothing(model, layout, **knobs):
    """Every byte of the data-parallel collectives exposed, none behind backward."""
    return step_time(model, layout, **{**knobs, "dp_overlap": 0.0})


@mistake("step_time", expect="compute_s is")
def forgets_to_split_compute_by_tp(model, layout, **knobs):
    """Each rank computing the whole layer, as if tensor parallelism saved nothing."""
    out = step_time(model, layout, **knobs)
    extra = out["compute_s"] * (layout.tp - 1)
    out["compute_s"] += extra
    out["step_s"] += extra
    return out


@mistake("step_time", expect="pp_s is")
def sends_whole_activations_under_sp(model, layout, **knobs):
    """Under sequence parallelism each tp rank sends only its T/t of the
    activation to the next stage; this one sends all of it."""
    out = step_time(model, layout, **knobs)
    if knobs["sequence_parallel"]:
        extra = out["pp_s"] * (layout.tp - 1)
        out["pp_s"] += extra
        out["step_s"] += extra
    return out


# ---- zero_states -------------------------------------------------------------------
def _states(psi, n, *, params_from=3, grads_from=2, optimizer_from=1, k=8):
    return lambda stage: {
        "params": 4 * psi // (n if stage >= params_from else 1),
        "grads": 4 * psi // (n if stage >= grads_from else 1),
        "optimizer": k * psi // (n if stage >= optimizer_from else 1),
    }


@mistake("zero_states", expect="ZeRO-1, rank 0, grads")
def shards_gradients_from_stage_one(psi, n, stage):
    """ZeRO-1 shards only the optimizer state; the full gradient is still held."""
    return _states(psi, n, grads_from=1)(stage)


@mistake("zero_states", expect="ZeRO-0, rank 0, optimizer")
def counts_mixed_precision_adam(psi, n, stage):
    """K = 12 (fp32 master + moments, mixed precision) for an fp32 run, whose
    weights are their own master: 8 bytes of moments."""
    return _states(psi, n, k=12)(stage)


@mistake("zero_states", expect="ZeRO-3, rank 0, params")
def never_shards_the_weights(psi, n, stage):
    """Forgets that stage 3 shards the weights too."""
    return _states(psi, n, params_from=4)(stage)


@mistake("zero_states", expect="ZeRO-2, rank 0, grads")
def shards_gradients_only_at_stage_three(psi, n, stage):
    """Takes ZeRO-2 for ZeRO-1 with more communication: full gradients kept."""
    return _states(psi, n, grads_from=3)(stage)

"""The mistakes learners make in chapter 10's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it).

The drill's mistakes start from the model answers and get one thing wrong the way
answers in interviews do."""

from __future__ import annotations

from dtlab.exercises import ch10_drill  # noqa: F401 - declares the exercises
from dtlab.exercises.ch10_solutions import drill_answers
from dtlab.exercises.grading import mistake

__all__: list[str] = []


# ---- ddp_wire_bytes ----------------------------------------------------------------
@mistake("ddp_wire_bytes", expect="too few")
def sends_the_model_once(n_params, world_size, bytes_per_grad=4):
    """Ψ·bytes: forgets that an all-reduce is two passes (reduce-scatter and
    all-gather)."""
    return n_params * bytes_per_grad


@mistake("ddp_wire_bytes", expect="too many")
def forgets_the_ring_factor(n_params, world_size, bytes_per_grad=4):
    """2Ψ·bytes exactly: right for large N, wrong by N/(N−1) (2× on 2 GPUs)."""
    return 2 * n_params * bytes_per_grad


@mistake("ddp_wire_bytes", expect="too many")
def sends_to_every_other_rank(n_params, world_size, bytes_per_grad=4):
    """2(N−1)·Ψ: the ring's steps counted, each with the whole tensor."""
    return 2 * (world_size - 1) * n_params * bytes_per_grad


@mistake("ddp_wire_bytes", expect="too few")
def counts_the_reduce_scatter_only(n_params, world_size, bytes_per_grad=4):
    """(N−1)/N·Ψ: the reduce-scatter half of the all-reduce alone."""
    return (world_size - 1) / world_size * n_params * bytes_per_grad


# ---- drill -------------------------------------------------------------------------
@mistake("drill", expect="missing:")
def answers_in_one_line():
    """Right in spirit, without the facts and numbers an interviewer listens for."""
    return {key: "It shards things and communicates." for key in drill_answers()}


@mistake("drill", expect="against pure bf16 (8 B) it is +8")
def says_mixed_precision_costs_four_bytes():
    """The old chapter 10 table: "4 extra bytes a parameter"."""
    answers = drill_answers()
    answers["mixed_precision"] += " Mixed precision costs 4 extra bytes a parameter."
    return answers


@mistake("drill", expect="p − stage − 1 forwards")
def warms_up_with_p_minus_one():
    """The old drill card: every stage warms up with p − 1 forwards."""
    answers = drill_answers()
    answers["one_f_one_b"] = answers["one_f_one_b"].replace(
        "Stage i of p warms up with p - i - 1 forwards",
        "Each stage warms up with p - 1 forwards",
    )
    return answers


@mistake("drill", expect="13B on a single V100, not 10B")
def offloads_ten_billion():
    """The old chapter 03 figure: "about 10B on a single GPU"."""
    answers = drill_answers()
    answers["zero_stages/offload"] = answers["zero_stages/offload"].replace(
        "a 13B model", "a 10B model"
    )
    return answers


@mistake("drill", expect="no answer (follow-ups are part of the drill)")
def skips_the_follow_ups():
    """Answers the cards and leaves every follow-up out."""
    return {k: v for k, v in drill_answers().items() if "/" not in k}

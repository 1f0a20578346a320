"""The mistakes learners make in chapter 10's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it).

The drill's mistakes start from the reference answers and get one thing wrong the
way answers in interviews do."""

from __future__ import annotations

from dtlab.exercises import ch10_drill  # declares the exercises
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
def _with(card: str, **parts) -> dict:
    answers = drill_answers()
    answers[card] = {**answers[card], **parts}
    return answers


@mistake("drill", expect="bytes_n8: ✗ off: 1.1× the right value, too high")
def says_two_psi_on_eight_gpus():
    """2Ψ·2 bytes = 28 GB on 8 GPUs: the large-N answer, 8/7 too many."""
    return _with("ddp_traffic", bytes_n8="28 GB")


@mistake("drill", expect="slow_link: ✗ wrong unit: '1.96 GB' is bytes")
def answers_a_time_in_bytes():
    """The right digits in the wrong unit: a time written in GB."""
    return _with("ddp_traffic", slow_link="1.96 GB")


@mistake("drill", expect="stage2_shards: ✗ 1 missing, 0 extra")
def stage_two_shards_only_the_optimizer():
    """ZeRO-2 answered like ZeRO-1: the gradients forgotten."""
    return _with("zero_stages", stage2_shards=["optimizer states"])


@mistake("drill", expect="misconception '(N−1)·Ψ values'")
def sends_to_every_peer():
    """The ring's steps counted with the whole tensor each: (N−1)·Ψ."""
    return _with("ddp_traffic", per_gpu=["(N−1)·Ψ values"])


@mistake("drill", expect="misconception 'p − 1 forwards'")
def warms_up_with_p_minus_one():
    """The old drill card: every stage warms up with p − 1 forwards."""
    return _with("one_f_one_b", warm_up=["p − 1 forwards"])


@mistake("drill", expect="could not read")
def pastes_the_feedback_back():
    """Each part answered with the feedback a wrong answer earned."""
    card = next(c for c in ch10_drill.drill_cards() if c.key == "zero_stages")
    feedback = card.grade({"stage1": "1 GB"}).feedback()
    return _with("zero_stages", **{p.name: feedback for p in card.parts})


@mistake("drill", expect="ddp_traffic: no answer")
def skips_a_card():
    """Four cards answered, the DDP one left out."""
    answers = drill_answers()
    del answers["ddp_traffic"]
    return answers

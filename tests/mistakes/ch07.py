"""The mistakes learners make in chapter 07's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it).

The layout defence's mistakes start from the reference's answer and get one number
wrong the way a learner does (or the plan itself)."""

from __future__ import annotations

from dtlab.exercises import ch07_layouts  # noqa: F401 - declares the exercises
from dtlab.exercises.ch07_solutions import defend_layout
from dtlab.exercises.grading import mistake
from dtlab.topology import Layout

__all__: list[str] = []


# ---- layout_defence ----------------------------------------------------------------
@mistake("layout_defence", expect="memory per GPU, params")
def forgets_the_pipeline_split():
    """Divides the model states by tp only: every stage is counted as holding all
    80 layers."""
    plan = defend_layout()
    for k in ("params", "grads", "optimizer"):
        plan["memory_GB"][k] *= plan["layout"].pp
    return plan


@mistake("layout_defence", expect="memory per GPU, activations")
def holds_one_microbatch():
    """Activations of one microbatch in flight, as without a pipeline: 1F1B's
    first stage holds p of them."""
    plan = defend_layout()
    plan["memory_GB"]["activations"] /= plan["layout"].pp
    return plan


@mistake("layout_defence", expect="on tp")
def counts_only_the_forward_all_reduces():
    """Two all-reduces per layer, the forward's: the backward's two are forgotten."""
    plan = defend_layout()
    plan["wire_GB"]["tp"] /= 2
    return plan


@mistake("layout_defence", expect="on dp")
def counts_ddp_traffic_at_dp_one():
    """Puts DDP's 2Ψ of gradient traffic on a data-parallel group of one rank."""
    plan = defend_layout()
    plan["wire_GB"]["dp"] = 2 * plan["memory_GB"]["grads"]
    return plan


@mistake("layout_defence", expect="the bubble")
def bubble_over_m():
    """The bubble as (p − 1)/m, the ratio to the useful time, not the fraction
    of the step (p − 1)/(m + p − 1)."""
    plan = defend_layout()
    m = 256 // (plan["layout"].dp * plan["micro_batch_size"])
    plan["bubble"] = (plan["layout"].pp - 1) / m
    return plan


@mistake("layout_defence", expect="crosses nodes")
def spreads_tp_over_two_nodes():
    """tp = 16 to cut the pipeline: every layer's collectives cross InfiniBand."""
    plan = defend_layout()
    plan["layout"] = Layout(dp=1, tp=16, pp=4)
    return plan


# ---- rank_order --------------------------------------------------------------------
@mistake("rank_order", expect="tp varies fastest")
def dp_varies_fastest(rank, dp, tp, pp):
    """dp fastest: a tp group's ranks land on different nodes."""
    return {"dp": rank % dp, "tp": (rank // dp) % tp, "pp": rank // (dp * tp)}


@mistake("rank_order", expect="tp varies fastest")
def pp_varies_fastest(rank, dp, tp, pp):
    """The order reversed: pp fastest, tp slowest."""
    return {"pp": rank % pp, "dp": (rank // pp) % dp, "tp": rank // (pp * dp)}


@mistake("rank_order", expect="Megatron's order says")
def takes_dp_modulo_tp(rank, dp, tp, pp):
    """``(rank // tp) % tp`` for dp: right whenever dp == tp, wrong otherwise."""
    return {"tp": rank % tp, "dp": (rank // tp) % tp, "pp": rank // (tp * dp)}


@mistake("rank_order", expect="return a dict")
def returns_a_tuple(rank, dp, tp, pp):
    """The right numbers as a tuple: the checker cannot tell which is which."""
    return (rank // (tp * dp), (rank // tp) % dp, rank % tp)

"""Chapter 07's exercises: defend a 3D layout with numbers, and the rank order.

1. ``layout_defence``: the learner chooses ``dp × tp × pp``, a ZeRO stage, activation
   checkpointing, sequence parallelism and the microbatch size for LLaMA-2 70B on
   64 H100s, and answers the four questions *in numbers*: bytes per GPU by category,
   wire bytes per GPU per step on each axis, the bubble, the axis that dominates
   the traffic. The plan must use the 64 GPUs, keep tp inside a node, fit in 90 %
   of the memory and cost no more than 1.25× the planner's fastest; each number must
   agree with :mod:`dtlab.estimate` within :data:`TOLERANCE` (the bubble within
   :data:`BUBBLE_TOLERANCE`), the estimate's numbers computed for the learner's plan.
2. ``rank_order``: Megatron's rank order (tp fastest, then dp, then pp), checked on
   every rank of the live cluster against the :class:`dtlab.topology.Topology` each
   rank builds for every layout of the world, groups included, and offline on a
   64-rank layout.
"""

from __future__ import annotations

import re

from dtlab import estimate as est
from dtlab.exercises.ch07_solutions import defend_layout, megatron_coords
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, topology, world_size_of
from dtlab.topology import Layout, layouts_for

__all__ = ["check_layout_defence", "check_rank_order", "TOLERANCE"]

MODEL, GPU = est.MODELS["70B"], est.GPUS["H100-80GB"]
MACHINE = est.ClusterSpec(n_gpus=64, gpus_per_node=8)
GLOBAL_BATCH = 256
TOLERANCE = 0.10  # relative: hand formulas leave out the head, norms, small terms
BUBBLE_TOLERANCE = 0.002  # absolute: (p−1)/(m+p−1) is exact
FLOOR_GB = 0.01  # numbers below this are "nothing" on both sides

CATEGORIES = ("params", "grads", "optimizer", "activations")
THREE_AXES = ("pp", "dp", "tp")  # the exercise's (a Layout may also know cp = 1)
PLAN_KEYS = (
    "layout",
    "zero_stage",
    "checkpointing",
    "sequence_parallel",
    "micro_batch_size",
    "memory_GB",
    "wire_GB",
    "bubble",
    "dominant",
)
HINTS = {
    "params": "The bf16 weights: 2 bytes per parameter of the GPU's slice, Ψ/(tp·pp) "
    "(the embedding sits on the first stage), ÷ dp under ZeRO-3.",
    "grads": "The bf16 gradients: 2 bytes per parameter of the slice, ÷ dp under "
    "ZeRO-2 and 3.",
    "optimizer": "K = 12 bytes per parameter of the slice (fp32 master, momentum, "
    "variance), ÷ dp under ZeRO-1 and up.",
    "activations": "Korthikanti's s·b·h·(34 + 5as/h) bytes per layer (selective: "
    "34·sbh; SP divides by tp), for every microbatch the stage holds: 1F1B keeps "
    "p − stage in flight, p on the first stage.",
    "tp": "Per layer and microbatch 2 all-reduces forward and 2 backward of b·s·h "
    "values, each 2(t−1)/t of its bytes on the wire (SP: the same bytes as "
    "gathers and scatters).",
    "pp": "Per microbatch an activation forward and a gradient backward of b·s·h "
    "values (÷ tp under SP) at each boundary of the stage.",
    "dp": "Gradients: 2Ψ_slice bytes on the ring, (N−1)/N of them per all-reduce "
    "half (ZeRO-3 adds a gather); a group of one rank sends nothing.",
}


def _as_layout(lay) -> Layout:
    """The plan's layout as the learner may write it: a Layout, a mapping with dp,
    tp and pp, its printed form "dp2·tp8·pp4" (any separator), or (dp, tp, pp) in
    the order the exercise names them."""
    if isinstance(lay, Layout):
        return lay
    try:
        if isinstance(lay, str):
            found = dict(re.findall(r"(dp|tp|pp)\s*=?\s*(\d+)", lay.lower()))
            if not found:
                raise ValueError("no dp, tp or pp with a number in it")
            return Layout(**{k: int(v) for k, v in found.items()})
        if isinstance(lay, (tuple, list)) and len(lay) == 3:
            return Layout(dp=int(lay[0]), tp=int(lay[1]), pp=int(lay[2]))
        return Layout(**{k: int(v) for k, v in dict(lay).items()})
    except (TypeError, ValueError) as exc:
        raise ExerciseFailed(
            f"the layout {lay!r} is not one I can read ({exc}): give a Layout, "
            '{"dp": 2, "tp": 8, "pp": 4}, "dp2·tp8·pp4" or (dp, tp, pp).'
        ) from None


def _numbers(plan: dict) -> dict:
    """What dtlab.estimate says for the learner's plan."""
    lay = plan["layout"]
    m = GLOBAL_BATCH // (lay.dp * plan["micro_batch_size"])
    kw = dict(
        zero_stage=plan["zero_stage"],
        precision="bf16",
        micro_batch_size=plan["micro_batch_size"],
        microbatches=m,
        sequence_parallel=plan["sequence_parallel"],
    )
    memory = est.layout_memory(
        MODEL, lay, checkpointing=plan["checkpointing"], states="paper", **kw
    )
    traffic = est.layout_traffic(MODEL, lay, **kw)
    step = est.layout_step_time(
        MODEL, lay, gpu=GPU, cluster=MACHINE, checkpointing=plan["checkpointing"], **kw
    )
    bubble = est.pipeline_bubble_fraction(lay.pp, m) if lay.pp > 1 else 0.0
    return {"memory": memory, "traffic": traffic, "step": step, "bubble": bubble}


def _close(mine, want_bytes: float) -> bool:
    want = want_bytes / 1e9
    if abs(want) < FLOOR_GB:
        return abs(float(mine)) < FLOOR_GB
    return abs(float(mine) - want) <= TOLERANCE * abs(want)


@exercise(
    "layout_defence",
    chapter=7,
    reference=defend_layout,
    local=True,
    measures=(
        "plan: 64 GPUs, tp inside a node, fits 90 % of 80 GB, ≤ 1.25× the planner's "
        "best step; memory per GPU by category, wire GB per step on dp/tp/pp (±10 %), "
        "bubble (±0.002) and the dominant axis against dtlab.estimate"
    ),
)
def check_layout_defence(solution, cluster=None):
    plan = attempt(solution)
    missing = [k for k in PLAN_KEYS if k not in plan]
    if missing:
        raise ExerciseFailed(f"your plan has no {missing}: return every key")
    lay = plan["layout"] = _as_layout(plan["layout"])
    if lay.world_size != MACHINE.n_gpus:
        raise ExerciseFailed(f"{lay} uses {lay.world_size} GPUs, not 64.")
    if lay.tp > MACHINE.gpus_per_node:
        raise ExerciseFailed(
            f"tp={lay.tp} crosses nodes of {MACHINE.gpus_per_node} GPUs: its 4 "
            "collectives per layer would run on InfiniBand, many times slower than "
            "NVLink. Keep tp within a node; use pp across nodes."
        )
    try:
        lay.validate(n_layers=MODEL.n_layers, n_heads=MODEL.n_heads)
    except ValueError as exc:
        raise ExerciseFailed(str(exc)) from None
    if GLOBAL_BATCH % (lay.dp * plan["micro_batch_size"]):
        raise ExerciseFailed("dp × microbatch size must divide the batch of 256")
    got = _numbers(plan)
    usable = 0.9 * GPU.memory_bytes
    if got["memory"]["total"] > usable:
        raise ExerciseFailed(
            f"the plan needs {got['memory']['total'] / 1e9:.1f} GB per GPU, more "
            f"than 90 % of 80 GB ({usable / 1e9:.0f} GB): it does not fit."
        )
    best = est.plan(MODEL, gpu=GPU, cluster=MACHINE, global_batch=GLOBAL_BATCH).best
    if got["step"]["step_s"] > 1.25 * best.step_s:
        raise ExerciseFailed(
            f"the plan takes {got['step']['step_s']:.1f} s a step; the planner's "
            f"best ({best.layout}, ZeRO-{best.zero_stage}) takes {best.step_s:.1f} s: "
            "more than 1.25× slower."
        )
    for k in CATEGORIES:
        mine = plan["memory_GB"].get(k, float("nan"))
        if not _close(mine, got["memory"][k]):
            raise ExerciseFailed(
                f"memory per GPU, {k}: you say {float(mine):.2f} GB, dtlab.estimate "
                f"says {got['memory'][k] / 1e9:.2f} GB (tolerance ±{TOLERANCE:.0%}). "
                + HINTS[k]
            )
    for axis in ("dp", "tp", "pp"):
        mine = plan["wire_GB"].get(axis, float("nan"))
        if not _close(mine, got["traffic"][axis]):
            raise ExerciseFailed(
                f"wire bytes per GPU per step on {axis}: you say {float(mine):.2f} GB, "
                f"dtlab.estimate says {got['traffic'][axis] / 1e9:.2f} GB (±"
                f"{TOLERANCE:.0%}). " + HINTS[axis]
            )
    if abs(float(plan["bubble"]) - got["bubble"]) > BUBBLE_TOLERANCE:
        raise ExerciseFailed(
            f"the bubble: you say {float(plan['bubble']):.4f}, 1F1B's is "
            f"(p−1)/(m+p−1) = {got['bubble']:.4f} with p={lay.pp} and m = "
            f"{GLOBAL_BATCH // (lay.dp * plan['micro_batch_size'])} microbatches."
        )
    dominant = max(("dp", "tp", "pp"), key=lambda a: got["traffic"][a])
    if str(plan["dominant"]).strip().lower() != dominant:
        raise ExerciseFailed(
            f"the axis that moves the most bytes is {dominant}, not "
            f"{plan['dominant']!r}."
        )
    return [
        f"{lay}, ZeRO-{plan['zero_stage']}: {got['memory']['total'] / 1e9:.1f} GB per "
        f"GPU, {got['step']['step_s']:.1f} s a step (planner's best "
        f"{best.step_s:.1f} s)",
        f"memory by category, wire bytes on dp/tp/pp and the bubble agree with "
        f"dtlab.estimate within ±{TOLERANCE:.0%} (bubble ±{BUBBLE_TOLERANCE})",
    ]


def _three(coords: dict) -> dict:
    return {a: coords[a] for a in THREE_AXES}


# ---- 2. the rank order -------------------------------------------------------------
def probe_rank_order(solution) -> list:
    r, n = rank_and_size()
    wrong = []
    for lay in layouts_for(n):
        topo = topology(lay)  # every rank builds every layout's groups, in order
        mine = solution(r, lay.dp, lay.tp, lay.pp)
        if mine != _three(topo.coords):
            wrong.append((str(lay), "coords", mine, _three(topo.coords)))
            continue
        for axis in THREE_AXES:
            others = [a for a in THREE_AXES if a != axis]
            group = [
                q
                for q in range(n)
                if all(
                    solution(q, lay.dp, lay.tp, lay.pp)[a] == mine[a] for a in others
                )
            ]
            if tuple(group) != topo.axis(axis).ranks:
                wrong.append((str(lay), axis, group, list(topo.axis(axis).ranks)))
    return wrong


@exercise(
    "rank_order",
    chapter=7,
    reference=megatron_coords,
    measures=(
        "coords == the Topology on every rank for every layout of the world, and "
        "the groups they imply; offline on dp2·tp8·pp4 (64 ranks)"
    ),
)
def check_rank_order(solution, cluster=None):
    big = Layout(dp=2, tp=8, pp=4)
    for q in range(big.world_size):
        mine = attempt(solution, q, big.dp, big.tp, big.pp)
        if not isinstance(mine, dict):
            raise ExerciseFailed(
                "return a dict {'tp': …, 'dp': …, 'pp': …}, not "
                f"{type(mine).__name__}"
            )
        if mine != _three(big.coords(q)):
            raise ExerciseFailed(
                f"{big}, rank {q}: you say {mine}, Megatron's order says "
                f"{_three(big.coords(q))}. tp varies fastest (rank % tp), then dp, "
                "then pp: a tp group is consecutive ranks, so it fits in a node."
            )
    reports = on_every_rank(cluster, probe_rank_order, solution)
    for r, wrong in enumerate(reports):
        if wrong:
            lay, what, mine, want = wrong[0]
            raise ExerciseFailed(
                f"{lay}, rank {r}: your {what} {mine} differ from the topology's "
                f"{want}."
            )
    n = world_size_of(cluster)
    return [
        f"{big}: every rank's coordinates",
        f"every layout of {n} ranks: coordinates and groups equal each rank's Topology",
    ]

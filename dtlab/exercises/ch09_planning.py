"""Chapter 09's exercises: the step-time model, and what a rank holds under ZeRO.

1. ``step_time``: the learner's model of one step (compute, the exposed
   communication of tp, pp and dp, the bubble) on five configurations the learner
   does not see, component by component within :data:`TOLERANCE` of dtlab's
   planner (:func:`dtlab.estimate.layout_step_time`, whose compute, communication
   and bubble the reference reproduces; the checker asserts that it does).
2. ``zero_states``: the bytes of model states one rank holds under each ZeRO
   stage, checked on every rank of the live cluster against what
   :class:`dtlab.memory.MemoryTracker` measures on a real
   :class:`dtlab.zero.FullyShardedDataParallel` of that stage.
"""

from __future__ import annotations

import torch

from dtlab import estimate as est
from dtlab.exercises.ch09_solutions import step_time, zero_states
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.watch import Watch
from dtlab.memory import MemoryTracker
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.topology import Layout
from dtlab.zero import FullyShardedDataParallel

__all__ = ["check_step_time", "check_zero_states", "TOLERANCE"]

TOLERANCE = 0.05  # relative, per component; below 1 µs a component counts as 0
COMPONENTS = ("compute_s", "tp_s", "pp_s", "dp_s", "bubble_s", "step_s")


def _config(model, layout, gpu, cluster, zero_stage, b, m, sp) -> dict:
    return dict(
        model=est.MODELS[model],
        layout=layout,
        gpu=est.GPUS[gpu],
        cluster=cluster,
        zero_stage=zero_stage,
        micro_batch_size=b,
        microbatches=m,
        sequence_parallel=sp,
    )


def nodes(n_gpus: int, **kw) -> est.ClusterSpec:
    """A cluster at the exercise's stated link: NVLink 4's 450 GB/s inside every
    node, whatever the GPU (``cluster.link`` returns it)."""
    return est.ClusterSpec(n_gpus, intra=est.LINKS["nvlink"], **kw)


def _hidden_configs() -> list[dict]:
    """Five configurations: each axis alone and together, two GPUs, two networks."""
    ethernet = nodes(128, inter=est.LINKS["ethernet"])
    return [
        _config("7B", Layout(dp=8), "H100-80GB", nodes(8), 1, 2, 4, False),
        _config("13B", Layout(dp=2, tp=8), "H100-80GB", nodes(16), 1, 1, 8, True),
        _config("70B", Layout(tp=4, pp=16), "H100-80GB", nodes(64), 0, 1, 256, True),
        _config(
            "70B", Layout(dp=8, tp=4, pp=2), "H100-80GB", nodes(64), 1, 1, 32, True
        ),
        _config(
            "70B", Layout(dp=4, tp=8, pp=4), "A100-80GB", ethernet, 2, 1, 16, False
        ),
    ]


def _estimate(cfg: dict) -> dict:
    """dtlab's planner on one configuration, and the reference's split of it."""
    kw = {k: v for k, v in cfg.items() if k not in ("model", "layout")}
    # the exercise's FLOPs are chapter 04's textbook count (8h² of attention, a
    # gated MLP as 1.5 × d_ff), which the planner gives with flops="megatron"
    planner = est.layout_step_time(
        cfg["model"], cfg["layout"], precision="bf16", flops="megatron", **kw
    )
    split = step_time(cfg["model"], cfg["layout"], **kw)
    comm = split["tp_s"] + split["pp_s"] + split["dp_s"]
    pairs = [
        (split["compute_s"], planner["compute_s"]),
        (split["bubble_s"], planner["bubble_s"]),
        (comm, planner["comm_s"]),
        (split["step_s"], planner["step_s"]),
    ]
    for mine, theirs in pairs:  # the reference is the planner, split up
        assert abs(mine - theirs) <= 1e-9 * max(1.0, theirs), (cfg, split, planner)
    return split


def _describe(cfg: dict) -> str:
    lay = cfg["layout"]
    return (
        f"{cfg['model'].name} on {lay} ({cfg['gpu'].name}, ZeRO-{cfg['zero_stage']}, "
        f"b={cfg['micro_batch_size']}, m={cfg['microbatches']}"
        f"{', SP' if cfg['sequence_parallel'] else ''})"
    )


HINTS = {
    "compute_s": "3·b·s·(8h² + 4h·d_ff + 4sh) FLOPs per layer (gated MLP: d_ff × "
    "1.5) for ceil(L/pp) layers, plus the head's 6·b·s·h·V/pp, ÷ tp, at mfu × peak; "
    "times m microbatches.",
    "tp_s": "4 collectives of b·s·h·2 bytes per layer and microbatch (SP: 4 "
    "all-gathers and 4 reduce-scatters), α-β timed on the tp group's link; they "
    "are on the critical path, nothing hides them.",
    "pp_s": "Per microbatch an activation forward and a gradient backward, "
    "α + S/B each, S = b·s·h·2 (÷ tp under SP), on the link to the next stage.",
    "dp_s": "ZeRO's collectives on the dp group (ZeRO-2 reduce-scatters every "
    "microbatch), minus what hides behind the last backward: min(dp_overlap × dp, "
    "t_b).",
    "bubble_s": "1F1B idles (p − 1)(t_f + t_b), t_f a third and t_b two thirds of "
    "a microbatch's compute and tp time, plus half of its p2p each.",
    "step_s": "m(t_f + t_b) + the bubble + the exposed dp time.",
}


@exercise(
    "step_time",
    chapter=9,
    reference=step_time,
    local=True,
    measures=(
        "compute, exposed tp/pp/dp communication, bubble and step time on 5 hidden "
        "configurations, each within ±5 % of dtlab.estimate.layout_step_time"
    ),
)
def check_step_time(solution, cluster=None):
    forbidden = {
        est.layout_step_time: "dtlab.estimate.layout_step_time",
        est.plan: "dtlab.estimate.plan",
    }
    for cfg in _hidden_configs():
        want = _estimate(cfg)
        args = {k: v for k, v in cfg.items() if k not in ("model", "layout")}
        with Watch(forbidden) as seen:
            got = attempt(solution, cfg["model"], cfg["layout"], **args)
        if seen.forbidden:
            raise ExerciseFailed(
                f"you called {', '.join(seen.forbidden)}: build the model from its "
                "parts (tp_layer_flops, collective_time, zero_comm_per_step, ...)."
            )
        for k in COMPONENTS:
            mine = float(got.get(k, float("nan")))
            if abs(want[k]) < 1e-6:
                ok = abs(mine) < 1e-6
            else:
                ok = abs(mine - want[k]) <= TOLERANCE * want[k]
            if not ok:
                raise ExerciseFailed(
                    f"{_describe(cfg)}: {k} is {mine:.4g} s, dtlab's planner says "
                    f"{want[k]:.4g} s (±{TOLERANCE:.0%}). {HINTS[k]}"
                )
    return [
        f"compute, tp/pp/dp communication, bubble and step time within "
        f"±{TOLERANCE:.0%} of dtlab's planner on 5 hidden configurations"
    ]


# ---- 2. what a rank holds ----------------------------------------------------------
CONFIG = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, d_model=16)


WHAT_IS_SHARDED = {
    "params": "4 bytes of weight a parameter (ZeRO-3 shards them)",
    "grads": "4 bytes of gradient a parameter (ZeRO-2 and 3 shard them)",
    "optimizer": "AdamW's two fp32 moments, 8 bytes a parameter (ZeRO-1 and up "
    "shard them)",
}


def probe_zero_states(solution) -> list[dict]:
    r, n = rank_and_size()
    found = []
    for stage in range(4):
        model = FullyShardedDataParallel(GPT(CONFIG, seed=0), stage=stage)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = MemoryTracker(model, opt)
        x, y = SyntheticTokens(CONFIG.vocab_size, CONFIG.seq_len).shard(0, 2 * n, r, n)
        with tracker.phase("step"):
            model(x, y)[1].backward()
            opt.step()
        got = tracker.records[-1]
        counters = 4 * len(list(model.parameters()))  # AdamW's step, one a tensor
        measured = {
            "params": got["params"],
            "grads": got["grads"],
            "optimizer": got["optimizer"] - counters,
        }
        yours = solution(model.padded_numel, n, stage)
        found.append(
            {
                "stage": stage,
                "psi": model.padded_numel,
                "measured": measured,
                "yours": yours,
            }
        )
    return found


@exercise(
    "zero_states",
    chapter=9,
    reference=zero_states,
    measures=(
        "params, grads, optimizer bytes per rank for ZeRO stages 0-3 == what "
        "dtlab.memory measures on a real FullyShardedDataParallel on every rank"
    ),
)
def check_zero_states(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_zero_states, solution)
    for r, cases in enumerate(reports):
        for case in cases:
            mine = case["yours"]
            if not isinstance(mine, dict):
                raise ExerciseFailed("return {'params': …, 'grads': …, 'optimizer': …}")
            for k, measured in case["measured"].items():
                if mine.get(k) != measured:
                    what = WHAT_IS_SHARDED[k]
                    raise ExerciseFailed(
                        f"ZeRO-{case['stage']}, rank {r}, {k}: you say {mine.get(k)}, "
                        f"dtlab measures {measured} bytes for Ψ = {case['psi']} on "
                        f"N = {n} ranks: {what}."
                    )
    return [f"every stage's params, grads and optimizer bytes, on all {n} ranks"]

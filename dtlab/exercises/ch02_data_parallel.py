"""Chapter 02's exercises: DDP in steps, then gradient accumulation.

1. ``grad_hooks``: a blocking all-reduce per parameter from its gradient hook, and
   the division by N (Li et al. 2020, §3.2.1, the naive solution);
2. ``overlapped_hooks``: the same all-reduces launched asynchronously from the
   hooks while backward goes on, every handle waited once backward returns (§3.2.3);
3. ``bucketed_hooks``: gradients packed into buckets of a given cap in *reverse*
   registration order, one async all-reduce per bucket (§3.2.3, Figure 2(b));
4. ``no_sync_accumulation``: k microbatches per optimizer step on
   :class:`dtlab.ddp.DistributedDataParallel`, all-reducing once (§3.2.4).

The chapter's fifth exercise, the same training on PyTorch's own DDP, is
:mod:`.ch02_torch_ddp`.

Every rank trains on its own slice of the global batch with plain SGD (where a
gradient summed instead of averaged moves the weights N times too far, which AdamW
would almost hide) and the weights are compared with one process training on the
whole batch. How it was done comes from the ranks' comm events and the launch and
wait times dtlab.comm reports: how many all-reduces, of how many bytes, in which
order, launched during backward or after it, waited inside the backward or at the
end, and how much communication overlapped the backward's compute.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from dtlab.ddp import DistributedDataParallel
from dtlab.estimate import ddp_bucket_assignment
from dtlab.exercises.ch02_solutions import (
    accumulate_and_step,
    attach_bucketed_averaging,
    attach_grad_averaging,
    attach_overlapped_averaging,
)
from dtlab.exercises.grading import ExerciseFailed, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.watch import Watch
from dtlab.model import param_generator, regression_batch

__all__ = [
    "check_grad_hooks",
    "check_overlapped_hooks",
    "check_bucketed_hooks",
    "check_no_sync_accumulation",
    "exercise_model",
]

WIDTHS = (16, 32, 32, 32, 8)  # four linear layers: eight parameters
GLOBAL_BATCH, STEPS, LR = 24, 3, 0.2
BUCKET_CAP = 4096  # bytes: 3 buckets of 5280, 4224 and 2176 bytes for this model
MICRO_BATCHES = 3


# ---- the model, the data, one process ------------------------------------------------
def exercise_model() -> nn.Sequential:
    """Four linear layers with GELUs between them, the same on every rank."""
    layers = []
    for i, (d_in, d_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        lin = nn.Linear(d_in, d_out)
        with torch.no_grad():
            gen = param_generator(0, f"ddp-exercise/{i}")
            lin.weight.copy_(torch.randn(d_out, d_in, generator=gen) / d_in**0.5)
            lin.bias.copy_(torch.randn(d_out, generator=gen) * 0.1)
        layers += [lin, nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _batch(step: int, rank: int, n: int):
    x, y = regression_batch(step, GLOBAL_BATCH, WIDTHS[0], WIDTHS[-1])
    per = GLOBAL_BATCH // n
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _single_process(grad_scale: float = 1.0, micro_batches: int = 1) -> dict:
    """One process on the whole batch (``grad_scale`` N: the sum of the ranks'
    gradients instead of their mean)."""
    model = exercise_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step, 0, 1)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            p.grad.mul_(grad_scale)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


# ---- on every rank -------------------------------------------------------------------
FORBIDDEN = {
    DistributedDataParallel: "dtlab.ddp.DistributedDataParallel",
    torch.nn.parallel.DistributedDataParallel: (
        "torch.nn.parallel.DistributedDataParallel"
    ),
}


def probe_training(solution, mode: str, cap_bytes: int) -> dict:
    """Train STEPS SGD steps on this rank's slice with the learner's averaging; the
    weights, comm events, launches and each step's backward window."""
    r, n = rank_and_size()
    model = exercise_model()
    windows = []
    with Watch(FORBIDDEN) as seen:
        if mode == "hooks":
            returned = solution(model)
            finish = None
            if isinstance(returned, nn.Module):
                model = returned
        elif mode == "overlap":
            finish = solution(model)
        else:
            finish = solution(model, cap_bytes)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            x, y = _batch(step, r, n)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            t0 = time.time()
            loss.backward()
            t1 = time.time()
            if finish is not None:
                finish()
            windows.append((t0, t1, time.time()))
            opt.step()
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "events": _slim(seen.events),
        "launches": seen.launches,
        "windows": windows,
        "forbidden": seen.forbidden,
        "param_bytes": [p.numel() * 4 for p in exercise_model().parameters()],
    }


def _slim(events) -> list[dict]:
    """The fields judged, in launch order (events are recorded as ops complete)."""
    keys = ("op", "payload_bytes", "t_start", "t_end", "tag")
    return sorted(({k: e.get(k) for k in keys} for e in events), key=_started)


def _started(event: dict) -> float:
    return event["t_start"]


# ---- judging -------------------------------------------------------------------------
def _judge_weights(reports: list[dict], too_far: dict[int, str], hint: str = ""):
    """Every rank holds the same weights, and they are one process's; ``too_far``
    names the mistake behind gradients k times too large, for each k."""
    first = reports[0]["weights"]
    for r, rep in enumerate(reports[1:], start=1):
        for name, w in rep["weights"].items():
            if not torch.equal(w, first[name]):
                raise ExerciseFailed(
                    f"after {STEPS} SGD steps rank {r} and rank 0 hold different "
                    f"weights ({name}): every rank must step with the same averaged "
                    "gradient. Is every parameter's .grad averaged, and written "
                    "back into .grad?"
                )
    want = _single_process()
    if all(torch.allclose(first[k], want[k], atol=1e-5) for k in want):
        return
    for scale, mistake in too_far.items():
        moved = _single_process(grad_scale=scale)
        if all(torch.allclose(first[k], moved[k], atol=1e-5) for k in want):
            raise ExerciseFailed(f"the weights moved {scale} times too far: {mistake}")
    worst = max(want, key=lambda k: (first[k] - want[k]).abs().max())
    raise ExerciseFailed(
        f"after {STEPS} SGD steps {worst} is off by "
        f"{(first[worst] - want[worst]).abs().max():.2e} from one process training "
        f"on the whole batch. {hint}"
    )


def _summed(n: int) -> dict[int, str]:
    return {n: "the gradients were summed, not averaged; divide by N."}


def _judge_launches(r: int, rep: dict, sizes: list[int], what: str, ordered: bool):
    """Only all-reduces: per step ``sizes`` bytes of them (in that launch order when
    ``ordered``, else in any order)."""
    if rep["forbidden"]:
        raise ExerciseFailed(
            f"rank {r}: you called {', '.join(rep['forbidden'])}. The exercise is "
            f"to write {what} yourself, from hooks and dtlab.comm.all_reduce."
        )
    other = sorted({e["op"] for e in rep["launches"]} - {"all_reduce"})
    if other:
        raise ExerciseFailed(
            f"rank {r}: you used {other}; averaging gradients takes all-reduces "
            "and nothing else."
        )
    got = [e["bytes"] for e in rep["launches"]]
    k = len(sizes)
    # each launch belongs to the step whose window it started in, so a message about
    # step 0 shows step 0's launches however many the answer made per step
    steps = [[] for _ in range(STEPS)]
    for e in rep["launches"]:
        steps[rep["windows"].index(_window(rep["windows"], e["t_launch"]))].append(
            e["bytes"]
        )
    same = (lambda a: a == sizes) if ordered else (lambda a: sorted(a) == sorted(sizes))
    if len(got) != k * STEPS or not all(same(step) for step in steps):
        raise ExerciseFailed(
            f"rank {r} all-reduced {len(got) / STEPS:g} tensors per step, of "
            f"{steps[0]} bytes in step 0; {what} all-reduces {k} per step, of "
            f"{sizes} bytes" + (" in that order." if ordered else ".")
        )


def _window(windows: list[tuple], t: float) -> tuple:
    """The step (backward start, backward end, finish end) that time ``t`` is in."""
    return next((w for w in windows if t <= w[2]), windows[-1])


def _judge_overlap(r: int, rep: dict) -> float:
    """Launched during backward, asynchronously, waited after it; the seconds of
    communication that overlapped the backward's compute."""
    overlapped = 0.0
    for i, launch in enumerate(rep["launches"]):
        t0, t1, t2 = _window(rep["windows"], launch["t_launch"])
        if launch["t_launch"] > t1:
            raise ExerciseFailed(
                f"rank {r}: all-reduce {i} was launched after backward returned, so "
                "nothing could overlap it. Launch each all-reduce from the hook, as "
                "soon as its gradient is ready."
            )
        if not launch["async"]:
            raise ExerciseFailed(
                f"rank {r}: all-reduce {i} was blocking (async_op=False): the "
                "backward stopped until it finished. Launch it with async_op=True "
                "and keep the handle."
            )
        if launch["t_waited"] is None:
            raise ExerciseFailed(
                f"rank {r}: the handle of all-reduce {i} was never waited: the step "
                "may read a gradient still being reduced. Wait for every handle in "
                "finish()."
            )
        if launch["t_waited"] < t1:
            raise ExerciseFailed(
                f"rank {r}: all-reduce {i} was waited inside the backward (in a "
                "hook), which then stops until it completes. Keep the handles and "
                "wait for them in finish(), after backward returns."
            )
    for e in rep["events"]:
        w = _window(rep["windows"], e["t_start"])
        overlapped += max(0.0, min(e["t_end"], w[1]) - e["t_start"])
    return overlapped


@exercise(
    "grad_hooks",
    chapter=2,
    reference=attach_grad_averaging,
    measures=(
        "weights after 3 SGD steps == one process (a missing /N fails), identical "
        "on every rank; one all_reduce per parameter of its bytes, inside backward; "
        "no DDP wrapper"
    ),
)
def check_grad_hooks(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_training, solution, "hooks", 0)
    sizes = reports[0]["param_bytes"]
    for r, rep in enumerate(reports):
        _judge_launches(r, rep, sizes, "per-parameter averaging (biases too)", False)
        for i, launch in enumerate(rep["launches"]):
            if not any(w[0] <= launch["t_launch"] <= w[1] for w in rep["windows"]):
                raise ExerciseFailed(
                    f"rank {r}: all-reduce {i} ran outside backward: register a "
                    "hook per parameter, so each gradient is reduced when ready."
                )
    _judge_weights(reports, _summed(n))
    return [
        f"weights equal one process's after {STEPS} SGD steps, on all {n} ranks",
        f"{len(sizes)} all-reduces per step, one per parameter, inside backward",
    ]


@exercise(
    "overlapped_hooks",
    chapter=2,
    reference=attach_overlapped_averaging,
    measures=(
        "weights == one process, identical on every rank; one async all_reduce per "
        "parameter launched inside backward, every handle waited after backward "
        "returned; overlap measured from the comm events"
    ),
)
def check_overlapped_hooks(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_training, solution, "overlap", 0)
    sizes = reports[0]["param_bytes"]
    overlapped = 0.0
    for r, rep in enumerate(reports):
        _judge_launches(r, rep, sizes, "overlapped averaging", False)
        overlapped += _judge_overlap(r, rep)
    _judge_weights(reports, _summed(n))
    return [
        f"weights equal one process's after {STEPS} SGD steps, on all {n} ranks",
        f"{len(sizes)} async all-reduces per step, launched from the hooks, waited "
        "in finish()",
        f"{overlapped * 1e3:.1f} ms of communication overlapped the backward pass "
        "(all ranks, from the comm events)",
    ]


def bucket_bytes(param_bytes: list[int], cap_bytes: float) -> list[int]:
    """The bytes of each bucket, in launch order, for parameters of ``param_bytes``
    (registration order): DDP's rule on the reversed order."""
    backward_order = param_bytes[::-1]
    groups = ddp_bucket_assignment(backward_order, cap_bytes)
    return [sum(backward_order[i] for i in g) for g in groups]


@exercise(
    "bucketed_hooks",
    chapter=2,
    reference=attach_bucketed_averaging,
    measures=(
        "weights == one process; per step as many async all_reduces as buckets for "
        "the cap, of each bucket's bytes, in reverse registration order; launched "
        "inside backward, waited after it"
    ),
)
def check_bucketed_hooks(solution, cluster=None, cap_bytes: int = BUCKET_CAP):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_training, solution, "buckets", cap_bytes)
    sizes = reports[0]["param_bytes"]
    want = bucket_bytes(sizes, cap_bytes)
    for r, rep in enumerate(reports):
        got = [e["bytes"] for e in rep["launches"]][: len(want) + 2]
        registration = [
            sum(sizes[i] for i in g) for g in ddp_bucket_assignment(sizes, cap_bytes)
        ]
        if got[: len(registration)] in (registration, registration[::-1]) and (
            registration != want
        ):
            raise ExerciseFailed(
                f"rank {r}: your buckets of {got[: len(registration)]} bytes were "
                "cut in registration order. Backward produces the last layers' "
                "gradients first, so buckets are cut in reverse registration order "
                f"and bucket 0 (the last layers) launches first: {want} bytes."
            )
        _judge_launches(
            r,
            rep,
            want,
            f"bucketing with a cap of {cap_bytes} bytes (a bucket closes as soon as "
            "it holds the cap or more)",
            True,
        )
        _judge_overlap(r, rep)
    _judge_weights(reports, _summed(n))
    return [
        f"weights equal one process's after {STEPS} SGD steps, on all {n} ranks",
        f"{len(want)} buckets of {want} bytes for a cap of {cap_bytes}, in reverse "
        "registration order, each one async all-reduce launched inside backward",
    ]


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps (how often the learner stepped)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.steps_taken = 0

    def step(self, closure=None):
        self.steps_taken += 1
        return super().step(closure)


def probe_accumulation(solution, k: int) -> dict:
    """STEPS optimizer steps, each over k microbatches of this rank's slice, on
    dtlab's DDP; the weights, comm events, steps taken and DDP's bucket count."""
    r, n = rank_and_size()
    model = DistributedDataParallel(exercise_model())  # its broadcast: not watched
    opt = CountingSGD(model.parameters(), lr=LR)
    # microbatches whose forward ran and whose backward has not reached them yet:
    # their activations are alive together
    held = {"now": 0, "most": 0}

    def on_forward(module, inputs, out):
        held["now"] += 1
        held["most"] = max(held["most"], held["now"])
        if out.requires_grad:
            out.register_hook(lambda grad: held.update(now=held["now"] - 1))

    hook = model.module.register_forward_hook(on_forward)
    with Watch() as seen:
        for step in range(STEPS):
            x, y = _batch(step, r, n)
            opt.zero_grad(set_to_none=True)
            micro = list(zip(x.chunk(k), y.chunk(k)))
            solution(model, opt, micro, nn.functional.mse_loss)
            held["now"] = 0
    hook.remove()
    return {
        "held_at_once": held["most"],
        "weights": {
            key: v.detach().clone() for key, v in model.module.state_dict().items()
        },
        "launches": seen.launches,
        "steps_taken": opt.steps_taken,
        "buckets": len(model.buckets),
    }


@exercise(
    "no_sync_accumulation",
    chapter=2,
    reference=accumulate_and_step,
    measures=(
        "weights == one process on the whole batch; one all-reduce per bucket per "
        "optimizer step (not per microbatch), one optimizer step; each "
        "microbatch's backward before the next one's forward"
    ),
)
def check_no_sync_accumulation(solution, cluster=None, k: int = MICRO_BATCHES):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_accumulation, solution, k)
    for r, rep in enumerate(reports):
        if rep["steps_taken"] != STEPS:
            raise ExerciseFailed(
                f"rank {r} called optimizer.step() {rep['steps_taken'] / STEPS:g} "
                f"times per accumulation step: step once, after all {k} microbatches."
            )
        per_step = len(rep["launches"]) / STEPS
        if per_step == 0:
            raise ExerciseFailed(
                f"rank {r}: no all-reduce at all, so the ranks never averaged. Run "
                "the last microbatch's backward outside no_sync(): DDP then reduces "
                "the gradients accumulated so far."
            )
        if per_step != rep["buckets"]:
            raise ExerciseFailed(
                f"rank {r} all-reduced {per_step:g} times per step ({rep['buckets']} "
                f"bucket(s), {k} microbatches): wrap every backward but the last in "
                "model.no_sync(), so gradients accumulate locally and DDP "
                "communicates once per optimizer step."
            )
    _judge_weights(
        reports,
        {k: f"divide each microbatch's loss by k = {k}.", **_summed(n)},
        hint=(
            f"Are all {k} microbatches' gradients accumulated (no zero_grad between "
            "them), each loss divided by k?"
        ),
    )
    for r, rep in enumerate(reports):
        if rep["held_at_once"] > 1:
            raise ExerciseFailed(
                f"rank {r} held {rep['held_at_once']} microbatches' activations at "
                "once: a forward ran before the previous microbatch's backward (one "
                "backward of the summed losses). Accumulation exists to hold one "
                "microbatch at a time: run each one's backward before the next "
                "forward."
            )
    return [
        f"weights equal one process's after {STEPS} steps of {k} microbatches",
        "one all-reduce per bucket per optimizer step; one optimizer step; one "
        "microbatch's activations alive at a time",
    ]

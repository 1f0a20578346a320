"""Chapter 03's exercises: ZeRO's three stages, one mechanism each.

Memory is judged by the storages really allocated (:mod:`.ch03_memory`,
:mod:`.storages`), never by the tensor objects a checker can see: a slice or view
of a larger buffer keeps the whole buffer.

1. ``zero1_step``: the sharded AdamW step over gradients that are *different on
   every rank*, with weight decay > 0: the checker compares three steps with
   ``torch.optim.AdamW`` on the averaged gradient in one process, and reads from the
   comm events one reduce-scatter and one all-gather of Ψ per step; the state a rank
   keeps allocated (by storage) must be its slice's only.
2. ``zero2_hooks``: gradient hooks that reduce-scatter each gradient and free it at
   once; a hook of the checker's, run before the learner's, follows every full
   gradient's storage by weak reference (and every buffer a collective reduces),
   and one run after measures the bytes of them still allocated (at most one
   gradient's, beyond the 1/N slices), whoever keeps them.
3. ``fsdp_unit``: gather, compute, free, re-gather in backward; the checker follows
   the storage of every tensor an all-gather filled and measures, at every compute
   and every collective, how many units' full parameters are allocated (at most
   two).

The fourth, PyTorch's FSDP2 within a budget, is :mod:`.ch03_fsdp2`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dtlab import comm
from dtlab.exercises.ch03_memory import (
    full_gradients_alive,
    state_storages,
    zero2_held,
)
from dtlab.exercises.ch03_solutions import (
    attach_zero2_hooks,
    fsdp_unit,
    sharded_adamw_step,
)
from dtlab.exercises.grading import ExerciseFailed, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.storages import Storages
from dtlab.exercises.watch import Watch
from dtlab.model import param_generator
from dtlab.zero import FullyShardedDataParallel, ShardedOptimizer

__all__ = ["check_zero1_step", "check_zero2_hooks", "check_fsdp_unit"]

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS = 3
SLICE = 250  # elements of the flat parameter each rank owns in zero1_step


def _randn(*shape, seed: str) -> torch.Tensor:
    return torch.randn(*shape, generator=param_generator(0, seed))


def _forbidden() -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return {
        ShardedOptimizer: "dtlab.zero.ShardedOptimizer",
        FullyShardedDataParallel: "dtlab.zero.FullyShardedDataParallel",
        ZeroRedundancyOptimizer: "torch's ZeroRedundancyOptimizer",
    }


def _refuse(r: int, forbidden: list[str], what: str) -> None:
    if forbidden:
        raise ExerciseFailed(
            f"rank {r}: you called {', '.join(forbidden)}. The exercise is to write "
            f"{what} yourself, from dtlab.comm's collectives."
        )


# ---- 1. the sharded optimizer step ---------------------------------------------------
def _zero1_grads(n: int) -> list[list[torch.Tensor]]:
    """grads[step][rank]: every rank's own gradient of every step."""
    return [
        [_randn(n * SLICE, seed=f"zero1/grad/{t}/{q}") for q in range(n)]
        for t in range(STEPS)
    ]


def probe_zero1(solution) -> dict:
    r, n = rank_and_size()
    flat = _randn(n * SLICE, seed="zero1/param")  # the same weights on every rank
    grads = _zero1_grads(n)
    state: dict = {}
    with Watch(_forbidden()) as seen:
        for t in range(STEPS):
            solution(flat, grads[t][r].clone(), state, **ADAMW)
    return {
        "flat": flat,
        "state": state_storages(state, weights=(flat,)),
        "launches": [(e["op"], e["bytes"]) for e in seen.launches],
        "forbidden": seen.forbidden,
    }


def _one_process_adamw(n: int, *, grad_scale=1.0, **changes) -> torch.Tensor:
    """torch.optim.AdamW (or another optimizer class in ``changes``) on the whole
    flat tensor, stepping with the ranks' averaged gradient."""
    whole = nn.Parameter(_randn(n * SLICE, seed="zero1/param"))
    cls = changes.pop("cls", torch.optim.AdamW)
    opt = cls([whole], **{**ADAMW, **changes})
    for step_grads in _zero1_grads(n):
        whole.grad = torch.stack(step_grads).mean(0) * grad_scale
        opt.step()
    return whole.detach()


@exercise(
    "zero1_step",
    chapter=3,
    reference=sharded_adamw_step,
    measures=(
        "weights after 3 AdamW steps (weight decay 0.1) over per-rank DIFFERENT "
        "gradients == torch AdamW on their average; per step one reduce_scatter "
        "and one all_gather of Ψ, nothing else; state allocated (by storage) of "
        "S = Ψ/N per moment"
    ),
)
def check_zero1_step(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_zero1, solution)
    psi_bytes = n * SLICE * 4
    for r, rep in enumerate(reports):
        _refuse(r, rep["forbidden"], "ZeRO-1's step")
        ops = [op for op, _ in rep["launches"]]
        if "all_reduce" in ops:
            raise ExerciseFailed(
                f"rank {r} all-reduced: every rank then holds the whole averaged "
                "gradient, of which it updates only its slice. Reduce-scatter "
                "instead: the same sum, each rank receiving only its slice (Ψ on "
                "the wire instead of 2Ψ)."
            )
        if "reduce_scatter" not in ops:
            raise ExerciseFailed(
                f"rank {r}: no reduce-scatter, so each rank stepped with its own "
                "gradient instead of the average over ranks. Reduce-scatter the "
                "gradient first: rank r receives slice r of the sum."
            )
        want = [("reduce_scatter", psi_bytes), ("all_gather", psi_bytes)] * STEPS
        if rep["launches"] != want:
            raise ExerciseFailed(
                f"rank {r} ran {rep['launches'][:4]}... per step; ZeRO-1 runs one "
                f"reduce-scatter and one all-gather of Ψ = {psi_bytes} bytes a step."
            )
        kept = rep["state"]
        if kept["values"] > 2 * SLICE:
            through = (
                f" Your state's tensors show {kept['shown']} of them: they are "
                "slices of larger buffers, and a slice keeps its whole buffer "
                "allocated."
                if kept["shown"] < kept["values"]
                else ""
            )
            raise ExerciseFailed(
                f"rank {r} keeps {kept['values']} optimizer-state values allocated "
                f"({4 * kept['values']} B); its slice needs 2·S = {2 * SLICE} "
                "(exp_avg and exp_avg_sq of S = Ψ/N elements)." + through + " "
                "Sharding the state is all ZeRO-1 saves: allocate the moments of "
                "the slice only."
            )
    for r, rep in enumerate(reports):
        if not torch.equal(rep["flat"], reports[0]["flat"]):
            raise ExerciseFailed(
                f"rank {r} and rank 0 hold different weights: all-gather every "
                "rank's updated slice into flat_param on every rank."
            )
    got = reports[0]["flat"]
    close = lambda want: torch.allclose(got, want, rtol=1e-5, atol=1e-6)  # noqa: E731
    if close(_one_process_adamw(n)):
        return [
            f"weights equal torch AdamW on the averaged gradient after {STEPS} "
            f"steps, on all {n} ranks",
            f"per step one reduce-scatter and one all-gather of Ψ = {psi_bytes} B; "
            f"{max(r['state']['values'] for r in reports)} state values allocated "
            f"per rank, counted by storage (2·Ψ/N = {2 * SLICE})",
        ]
    if close(_one_process_adamw(n, grad_scale=n)):
        raise ExerciseFailed(
            "the update used the sum of the ranks' gradients, not their average: "
            "divide the reduce-scattered slice by N."
        )
    if close(_one_process_adamw(n, weight_decay=0.0)):
        raise ExerciseFailed(
            "the weight decay is missing: AdamW shrinks the weight itself, "
            "θ ← θ·(1 − lr·λ), before the Adam update."
        )
    if close(_one_process_adamw(n, cls=torch.optim.Adam)):
        raise ExerciseFailed(
            "you added λ·θ to the gradient (Adam's L2 penalty, which the moments "
            "then rescale); AdamW decays the weight directly: θ ← θ·(1 − lr·λ)."
        )
    off = (got - _one_process_adamw(n)).abs().max()
    raise ExerciseFailed(
        f"the weights differ from torch AdamW by {off:.2e}: check the moments, the "
        "bias corrections 1−β₁ᵗ and 1−β₂ᵗ, and ε."
    )


# ---- the model of stages 2 and 3 -----------------------------------------------------
WIDTHS = (12, 30, 30, 6)  # biases of 30 and 6: not multiples of N, so padding shows
BATCH = 3  # samples per rank


def zero_model() -> nn.Sequential:
    layers = []
    for i, (d_in, d_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        lin = nn.Linear(d_in, d_out)
        with torch.no_grad():
            lin.weight.copy_(_randn(d_out, d_in, seed=f"zero/{i}/w") / d_in**0.5)
            lin.bias.copy_(_randn(d_out, seed=f"zero/{i}/b") * 0.1)
        layers += [lin, nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _data(rank: int, width_in: int, width_out: int, tag: str):
    x = _randn(BATCH, width_in, seed=f"{tag}/x/{rank}")
    return x, _randn(BATCH, width_out, seed=f"{tag}/y/{rank}")


def _averaged_grads(n: int) -> list[torch.Tensor]:
    """Each parameter's gradient of the mean loss over every rank's batch."""
    model = zero_model()
    xs, ys = zip(*(_data(q, WIDTHS[0], WIDTHS[-1], "zero2") for q in range(n)))
    nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    return [p.grad for p in model.parameters()]


# ---- 2. ZeRO-2's gradient hooks ------------------------------------------------------
def probe_zero2(solution) -> dict:
    """Run the learner's hooks in one backward, following by weak reference every
    full gradient's storage (seen by a hook of ours that runs before theirs) and
    every buffer they reduce (a padded copy), and measuring, after each of their
    hooks (ours run after theirs) and after the backward, the bytes of those
    storages still allocated, whoever keeps them (p.grad, a list, a view)."""
    r, n = rank_and_size()
    model = zero_model()
    params = list(model.parameters())
    shards = [torch.zeros(math.ceil(p.numel() / n)) for p in params]
    held = Storages(exclude=params + shards)
    alive = []  # (after the hook of parameter i, bytes alive, what is alive)

    def see(param):  # ours, before theirs: the full gradient as accumulated
        held.track(param.grad, "gradient", index[id(param)])

    def measure(param):
        alive.append(full_gradients_alive(params, held, index[id(param)]))

    def reduced(frame):  # every buffer a collective reduces: a full gradient's size
        held.track(frame.f_locals.get("input", frame.f_locals.get("tensor")), "buffer")

    index = {id(p): i for i, p in enumerate(params)}
    for p in params:
        p.register_post_accumulate_grad_hook(see)
    x, y = _data(r, WIDTHS[0], WIDTHS[-1], "zero2")
    on_call = {comm.reduce_scatter: reduced, comm.all_reduce: reduced}
    with Watch(_forbidden(), on_call=on_call) as seen:
        solution(model, shards)
        for p in params:
            p.register_post_accumulate_grad_hook(measure)
        nn.functional.mse_loss(model(x), y).backward()
    alive.append(full_gradients_alive(params, held, None))
    return {
        "shards": shards,
        "kept": [p.grad is not None for p in params],
        "alive": alive,
        "launches": [(e["op"], e["bytes"]) for e in seen.launches],
        "forbidden": seen.forbidden,
    }


@exercise(
    "zero2_hooks",
    chapter=3,
    reference=attach_zero2_hooks,
    measures=(
        "each rank's slices == its slice of the averaged gradient (different data "
        "per rank); one reduce_scatter per parameter, no all_reduce; every full "
        "gradient freed; bytes of full gradients (and copies reduced) still "
        "allocated after each hook, by storage, ≤ one gradient (beyond Ψ/N)"
    ),
)
def check_zero2_hooks(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_zero2, solution)
    padded = [
        math.ceil(p.numel() / n) * n * 4 for p in zero_model().parameters()
    ]  # the reduce-scatter of each gradient, padded
    one_gradient = max(padded)  # the largest gradient, padded to N slices
    total = sum(p.numel() * 4 for p in zero_model().parameters())
    for r, rep in enumerate(reports):
        _refuse(r, rep["forbidden"], "ZeRO-2's gradient hooks")
        ops = {op for op, _ in rep["launches"]}
        if "all_reduce" in ops:
            raise ExerciseFailed(
                f"rank {r} all-reduced a gradient: every rank then holds the whole "
                "average, the memory ZeRO-2 exists to save. Reduce-scatter it: each "
                "rank receives only its slice."
            )
        if sorted(b for op, b in rep["launches"] if op == "reduce_scatter") != sorted(
            padded
        ):
            raise ExerciseFailed(
                f"rank {r} reduce-scattered {[b for _, b in rep['launches']]} bytes; "
                f"ZeRO-2 reduce-scatters each gradient once, padded to N slices: "
                f"{sorted(padded)} bytes."
            )
        if any(rep["kept"]):
            raise ExerciseFailed(
                f"rank {r}: p.grad still holds the full gradient after backward for "
                f"{sum(rep['kept'])} parameter(s). Free it (param.grad = None) in "
                "the hook, as soon as its slice is reduce-scattered."
            )
        worst = max(rep["alive"], key=lambda a: a["bytes"])
        if worst["bytes"] > one_gradient:
            raise ExerciseFailed(zero2_held(r, worst, one_gradient, total))
    want = _averaged_grads(n)
    for r, rep in enumerate(reports):
        for i, (shard, g) in enumerate(zip(rep["shards"], want)):
            flat = torch.zeros(shard.numel() * n)
            flat[: g.numel()] = g.reshape(-1)
            mine = flat.chunk(n)[r]
            if torch.allclose(shard, mine, atol=1e-6):
                continue
            if torch.allclose(shard, mine * n, atol=1e-5):
                raise ExerciseFailed(
                    f"rank {r}, parameter {i}: the slice holds the sum of the ranks' "
                    "gradients, not their average: divide by N."
                )
            raise ExerciseFailed(
                f"rank {r}, parameter {i}: the slice is not slice {r} of the "
                f"averaged gradient (off by {(shard - mine).abs().max():.2e}). Pad "
                "the flattened gradient with zeros to N·S, reduce-scatter it, and "
                "keep what arrives."
            )
    return [
        f"every rank's slices equal its slice of the averaged gradient ({n} ranks)",
        f"one reduce-scatter per parameter ({sum(padded)} B), no all-reduce",
        "every full gradient's storage freed by its hook: at most "
        f"{max(a['bytes'] for r in reports for a in r['alive'])} B of full "
        f"gradients and their copies allocated after any hook (budget: one "
        f"gradient, {one_gradient} B; the model's are {total} B)",
    ]


# ---- 3. an FSDP unit -----------------------------------------------------------------
UNITS, WIDTH = 4, 10  # four units of Linear(10, 10) + tanh: 110 parameters each


def unit_compute(flat, x):
    """One unit's forward from its full flat parameters: ``tanh(x·Wᵀ + b)``."""
    w = flat[: WIDTH * WIDTH].view(WIDTH, WIDTH)  # (out, in)
    b = flat[WIDTH * WIDTH : WIDTH * WIDTH + WIDTH]
    return torch.tanh(x @ w.T + b)  # (B, WIDTH)


def _unit_params(n: int) -> list[torch.Tensor]:
    """Each unit's flat parameters, padded to a multiple of n."""
    numel = WIDTH * WIDTH + WIDTH
    out = []
    for u in range(UNITS):
        flat = torch.zeros(math.ceil(numel / n) * n)
        flat[: WIDTH * WIDTH] = _randn(WIDTH * WIDTH, seed=f"fsdp/{u}/w") / WIDTH**0.5
        flat[WIDTH * WIDTH : numel] = _randn(WIDTH, seed=f"fsdp/{u}/b") * 0.1
        out.append(flat)
    return out


def probe_fsdp(solution) -> dict:
    r, n = rank_and_size()
    shards = [f.chunk(n)[r].clone().requires_grad_() for f in _unit_params(n)]
    # the storage of every tensor an all-gather filled, by weak reference: alive as
    # long as anything (the tensor, a view of it, a detached copy, autograd) holds it
    gathered = Storages(exclude=shards)
    alive = []  # full parameter bytes allocated, at every compute and every gather

    def on_gather(frame):
        gathered.track(frame.f_locals["output"], "gathered")
        alive.append(gathered.bytes())

    def compute(flat, x):
        alive.append(gathered.bytes())
        return unit_compute(flat, x)

    x, y = _data(r, WIDTH, WIDTH, "fsdp")
    with Watch(_forbidden(), on_call={comm.all_gather: on_gather}) as seen:
        h = x
        for shard in shards:
            h = solution(h, shard, compute)
        nn.functional.mse_loss(h, y).backward()
    alive.append(gathered.bytes())
    return {
        "out": h.detach(),
        "grads": [s.grad for s in shards],
        "alive": alive,
        "launches": [(e["op"], e["bytes"]) for e in seen.launches],
        "forbidden": seen.forbidden,
    }


def _fsdp_reference(n: int):
    """Outputs per rank and each unit's averaged, padded gradient."""
    fulls = [f.clone().requires_grad_() for f in _unit_params(n)]
    xs, ys = zip(*(_data(q, WIDTH, WIDTH, "fsdp") for q in range(n)))
    h = torch.cat(xs)
    for f in fulls:
        h = unit_compute(f, h)
    nn.functional.mse_loss(h, torch.cat(ys)).backward()
    return h.detach().chunk(n), [f.grad for f in fulls]


@exercise(
    "fsdp_unit",
    chapter=3,
    reference=fsdp_unit,
    measures=(
        "outputs and each rank's shard gradients == one process; per unit 1 "
        "all_gather for the forward, at most 1 more for the backward, and 1 "
        "reduce_scatter, no all_reduce; "
        "storages of gathered parameters allocated ≤ two units at every compute "
        "and gather"
    ),
)
def check_fsdp_unit(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_fsdp, solution)
    unit_bytes = _unit_params(n)[0].numel() * 4
    outs, grads = _fsdp_reference(n)
    for r, rep in enumerate(reports):
        _refuse(r, rep["forbidden"], "the FSDP unit")
        ops = [op for op, _ in rep["launches"]]
        if "all_reduce" in ops:
            raise ExerciseFailed(
                f"rank {r} all-reduced the gradient: every rank then holds the whole "
                "unit's gradient. Reduce-scatter it into the shard's gradient."
            )
        gathers, scatters = ops.count("all_gather"), ops.count("reduce_scatter")
        # a backward may skip a gather it does not need (the first unit's input
        # needs no gradient); what it keeps instead is judged by the bytes below
        if not UNITS <= gathers <= 2 * UNITS or scatters != UNITS:
            raise ExerciseFailed(
                f"rank {r}: {gathers} all-gathers and {scatters} reduce-scatters for "
                f"{UNITS} units; one unit takes one gather for its forward, at most "
                "one more for its backward, and one reduce-scatter."
            )
        if not torch.allclose(rep["out"], outs[r], atol=1e-6):
            raise ExerciseFailed(
                f"rank {r}: the output differs from one process's (off by "
                f"{(rep['out'] - outs[r]).abs().max():.2e}): compute with the full "
                "parameters gathered from every rank's shard, in rank order."
            )
        for u, (got, want) in enumerate(zip(rep["grads"], grads)):
            mine = want.chunk(n)[r]
            if got is None or not got.any():
                raise ExerciseFailed(
                    f"rank {r}: unit {u}'s shard got no gradient. Backward must "
                    "return the input's gradient too, or the units before it never "
                    "receive theirs."
                )
            if torch.allclose(got, mine * n, atol=1e-5) and n > 1:
                raise ExerciseFailed(
                    f"rank {r}, unit {u}: the shard's gradient is the sum over "
                    "ranks, not the average: divide by N."
                )
            if not torch.allclose(got, mine, atol=1e-6):
                raise ExerciseFailed(
                    f"rank {r}, unit {u}: the shard's gradient is not slice {r} of "
                    f"the averaged gradient (off by {(got - mine).abs().max():.2e})."
                )
        peak = max(rep["alive"])
        if peak > 2 * unit_bytes:
            raise ExerciseFailed(
                f"rank {r} held {peak // unit_bytes} units' full parameters "
                f"allocated at once ({peak} B of gathered storage; one unit is "
                f"{unit_bytes} B). FSDP keeps at most the unit computing and the "
                "next one: free the gathered parameters after the forward (do not "
                "save them for backward, nor a view or slice of them: a view keeps "
                "its whole buffer allocated) and re-gather in backward what it "
                "needs."
            )
    worst = max(max(rep["alive"]) for rep in reports)
    return [
        f"outputs and shard gradients equal one process's, on all {n} ranks",
        f"{max(sum(op == 'all_gather' for op, _ in r['launches']) for r in reports)} "
        "all-gathers "
        f"and {UNITS} reduce-scatters for {UNITS} units (at most 2 gathers each)",
        f"at most {worst // unit_bytes} unit(s) of full parameters alive at once "
        "(the bound: two)",
    ]

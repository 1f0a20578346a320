"""Chapter 03's framework exercise: PyTorch's FSDP2 on the chapter's GPT, wrapped so
that memory and traffic fit a budget.

``fully_shard``: the learner writes ``shard(model, mesh)``, calling
``torch.distributed.fsdp.fully_shard`` on the blocks and the root with a
``MixedPrecisionPolicy`` and a ``reshard_after_forward`` of their choosing. The
checker trains two steps with what it built on every rank and judges what
happened there, against :func:`fsdp2_budget`: the bytes each rank holds as DTensor
shards, every all-gather and reduce-scatter torch issued (count, dtype, bytes;
counted by :class:`dtlab.frameworks.traffic.CollectiveCounter`) and the peak bytes
of unsharded weights the modules held, sampled at every layer's forward and
backward and at every collective; bytes are counted by storage, each once and
whole. Each knob shows in one of them: wrapping only
the root gathers the whole model at once, no policy gathers fp32, keeping the
blocks gathered holds ZeRO-2's peak, wrapping every Linear multiplies the
collectives, a policy without ``reduce_dtype`` sums the gradients in bf16.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dtlab.exercises import ch03_zero  # noqa: F401 - its three exercises come first
from dtlab.exercises.ch03_solutions import shard_gpt
from dtlab.exercises.grading import ExerciseFailed, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.model import GPT, GPTConfig, SyntheticTokens

__all__ = ["check_fully_shard", "FSDP2_GPT", "fsdp2_budget"]

FSDP2_GPT = GPTConfig(vocab_size=64, seq_len=16, n_layers=4, n_heads=4, d_model=32)
FSDP2_BATCH, FSDP2_STEPS = 16, 2  # the global batch; the budget is read in step 1


def fsdp2_budget(n: int, cfg: GPTConfig = FSDP2_GPT) -> dict:
    """What ``shard(model, mesh)`` must fit, for ``cfg`` on ``n`` ranks, in bytes:
    fp32 shards held (4Ψ/N), unsharded bf16 weights alive at once (the root and
    two blocks: the one computing and the one prefetched), all-gathers per step
    (each unit at most twice, in bf16: 2 × 2Ψ B in at most 2 × units calls) and
    the gradients reduce-scattered in fp32 (4Ψ B)."""
    model = GPT(cfg)
    psi = model.n_params()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = psi - cfg.n_layers * block  # embeddings (the head is tied), final norm
    held = sum(
        math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0]) * 4
        for p in model.parameters()
    )  # each parameter cut along dim 0, this rank's rows (the largest chunk)
    return {
        "psi": psi,
        "units": 1 + cfg.n_layers,
        "root_bytes": 2 * root,
        "block_bytes": 2 * block,
        "model_bytes": 2 * psi,  # every weight whole, in bf16
        "held": held,
        "peak": 2 * (root + 2 * block),
        "gather_bytes": 2 * 2 * psi,
        "gather_calls": 2 * (1 + cfg.n_layers),
        "reduce_bytes": 4 * psi,
    }


def _storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once and whole (a
    shard padded to its chunk counts its padding; views of one buffer count it
    once)."""
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _unsharded_bytes(model) -> int:
    """Bytes of weights the modules hold whole right now: every registered
    parameter that is not a DTensor shard (FSDP2 swaps a unit's parameters for
    their unsharded tensors while it is gathered), by storage."""
    from torch.distributed.tensor import DTensor

    return _storage_bytes(
        p
        for module in model.modules()
        for p in module._parameters.values()
        if p is not None and not isinstance(p, DTensor)
    )


def probe_fully_shard(solution) -> dict:
    """Wrap a fresh GPT with ``solution(model, mesh)`` and train it two steps with
    AdamW over its parameters, sampling the unsharded bytes at every leaf module's
    forward (before and after) and backward, and at every collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dtlab.frameworks.traffic import CollectiveCounter

    r, n = rank_and_size()
    mesh = init_device_mesh("cpu", (n,))
    model = GPT(FSDP2_GPT)
    returned = solution(model, mesh)
    model = returned if isinstance(returned, nn.Module) else model
    params = dict(model.named_parameters())
    plain = [k for k, p in params.items() if not isinstance(p, DTensor)]
    found = {
        "plain": plain,
        "plain_bytes": sum(params[k].numel() * params[k].element_size() for k in plain),
        "dtypes": sorted(
            {str(p.dtype).removeprefix("torch.") for p in params.values()}
        ),
        "off_mesh": [
            k
            for k, p in params.items()
            if isinstance(p, DTensor)
            and (p.device_mesh.size() != n or tuple(p.placements) != (Shard(0),))
        ],
    }
    if plain or found["off_mesh"]:
        return found  # training would only fail in a less telling way
    samples: list[tuple[int, int]] = []  # (step, unsharded bytes)
    step = [0]

    def sample(*_):
        samples.append((step[0], _unsharded_bytes(model)))

    def after_forward(_module, _args, out):
        sample()
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(sample)  # fires as this layer's backward starts

    for module in model.modules():
        if not list(module.children()):  # the layers that compute
            module.register_forward_pre_hook(sample)
            module.register_forward_hook(after_forward)

    class Counter(CollectiveCounter):
        def _record(self, name, args):
            super()._record(name, args)
            sample()

    counter = Counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = SyntheticTokens(FSDP2_GPT.vocab_size, FSDP2_GPT.seq_len)
    for t in range(FSDP2_STEPS):
        x, y = data.shard(t, FSDP2_BATCH, r, n)  # (B/N, T)
        step[0] = counter.step = t
        with counter:
            _, loss = model(x, y)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    found |= {
        "held": _storage_bytes(p.to_local() for p in model.parameters()),
        "collectives": [
            (c["op"], c["dtype"], c["payload_bytes"])
            for c in counter.records
            if c["step"] == FSDP2_STEPS - 1
        ],
        "peak": max(b for s, b in samples if s == FSDP2_STEPS - 1),
        "after_step": _unsharded_bytes(model),
        "loss": loss.item(),
    }
    return found


def _of(collectives, op) -> tuple[int, set, int]:
    """calls, dtypes and bytes of one op in a step's collectives."""
    mine = [(d, b) for o, d, b in collectives if o == op]
    return len(mine), {d for d, _ in mine}, sum(b for _, b in mine)


@exercise(
    "fully_shard",
    chapter=3,
    reference=shard_gpt,
    measures=(
        "after the learner's shard(model, mesh) and two AdamW steps on every rank: "
        "every parameter a Shard(0) DTensor of fp32 on the mesh and the bytes each "
        "rank holds (4Ψ/N); every collective torch issued in a step (all-gathers in "
        "bf16, at most two per unit, 2 × 2Ψ B; reduce-scatters in fp32, 4Ψ B); the "
        "peak bytes of unsharded weights the modules held (root + two blocks)"
    ),
)
def check_fully_shard(solution, cluster=None):
    n = world_size_of(cluster)
    budget = fsdp2_budget(n)
    reports = on_every_rank(cluster, probe_fully_shard, solution)
    for r, rep in enumerate(reports):
        if rep["plain"]:
            shown = ", ".join(rep["plain"][:4]) + (
                ", ..." if len(rep["plain"]) > 4 else ""
            )
            raise ExerciseFailed(
                f"rank {r} holds {rep['plain_bytes']:,} B of whole parameters "
                f"({shown}) beside its shards; the budget is {budget['held']:,} B "
                "of shards in all. What no fully_shard call covers stays a plain "
                "tensor on every rank, and its gradient is never averaged: call "
                "fully_shard(model, ...) on the root too, after the blocks, so it "
                "takes the embeddings and the final norm."
            )
        if rep["off_mesh"]:
            raise ExerciseFailed(
                f"rank {r}: {rep['off_mesh'][0]} is not sharded along dim 0 over the "
                f"{n} ranks of the mesh you were given: pass mesh=mesh to every "
                "fully_shard call."
            )
        if rep["dtypes"] != ["float32"]:
            raise ExerciseFailed(
                f"rank {r}: the sharded parameters are {rep['dtypes']}; the optimizer "
                "must step fp32 shards (the master weights). Leave the model in fp32 "
                "and let a MixedPrecisionPolicy cast what is gathered."
            )
    rep = reports[0]
    gathers, gather_types, gather_bytes = _of(rep["collectives"], "all_gather")
    scatters, scatter_types, scatter_bytes = _of(rep["collectives"], "reduce_scatter")
    if "float32" in gather_types:
        raise ExerciseFailed(
            f"the all-gathers carried float32: {gather_bytes:,} B in a step, "
            f"{gather_bytes / budget['gather_bytes']:.2f}× the budget's "
            f"{budget['gather_bytes']:,} B, and the gathered weights "
            f"peaked at {rep['peak']:,} B. Without a MixedPrecisionPolicy FSDP2 "
            "gathers and computes in the parameters' dtype: "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16) gathers bf16 copies "
            "while the fp32 shards stay the optimizer's."
        )
    if gathers <= 2 and rep["peak"] >= budget["model_bytes"]:
        raise ExerciseFailed(
            f"{gathers} all-gather(s) of the whole model in a step ({gather_bytes:,} "
            f"B), and {rep['peak']:,} B of weights unsharded at once (the budget: "
            f"{budget['peak']:,} B). Only the root is a unit, so every weight is "
            "gathered before the first layer runs and kept to the end. Call "
            "fully_shard on each block first: each becomes its own unit, gathered "
            "just before it runs and freed after."
        )
    if gathers > budget["gather_calls"]:
        raise ExerciseFailed(
            f"{gathers} all-gathers in a step, for a budget of "
            f"{budget['gather_calls']} (each of {budget['units']} units at most "
            "twice). The units are finer than the transformer blocks: every "
            "collective pays its latency, and a layer too small to hide it behind "
            "compute gains nothing. Wrap the blocks (model.blocks) and the root, "
            "nothing smaller."
        )
    if rep["peak"] > budget["peak"]:
        if gathers < budget["gather_calls"] - 1:
            raise ExerciseFailed(
                f"{rep['peak']:,} B of weights unsharded at once, for a budget of "
                f"{budget['peak']:,} B (the root and two blocks); {gathers} "
                f"all-gathers in a step, one per unit. Every block stayed gathered "
                "from its forward to its backward: ZeRO-2's peak. "
                "reshard_after_forward=True frees each block after its forward and "
                "gathers it again for its backward (one more all-gather per block, "
                "3Ψ of traffic instead of 2Ψ)."
            )
        raise ExerciseFailed(
            f"{rep['peak']:,} B of weights unsharded at once, for a budget of "
            f"{budget['peak']:,} B: the root and two blocks of "
            f"{budget['block_bytes']:,} B in bf16."
        )
    if gather_bytes > budget["gather_bytes"]:
        raise ExerciseFailed(
            f"{gather_bytes:,} B all-gathered in a step, for a budget of "
            f"{budget['gather_bytes']:,} B (every weight at most twice, in bf16)."
        )
    if scatter_types != {"float32"}:
        raise ExerciseFailed(
            f"the gradients were reduce-scattered in {', '.join(sorted(scatter_types))}"
            f" ({scatter_bytes:,} B in a step); the budget sums them in fp32 "
            f"({budget['reduce_bytes']:,} B). reduce_dtype defaults to param_dtype, "
            "and bf16 keeps 8 significant bits, to which every partial sum of the "
            "ranks' gradients is rounded: set reduce_dtype=torch.float32 in the "
            "MixedPrecisionPolicy."
        )
    if scatter_bytes != budget["reduce_bytes"]:
        raise ExerciseFailed(
            f"{scatter_bytes:,} B reduce-scattered in a step ({scatters} calls); "
            f"every gradient once, in fp32, is {budget['reduce_bytes']:,} B."
        )
    if rep["after_step"]:
        raise ExerciseFailed(
            f"{rep['after_step']:,} B of weights were still unsharded after the "
            "step: every unit should be back to its shards between steps."
        )
    if not all(math.isfinite(r["loss"]) for r in reports):
        raise ExerciseFailed(
            f"the losses are not finite: {[r['loss'] for r in reports]}"
        )
    held = max(r["held"] for r in reports)
    if held > budget["held"]:
        raise ExerciseFailed(
            f"a rank holds {held:,} B of parameter shards; 4Ψ/N is "
            f"{budget['held']:,} B."
        )
    return [
        f"every parameter a Shard(0) DTensor of fp32: {held:,} B per rank "
        f"(4Ψ/N, Ψ = {budget['psi']:,})",
        f"per step {gathers} all-gathers of bf16, {gather_bytes:,} B (budget "
        f"{budget['gather_bytes']:,}); {scatters} reduce-scatters of fp32, "
        f"{scatter_bytes:,} B",
        f"at most {rep['peak']:,} B of weights unsharded at once (budget "
        f"{budget['peak']:,}: the root and two blocks; the whole model is "
        f"{budget['model_bytes']:,})",
    ]

"""Chapter 08's exercises: activation checkpointing, and gradient accumulation.

Both run in this process (each rank would do the same thing alone).

1. ``checkpointing``: a GPT with dropout 0.1 wrapped by the learner against the same
   GPT unwrapped: the loss and every gradient bit-identical (dropout included),
   every block recomputed in backward (the checker's pre-hooks on each block's
   modules count two calls, one in the forward and one in the recomputation), and
   no more bytes left allocated by the forward than dtlab's full recomputation
   leaves: every module's output and every tensor autograd saves, followed by
   their storages (:class:`.ch08_storage.ForwardStorages`), so an activation the
   learner's code keeps alive itself counts too.
2. ``accumulation``: microbatches of *unequal* sizes; the gradient left in
   ``.grad`` must be the mean loss's over every sample, and the activations
   allocated at once (the same storages followed, sampled at every module output
   and every saved tensor) no more than the largest microbatch's.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import recompute
from dtlab.exercises.ch08_solutions import accumulate_gradients, checkpoint_blocks
from dtlab.exercises.ch08_storage import ForwardStorages, describe
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.watch import Watch
from dtlab.model import GPT, GPTConfig, SyntheticTokens, param_generator

__all__ = ["check_checkpointing", "check_accumulation"]

CONFIG = GPTConfig(
    vocab_size=32, seq_len=16, n_layers=3, n_heads=2, d_model=32, dropout=0.1
)


def _tick(calls: dict, key, counts: dict) -> None:
    """One more call of one module of part ``key``; the part's count is its
    busiest module's."""
    counts["n"] = counts.get("n", 0) + 1
    calls[key] = max(calls[key], counts["n"])


def _run(prepare, x, y):
    """A fresh GPT, ``prepare``d; one forward (counting saved bytes and each block
    module's calls) and backward with the same dropout masks every time."""
    model = GPT(CONFIG, seed=0)
    # each parameter by its name before the learner's code: a wrapper module may
    # rename it (torch's checkpoint_wrapper adds "_checkpoint_wrapped_module.")
    names = {id(p): n for n, p in model.named_parameters()}
    forbidden = {
        recompute.apply_activation_checkpointing: (
            "dtlab.recompute.apply_activation_checkpointing"
        )
    }
    with Watch(forbidden) as seen:
        attempt(prepare, model)
    # how often each part of each block ran: a part recomputed through its own
    # __call__ (the block's children) or through its parent's forward (theirs)
    calls = {}
    for b, block in enumerate(model.blocks):
        for name, child in block.named_children():
            calls[b, name] = 0
            for part in child.modules():
                counts = {}
                part.register_forward_pre_hook(
                    lambda mod, args, key=(b, name), counts=counts: _tick(
                        calls, key, counts
                    )
                )
    torch.manual_seed(1234)  # the forward's dropout masks
    with ForwardStorages(model, exclude=[x, y]) as held:
        loss = model(x, y)[1]
        held.sample()  # what the forward left allocated for its backward
    found = held.at_peak
    attempt(loss.backward)
    grads = {names.get(id(p), n): p.grad for n, p in model.named_parameters()}
    new = [n for n, p in model.named_parameters() if id(p) not in names]
    return {
        "new_params": new,
        "loss": loss.detach(),
        "grads": grads,
        "saved": held.peak,
        "kinds": ForwardStorages.by_kind(found),
        "kept": ForwardStorages.split(found)[1],  # bytes no graph holds
        "calls": calls,
        "forbidden": seen.forbidden,
    }


@exercise(
    "checkpointing",
    chapter=8,
    reference=checkpoint_blocks,
    local=True,
    measures=(
        "loss and every gradient torch.equal to the unwrapped GPT (dropout 0.1); "
        "every block's modules run twice (forward + recomputation); activation "
        "bytes the forward leaves allocated ≤ dtlab's full recomputation's"
    ),
)
def check_checkpointing(solution, cluster=None):
    x, y = SyntheticTokens(CONFIG.vocab_size, CONFIG.seq_len).batch(0, 4)
    plain = _run(lambda m: m, x, y)
    full = _run(lambda m: recompute.apply_activation_checkpointing(m, "full"), x, y)
    mine = _run(solution, x, y)
    if mine["forbidden"]:
        raise ExerciseFailed(
            f"you called {', '.join(mine['forbidden'])}: wrap the blocks yourself, "
            "with torch.utils.checkpoint.checkpoint."
        )
    for b in range(CONFIG.n_layers):
        twice = [n for (k, n), c in mine["calls"].items() if k == b and c >= 2]
        if not twice:
            raise ExerciseFailed(
                f"block {b} is not recomputed in backward: its modules ran once. "
                "Wrap every block of model.blocks."
            )
        once = [n for (k, n), c in mine["calls"].items() if k == b and c < 2]
        if once:
            raise ExerciseFailed(
                f"block {b}: only {twice} are recomputed, {once} are not: checkpoint "
                "the whole block, so that only its input is kept."
            )
    if mine["new_params"]:
        raise ExerciseFailed(
            f"the model trains parameters it did not have: {mine['new_params'][:3]}. "
            "Checkpointing wraps how a block runs; its weights stay the very tensors "
            "they were (no copies, no new modules with fresh weights)."
        )
    if not torch.equal(mine["loss"], plain["loss"]):
        raise ExerciseFailed("the loss changed: checkpointing must not change numbers")
    for name, want in plain["grads"].items():
        got = mine["grads"].get(name)
        if got is None:
            raise ExerciseFailed(
                f"{name} is no longer in the model: checkpointing must keep every "
                "parameter of the blocks it wraps."
            )
        if not torch.equal(got, want):
            raise ExerciseFailed(
                f"the gradient of {name} differs from the model without "
                "checkpointing. The recomputation must see the forward's random "
                "state (preserve_rng_state=True), so dropout draws the same masks, "
                "and run with gradients enabled."
            )
    if mine["saved"] > full["saved"]:
        more = {
            kind: n - full["kinds"].get(kind, 0)
            for kind, n in mine["kinds"].items()
            if n > full["kinds"].get(kind, 0)
        }
        raise ExerciseFailed(
            f"the forward left {mine['saved']} bytes of activations allocated; full "
            f"recomputation leaves {full['saved']} (without: {plain['saved']}). "
            f"Beyond it: {describe(more)}; {mine['kept']} B are held by no graph "
            f"(with full recomputation {full['kept']} B). A checkpointed block "
            "keeps only its input: what else keeps these tensors alive?"
        )
    return [
        "loss and every gradient bit-identical to the unwrapped GPT, dropout 0.1",
        f"every block recomputed; {mine['saved']} B of activations left allocated "
        f"by the forward (full recomputation {full['saved']} B, none "
        f"{plain['saved']} B)",
    ]


# ---- 2. accumulation ---------------------------------------------------------------
SIZES = (4, 2, 6)  # unequal microbatches: a plain 1/k weighting is wrong


def _accumulation_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))


def _micro_batches():
    gen = param_generator(0, "accumulation")
    return [
        (torch.randn(b, 8, generator=gen), torch.randn(b, 8, generator=gen))
        for b in SIZES
    ]


def _following(model, batches) -> ForwardStorages:
    """Every module output and saved tensor of ``model``, sampled at each one;
    the microbatches are the checker's, not activations."""
    inputs = [t for b in batches for t in b]
    return ForwardStorages(
        model, exclude=inputs, sample_each=True, spare_root_output=True
    )


def _activation_peak(model, x, y) -> int:
    with _following(model, [(x, y)]) as held:
        nn.functional.mse_loss(model(x), y)
    return held.peak


def _weighting(got: torch.Tensor, name: str, batches) -> str:
    """What a wrong ``.grad`` of ``name`` is, told from each microbatch's own
    gradient of its mean loss: the last one alone, or another weighting."""
    sizes = [b[0].shape[0] for b in batches]
    n, k = sum(sizes), len(batches)
    g = []
    for xb, yb in batches:
        one = _accumulation_model()
        nn.functional.mse_loss(one(xb), yb).backward()
        g.append(dict(one.named_parameters())[name].grad)
    if any(
        torch.allclose(got, g[-1] * w, atol=1e-6) for w in (sizes[-1] / n, 1 / k, 1)
    ):
        return (
            "only the last microbatch's gradient is left: no zero_grad between "
            "microbatches, their gradients must add up in .grad."
        )
    wrong = f"the gradient of {name} is not the mean loss's over all {n} samples"
    fix = (
        f"With microbatches of {sizes} samples, weight each microbatch's mean loss "
        f"by its share of the samples (b_i / {n}) and add the gradients up"
    )
    causes = (
        (
            sum(g) / k,
            f"each microbatch counts 1/{k} whatever its size",
            f", not by 1/{k}",
        ),
        (sum(g), f"the {k} mean losses were added unweighted: about {k}× too much", ""),
        (
            sum(b * gi for b, gi in zip(sizes, g)),
            f"{n}× too large: summed over the samples, never divided by the {n}",
            "",
        ),
    )
    for want, why, tail in causes:
        if torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            return f"{wrong}: {why}. {fix}{tail}."
    return f"{wrong}. {fix}."


@exercise(
    "accumulation",
    chapter=8,
    reference=accumulate_gradients,
    local=True,
    measures=(
        "microbatches of 4, 2 and 6 samples: .grad == the mean loss's gradient "
        "over all 12; activations held at once ≤ the largest microbatch's"
    ),
)
def check_accumulation(solution, cluster=None):
    batches = _micro_batches()
    whole = _accumulation_model()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    nn.functional.mse_loss(whole(x), y).backward()
    largest = max(_activation_peak(_accumulation_model(), *b) for b in batches)
    model = _accumulation_model()
    with _following(model, batches) as held:
        attempt(solution, model, batches, nn.functional.mse_loss)
    peak = held.peak
    if peak > largest:
        graph, kept = held.split(held.at_peak)
        if graph > largest or not kept:
            raise ExerciseFailed(
                f"{peak} bytes of activations were held at once, {graph} of them "
                f"saved for backward, more than the largest microbatch's "
                f"{largest}: all microbatches were alive together. Call backward "
                "after each microbatch's forward."
            )
        raise ExerciseFailed(
            f"{peak} bytes of activations were allocated at once, more than the "
            f"largest microbatch's {largest}: {kept} B of them no graph needs any "
            f"more stay alive because your code holds them "
            f"({describe(held.by_kind(held.at_peak, kept_by_code_only=True))}). "
            "Keep nothing of a microbatch past its backward but numbers "
            "(loss.item())."
        )
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        if p.grad is None:
            raise ExerciseFailed(f"{name} has no gradient")
        if torch.allclose(p.grad, q.grad, atol=1e-6):
            continue
        raise ExerciseFailed(_weighting(p.grad, name, batches))
    return [
        f"the gradient equals the mean loss's over {x.shape[0]} samples in "
        f"microbatches of {list(SIZES)}",
        f"at most {peak} B of activations allocated at once (the largest "
        f"microbatch's: {largest} B)",
    ]

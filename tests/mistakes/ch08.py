"""The mistakes learners make in chapter 08's exercises, each rejected by its
checker with the message fragment given (``tests/test_exercises.py`` proves it)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from dtlab.exercises import ch08_memory  # noqa: F401 - declares the exercises
from dtlab.exercises.grading import mistake

__all__: list[str] = []


def _wrap(module, **options):
    forward = module.forward

    def recomputed(*args, forward=forward):
        return checkpoint(forward, *args, use_reentrant=False, **options)

    module.forward = recomputed


# ---- checkpointing -----------------------------------------------------------------
@mistake("checkpointing", expect="block 1 is not recomputed")
def checkpoints_only_the_first_block(model):
    """``model.blocks[0]`` only: the other blocks keep all their activations."""
    _wrap(model.blocks[0])
    return model


@mistake("checkpointing", expect="only ['attn'] are recomputed")
def checkpoints_only_the_attention(model):
    """Wraps each block's attention: the MLP's activations, most of the block's,
    stay."""
    for block in model.blocks:
        _wrap(block.attn)
    return model


@mistake("checkpointing", expect="preserve_rng_state=True")
def forgets_the_random_state(model):
    """``preserve_rng_state=False``: the recomputation draws new dropout masks, so
    backward differentiates another network than the forward ran."""
    for block in model.blocks:
        _wrap(block, preserve_rng_state=False)
    return model


@mistake("checkpointing", expect="dtlab.recompute.apply_activation_checkpointing")
def calls_the_library(model):
    """dtlab's own full recomputation: right, and not written."""
    from dtlab.recompute import apply_activation_checkpointing

    return apply_activation_checkpointing(model, "full")


@mistake("checkpointing", expect="block 0 is not recomputed")
def saves_memory_with_no_grad(model):
    """Runs the blocks under ``torch.no_grad()`` to save their activations: nothing
    is kept, nothing is recomputed, and the blocks get no gradient."""
    for block in model.blocks:
        forward = block.forward

        def no_grad_forward(x, forward=forward):
            with torch.no_grad():
                return forward(x)

        block.forward = no_grad_forward
    return model


@mistake("checkpointing", expect="output of blocks.0.mlp")
def keeps_each_mlp_output(model):
    """The right wrapping, plus a forward hook that keeps each block's MLP output
    in a list: those tensors stay allocated however the blocks are recomputed."""
    kept = []
    for block in model.blocks:
        _wrap(block, preserve_rng_state=True)
        block.mlp.register_forward_hook(lambda mod, args, out: kept.append(out))
    model.kept_mlp_outputs = kept
    return model


# ---- accumulation ------------------------------------------------------------------
@mistake("accumulation", expect="not by 1/3")
def divides_by_the_number_of_micro_batches(model, micro_batches, loss_fn):
    """loss / k: right only when every microbatch has the same size."""
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()


@mistake("accumulation", expect="Call backward after each microbatch")
def one_backward_of_the_summed_losses(model, micro_batches, loss_fn):
    """Sums the weighted losses and calls backward once: right gradient, every
    microbatch's activations alive at once (no memory saved at all)."""
    total = sum(x.shape[0] for x, _ in micro_batches)
    loss = sum(loss_fn(model(x), y) * x.shape[0] / total for x, y in micro_batches)
    loss.backward()


@mistake("accumulation", expect="only the last microbatch")
def zeroes_before_each_micro_batch(model, micro_batches, loss_fn):
    """Zeroes the gradients before every microbatch, as a training step would."""
    total = sum(x.shape[0] for x, _ in micro_batches)
    for x, y in micro_batches:
        model.zero_grad()
        (loss_fn(model(x), y) * x.shape[0] / total).backward()


@mistake("accumulation", expect="is not the mean loss's")
def sums_the_mean_losses(model, micro_batches, loss_fn):
    """Adds each microbatch's mean loss unweighted: k times too much, and the
    small microbatches count as much as the big ones."""
    for x, y in micro_batches:
        loss_fn(model(x), y).backward()


@mistake("accumulation", expect="because your code holds them")
def keeps_the_hidden_activations(model, micro_batches, loss_fn):
    """Backward after each microbatch, but every microbatch's hidden activations
    kept (detached, "for inspection"): autograd frees nothing the list holds."""
    total = sum(x.shape[0] for x, _ in micro_batches)
    kept = []
    for x, y in micro_batches:
        hidden = model[1](model[0](x))
        kept.append(hidden.detach())
        (loss_fn(model[2](hidden), y) * x.shape[0] / total).backward()

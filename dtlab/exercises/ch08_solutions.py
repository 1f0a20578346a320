"""Chapter 08's reference solutions: activation checkpointing per block (Chen et
al. 2016) and gradient accumulation over microbatches of unequal size.
``dtlab.exercises.solution(name)`` shows each; :mod:`.ch08_memory` checks a
learner's against them."""

from __future__ import annotations

__all__ = ["checkpoint_blocks", "accumulate_gradients"]


def checkpoint_blocks(model):
    """Make every block of ``model.blocks`` keep only its input in the forward and
    recompute the rest in backward, in place. Non-reentrant checkpointing keeps
    the random state, so dropout draws the same masks when the block is rebuilt:
    the gradients are bit-identical to the run without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    for block in model.blocks:
        forward = block.forward  # the class's, bound to this block

        def recomputed(x, forward=forward):
            return checkpoint(forward, x, use_reentrant=False, preserve_rng_state=True)

        block.forward = recomputed  # shadows the class's; names and hooks unchanged
    return model


def accumulate_gradients(model, micro_batches, loss_fn):
    """Leave in ``.grad`` the gradient of the mean loss over every sample of
    ``micro_batches`` (``(x, y)`` pairs of *unequal* sizes), holding one
    microbatch's activations at a time: backward after each forward, each loss
    (a mean over its microbatch) weighted by its share of the samples."""
    total = sum(x.shape[0] for x, _ in micro_batches)
    for x, y in micro_batches:
        loss = loss_fn(model(x), y)  # the mean over this microbatch
        (loss * x.shape[0] / total).backward()  # gradients add up in .grad

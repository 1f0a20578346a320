"""Right answers written differently from the reference are accepted: a checker
that rejects one teaches the learner that a right answer is wrong. Each answer
here is one a learner could write from the exercise's docstring alone; the
wrong answers of the same exercises are in their catalogues
(tests/test_exercises.py). The live exercises' futures-style answers are in
tests/test_exercise_waits.py."""

import pytest
import torch
from torch import nn

from dtlab.exercises import check_checkpointing


def checkpoint_wrapper_from_torch(model):
    """torch's own wrapper module (it renames the block's parameters)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


class _Recomputed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def a_wrapper_module_of_ones_own(model):
    """A small module of one's own around each block."""
    model.blocks = nn.ModuleList(_Recomputed(b) for b in model.blocks)
    return model


def reentrant_checkpointing(model):
    """The older, reentrant implementation: the block's input needs a gradient,
    which a transformer block's input has."""
    for block in model.blocks:
        forward = block.forward

        def recomputed(x, forward=forward):
            return torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=True)

        block.forward = recomputed
    return model


@pytest.mark.parametrize(
    "answer",
    [
        checkpoint_wrapper_from_torch,
        a_wrapper_module_of_ones_own,
        reentrant_checkpointing,
    ],
)
def test_checkpointing_accepts_other_right_answers(answer):
    assert check_checkpointing(answer).passed


def copies_the_blocks(model):
    """Wrong: checkpoints copies of the blocks, so the model trains new tensors."""
    import copy

    model.blocks = nn.ModuleList(_Recomputed(copy.deepcopy(b)) for b in model.blocks)
    return model


def test_checkpointing_names_new_parameters_as_the_cause():
    from dtlab.exercises import ExerciseFailed

    with pytest.raises(ExerciseFailed, match="trains parameters it did not have"):
        check_checkpointing(copies_the_blocks)

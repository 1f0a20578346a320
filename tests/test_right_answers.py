"""Right answers written differently from the reference are accepted: a checker
that rejects one teaches the learner that a right answer is wrong. Each answer
here is one a learner could write from the exercise's docstring alone; the
wrong answers of the same exercises are in their catalogues
(tests/test_exercises.py). The live exercises' futures-style answers are in
tests/test_exercise_waits.py."""

import pytest
import torch
from torch import nn

from dtlab.exercises import check_checkpointing, check_zero1_step
from dtlab.lab.kernel.shipping import ship_by_value


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


# ---- zero1_step: optimizer state is what is kept per parameter element -------------
def zero1_with_torchs_step_counter(flat_param, flat_grad, state, **adamw):
    """As torch's AdamW keeps it: the step counter a 0-dim tensor."""
    import torch

    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    g = torch.empty(S)
    comm.reduce_scatter(g, flat_grad.clone())
    g /= n
    if not state:
        state.update(step=torch.tensor(0.0), m=torch.zeros(S), v=torch.zeros(S))
    state["step"] += 1
    t = state["step"].item()
    b1, b2 = adamw["betas"]
    p = flat_param[r * S : (r + 1) * S].clone()
    p.mul_(1 - adamw["lr"] * adamw["weight_decay"])
    state["m"].lerp_(g, 1 - b1)
    state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = (state["v"] / (1 - b2**t)).sqrt() + adamw["eps"]
    p -= adamw["lr"] / (1 - b1**t) * state["m"] / denom
    comm.all_gather(flat_param, p)


def zero1_with_torchs_adamw_on_the_slice(flat_param, flat_grad, state, **adamw):
    """torch.optim.AdamW itself, on an nn.Parameter holding this rank's slice."""
    import torch

    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    if "opt" not in state:
        state["slice"] = torch.nn.Parameter(flat_param[r * S : (r + 1) * S].clone())
        state["opt"] = torch.optim.AdamW([state["slice"]], **adamw)
    grad = torch.empty(S)
    comm.reduce_scatter(grad, flat_grad.clone())
    state["slice"].grad = grad / n
    state["opt"].step()
    comm.all_gather(flat_param, state["slice"].detach())


def zero1_keeps_the_whole_state(flat_param, flat_grad, state, **adamw):
    """Wrong: torch's AdamW on the whole flat tensor (all Ψ of state per rank)."""
    import torch

    from dtlab import comm

    n, r = comm.group_size(), comm.group_rank()
    S = flat_param.numel() // n
    if "opt" not in state:
        state["all"] = torch.nn.Parameter(flat_param.clone())
        state["opt"] = torch.optim.AdamW([state["all"]], **adamw)
    grad = torch.empty(S)
    comm.reduce_scatter(grad, flat_grad.clone())
    full = torch.zeros_like(flat_param)
    full[r * S : (r + 1) * S] = grad / n
    state["all"].grad = full
    state["opt"].step()
    comm.all_gather(flat_param, state["all"].detach()[r * S : (r + 1) * S].clone())


for _answer in (
    zero1_with_torchs_step_counter,
    zero1_with_torchs_adamw_on_the_slice,
    zero1_keeps_the_whole_state,
):
    ship_by_value(_answer)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "answer", [zero1_with_torchs_step_counter, zero1_with_torchs_adamw_on_the_slice]
)
def test_zero1_counts_state_per_element_not_a_step_counter(answer, lab_cluster):
    assert check_zero1_step(answer, lab_cluster(4)).passed


@pytest.mark.cluster
def test_zero1_still_refuses_the_whole_state(lab_cluster):
    from dtlab.exercises import ExerciseFailed

    with pytest.raises(ExerciseFailed, match="optimizer-state values"):
        check_zero1_step(zero1_keeps_the_whole_state, lab_cluster(4))

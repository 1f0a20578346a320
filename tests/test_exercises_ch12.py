"""Chapter 12's exercises beyond the catalogue (tests/test_exercises.py proves each
checker accepts its reference and rejects every wrong solution of its catalogue
with the message it names).

Here: the references are the library's mechanisms, so a checker that trusts them
trusts the library: delayed scaling against :class:`dtlab.fp8.DelayedScaling` on a
sequence the checker does not use (e5m2 and a margin of 2 included); the split
backward against :func:`dtlab.pipeline.backward_pass`, B then W, with and without
an input, from a stage's output or from a loss (the checker itself compares whole
pipelines with the plain model); the owners against
:func:`dtlab.muon.assign_owners` on random sizes. Calling the library's own
function is refused, and a stub, even one whose source cannot be read, is "not
attempted yet", the reference running in its place under the test command's
switch. All in this process, a few seconds.
"""

import random

import pytest
import torch

from dtlab import exercises
from dtlab.exercises import REGISTRY, ExerciseFailed
from dtlab.fp8 import DelayedScaling
from dtlab.fp8.formats import amax, fp8_format
from dtlab.muon import assign_owners
from dtlab.pipeline import backward_pass

CHAPTER_12 = ["delayed_scaling_update", "split_backward", "assign_owners"]


def test_chapter_12_declares_three_local_exercises():
    assert [n for n, ex in REGISTRY.items() if ex.chapter == 12] == CHAPTER_12
    for name in CHAPTER_12:
        assert REGISTRY[name].local
        assert REGISTRY[name].checker is getattr(exercises, f"check_{name}")


@pytest.mark.parametrize("fmt,history_len,margin", [("e4m3", 3, 2.0), ("e5m2", 5, 0)])
def test_the_fp8_reference_is_delayed_scaling(fmt, history_len, margin):
    update = REGISTRY["delayed_scaling_update"].reference
    f, gen = fp8_format(fmt), torch.Generator().manual_seed(1)
    ds = DelayedScaling(f, history_len, margin)
    ds.quantize(torch.randn(64, generator=gen))  # the first cast sets the state
    for step in range(12):
        size = 0.0 if step in (3, 4, 5, 6, 7, 8) else 10.0 ** (step % 4 - 1)
        x = torch.randn(64, generator=gen) * size  # zeros long enough to fill L
        history, before = ds.history.clone(), ds.scale.clone()
        ds.quantize(x)
        new, next_scale = update(history, before, amax(x), f.max, margin)
        # the same fp32 operations as dtlab.fp8.formats.scale_from_amax: equal bits
        assert torch.equal(new, ds.history), step
        assert torch.equal(torch.as_tensor(next_scale), ds.scale), step


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _stage(seed: int):
    """A small chunk of a stage: its input (a leaf, as a received activation is),
    its weights, and its output."""
    gen = _gen(seed)
    layers = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)
    )
    for q in layers.parameters():
        q.data = torch.randn(q.shape, generator=gen)
    inp = torch.randn(4, 8, generator=gen).requires_grad_()
    return inp, list(layers.parameters()), layers(inp)


@pytest.mark.parametrize("first_stage", [False, True])
@pytest.mark.parametrize("is_loss", [False, True])
def test_the_split_reference_is_backward_pass(first_stage, is_loss):
    # B then W of the reference against the library's split (the executor's
    # backward_pass), on a stage's output or on a loss, with an input or without
    reference = REGISTRY["split_backward"].reference
    results = []
    for split in (backward_pass, reference):
        inp, weights, out = _stage(0)
        grad = None if is_loss else torch.randn(out.shape, generator=_gen(1))
        if is_loss:
            out = out.square().mean()
        given = None if first_stage else inp
        for op in ("B", "W"):
            split(op, out, grad, given, weights)
        results.append([inp.grad, *(q.grad for q in weights)])
    library, mine = results
    assert (library[0] is None) == first_stage == (mine[0] is None)
    for a, b in zip(library, mine):
        assert a is None and b is None or torch.equal(a, b)


def test_the_owner_reference_is_the_librarys():
    rng = random.Random(0)
    reference = REGISTRY["assign_owners"].reference
    for _ in range(50):
        numels = [
            rng.choice((16, 64, 256, 4096)) * rng.randint(1, 9) for _ in range(12)
        ]
        n = rng.randint(1, 9)
        assert reference(list(numels), n) == assign_owners(numels, n)


def borrowed_split(op, out, grad, inp, weights):
    backward_pass(op, out, grad, inp, weights, split=True)


def borrowed_owners(numels, world_size):
    return assign_owners(numels, world_size)


@pytest.mark.parametrize(
    "name,answer,label",
    [
        ("split_backward", borrowed_split, "dtlab.pipeline.backward_pass"),
        ("assign_owners", borrowed_owners, "dtlab.muon.assign_owners"),
    ],
)
def test_calling_the_librarys_own_is_refused(name, answer, label):
    with pytest.raises(ExerciseFailed, match=label):
        REGISTRY[name].checker(answer)


def stub_split(op, out, grad, inp, weights):
    """Your B and W."""
    raise NotImplementedError


def test_a_stub_is_not_attempted_and_substituted_under_the_switch(monkeypatch):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    assert exercises.check_split_backward(stub_split).status == "not attempted yet"
    # a stub whose source cannot be read raises inside the pipeline's step
    hidden = eval("lambda *args: (_ for _ in ()).throw(NotImplementedError())")
    assert exercises.check_split_backward(hidden).status == "not attempted yet"
    monkeypatch.setenv(exercises.SUBSTITUTE_ENV, "1")
    report = exercises.check_split_backward(stub_split)
    assert report.status == "reference substituted" and report.lines

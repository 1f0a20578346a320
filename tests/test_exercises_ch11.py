"""Chapter 11's exercises are proven like the others (tests/test_exercises.py): each
checker accepts its reference and rejects every wrong solution of its catalogue with
the message the catalogue names. All three are pure functions, checked in this
process (no cluster), so this file runs in a few seconds.

Beyond the catalogue: the references agree with the library they teach (the merge
with :func:`dtlab.context_parallel.merge_attention_blocks`, the dispatch with
:func:`dtlab.moe.dispatch_order`, the splits with what
:class:`dtlab.moe.ExpertParallelDispatch` computes from the same matrix), a stub is
"not attempted yet", and under the test command's switch the reference runs in its
place.
"""

import pytest
import torch

from dtlab import exercises
from dtlab.context_parallel import block_attention, merge_attention_blocks
from dtlab.exercises import REGISTRY, ExerciseFailed
from dtlab.moe import dispatch_order, expert_capacity, top_k_routing

CHAPTER_11 = [name for name, ex in REGISTRY.items() if ex.chapter == 11]
MISTAKES = [
    pytest.param(name, m, id=f"{name}-{m.name}")
    for name in CHAPTER_11
    for m in REGISTRY[name].mistakes
]


def test_chapter_11_has_three_local_exercises_with_four_mistakes_each():
    assert CHAPTER_11 == ["merge_attention", "moe_dispatch", "all_to_all_splits"]
    for name in CHAPTER_11:
        ex = REGISTRY[name]
        assert ex.local and len(ex.mistakes) >= 4 and all(m.why for m in ex.mistakes)
        assert ex.measures and ex.checker is getattr(exercises, f"check_{name}")


@pytest.mark.parametrize("name", CHAPTER_11)
def test_checker_accepts_its_reference(name):
    report = REGISTRY[name].checker(REGISTRY[name].reference)
    assert report.passed and report.lines, report


@pytest.mark.parametrize("name,mistake", MISTAKES)
def test_checker_rejects_the_mistake(name, mistake):
    with pytest.raises(ExerciseFailed) as failed:
        REGISTRY[name].checker(mistake.solution)
    assert mistake.expect in str(failed.value), str(failed.value)


def test_calling_the_librarys_merge_is_refused():
    def borrowed(out_a, lse_a, out_b, lse_b):
        return merge_attention_blocks(out_a, lse_a, out_b, lse_b)

    with pytest.raises(ExerciseFailed, match="merge_attention_blocks"):
        exercises.check_merge_attention(borrowed)


def test_the_references_are_the_librarys_mechanisms():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen) for _ in range(3))
    a = block_attention(q, k[..., :2, :], v[..., :2, :])
    b = block_attention(q, k[..., 2:, :], v[..., 2:, :])
    mine = REGISTRY["merge_attention"].reference(*a, *b)
    for got, want in zip(mine, merge_attention_blocks(*a, *b)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    logits = torch.randn(24, 4, generator=gen)
    capacity = expert_capacity(24, 4, 2, 1.0)
    routing = top_k_routing(logits, 2, capacity)
    token, _, counts = dispatch_order(routing)
    got_token, got_counts = REGISTRY["moe_dispatch"].reference(
        routing.expert, 4, capacity
    )
    assert got_token.tolist() == token.tolist()
    assert got_counts.tolist() == counts.tolist()

    # ExpertParallelDispatch's split rule: rows to each rank's block of experts,
    # rows from each rank for mine; here for rank 1 of ep = 2 with 4 experts
    matrix = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    send = matrix[1].view(2, 2).sum(1).tolist()
    recv = matrix[:, 2:4].sum(1).tolist()
    assert REGISTRY["all_to_all_splits"].reference(matrix.tolist(), 1) == (send, recv)


def stub_merge(out_a, lse_a, out_b, lse_b):
    """Your merge."""
    raise NotImplementedError


def test_a_stub_is_not_attempted_and_substituted_under_the_switch(monkeypatch):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    assert exercises.check_merge_attention(stub_merge).status == "not attempted yet"
    monkeypatch.setenv(exercises.SUBSTITUTE_ENV, "1")
    report = exercises.check_merge_attention(stub_merge)
    assert report.status == "reference substituted" and report.lines

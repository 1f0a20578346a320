"""Chapter 13's exercises beyond the catalogue (tests/test_exercises.py proves, on
the shared cluster of 4, that each checker accepts its reference and rejects every
wrong solution of its catalogue with the message it names; the load plan's
catalogue is proven here too, in this process).

Here: the references are the library's mechanisms, so a checker that trusts them
trusts the library. The DiLoCo meeting against :class:`dtlab.ft.DiLoCo` on the
course's GPT trained by AdamW replicas, bit for bit over three meetings (the same
fp32 operations in the same order: equal, not close); the load plan against
:func:`dtlab.reshard.overlaps` on random cuts. The DiLoCo checker runs without a
cluster both ways it can: on fresh ranks it spawns itself, and on every rank of a
world already up (a script under torchrun). The load plan's checker judges by
running the plan, so a right plan written differently passes and every one-field
slip of a right plan fails. A stub is "not attempted yet", even one whose source
cannot be read, and the test command's switch runs the reference in its place.
About 10 s on two cores (two worlds of 3 ranks).
"""

import os
import random
import re

import pytest
import torch

from dtlab import exercises
from dtlab.exercises import REGISTRY, ExerciseFailed
from dtlab.exercises.ch13_saved_pieces import PLAN_CASES
from dtlab.ft import DiLoCo
from dtlab.launch import spawn
from dtlab.model import GPT, GPTConfig, SyntheticTokens, shard_batch
from dtlab.reference import make_optimizer
from dtlab.reshard import Piece, overlaps

CHAPTER_13 = ["diloco_sync", "load_plan"]
WORLD = 3
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=1, n_heads=2, d_model=32)
H, MEETINGS, BATCH = 2, 3, 6


def test_chapter_13_declares_a_live_and_a_local_exercise():
    assert [n for n, ex in REGISTRY.items() if ex.chapter == 13] == CHAPTER_13
    assert not REGISTRY["diloco_sync"].local and REGISTRY["load_plan"].local
    for name in CHAPTER_13:
        ex = REGISTRY[name]
        assert ex.checker is getattr(exercises, f"check_{name}")
        assert len(ex.mistakes) >= 4 and all(m.why for m in ex.mistakes)


def test_solution_shows_the_references(capsys):
    assert "comm.all_reduce" in exercises.solution("diloco_sync", show=False)
    assert "raise ValueError" in exercises.solution("load_plan")
    assert "def load_plan" in capsys.readouterr().out


# ---- diloco_sync: on the ranks -----------------------------------------------------
def stub_sync(params, global_params, outer, group=None):
    """Your DiLoCo meeting."""
    raise NotImplementedError


def borrowed_sync(params, global_params, outer, group=None):
    """dtlab's own meeting, on the learner's tensors."""
    lib = DiLoCo.__new__(DiLoCo)
    lib.params, lib.global_params, lib.outer = params, global_params, outer
    lib.group, lib.n, lib.syncs = group, torch.distributed.get_world_size(), 0
    lib.sync()


def _twins_meet(rank: int) -> list[bool]:
    """The course's GPT on this rank twice, AdamW inner steps on this rank's shard:
    one twin meets through dtlab.ft.DiLoCo, the other through the reference; after
    each meeting, whether weights, globals and outer momentum are equal bit for
    bit."""
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    lib_model, ref_model = GPT(CFG), GPT(CFG)
    lib = DiLoCo(lib_model, make_optimizer(lib_model.parameters()), H)
    ref_inner = make_optimizer(ref_model.parameters())
    params = list(ref_model.parameters())
    global_params = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
    reference = REGISTRY["diloco_sync"].reference
    equal = []
    for m in range(MEETINGS):
        for step in range(H):
            x, y = shard_batch(*data.batch(m * H + step, BATCH), rank, WORLD)
            for model, inner in ((lib_model, lib.inner), (ref_model, ref_inner)):
                inner.zero_grad()
                model(x, y)[1].backward()
                inner.step()
        lib.sync()
        reference(params, global_params, outer)
        buffers = [outer.state[g]["momentum_buffer"] for g in global_params]
        lib_buffers = [lib.outer.state[g]["momentum_buffer"] for g in lib.global_params]
        pairs = [
            *zip(params, lib.params),
            *zip(global_params, lib.global_params),
            *zip(buffers, lib_buffers),
        ]
        equal.append(all(torch.equal(a, b) for a, b in pairs))
    return equal


def _on_the_ranks():
    """Everything the DiLoCo exercise needs from a world that is already up."""
    rank = torch.distributed.get_rank()
    out = {"twins": _twins_meet(rank)}
    reference = REGISTRY["diloco_sync"].reference
    os.environ.pop(exercises.SUBSTITUTE_ENV, None)
    report = exercises.check_diloco_sync(reference)  # the torchrun path
    out["reference"] = (report.status, report.lines)
    hidden = eval("lambda *args: (_ for _ in ()).throw(NotImplementedError())")
    out["hidden stub"] = exercises.check_diloco_sync(hidden).status
    try:
        exercises.check_diloco_sync(borrowed_sync)
    except ExerciseFailed as exc:
        out["borrowed"] = str(exc)
    os.environ[exercises.SUBSTITUTE_ENV] = "1"
    out["substituted"] = exercises.check_diloco_sync(stub_sync).status
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_on_the_ranks, WORLD, timeout=60)


def test_the_diloco_reference_is_the_librarys_meeting_bit_for_bit(ranks):
    # same inputs, the same fp32 operations in the same order, one all-reduce of
    # the same buffer: nothing may differ, on any rank, after any meeting
    assert all(out["twins"] == [True] * MEETINGS for out in ranks)


def test_the_diloco_checker_passes_the_reference_in_a_world_already_up(ranks):
    for out in ranks:
        status, lines = out["reference"]
        assert status == "passed" and "bit for bit" in lines[0], lines
        assert f"on all {WORLD} ranks" in lines[0] and "Ψ = 75" in lines[1]


def test_the_diloco_checker_passes_the_reference_on_fresh_ranks(monkeypatch):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    report = exercises.check_diloco_sync(REGISTRY["diloco_sync"].reference)
    assert report.passed and f"on all {WORLD} ranks" in report.lines[0], report


def test_calling_dilocos_own_sync_is_refused(ranks):
    assert all("dtlab.ft.DiLoCo.sync" in out["borrowed"] for out in ranks)


def test_a_diloco_stub_is_not_attempted_and_substituted_under_the_switch(
    ranks, monkeypatch, capsys
):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    report = exercises.check_diloco_sync(stub_sync)  # seen from its source: no ranks
    assert report.status == "not attempted yet" and not report.attempted
    assert "not attempted yet" in capsys.readouterr().out
    for out in ranks:  # a stub only the ranks find, and the switch, on the ranks
        assert out["hidden stub"] == "not attempted yet"
        assert out["substituted"] == "reference substituted"


# ---- load_plan: in this process ----------------------------------------------------
LOAD_PLAN_MISTAKES = [
    pytest.param(m, id=m.name) for m in REGISTRY["load_plan"].mistakes
]


def _library_plan(want, saved):
    """dtlab.reshard's overlaps of a flat range with each saved one (pieces of a
    1-D tensor), as reads."""
    total = max([want[1], *(hi for _, hi in saved)])
    piece = lambda lo, hi: Piece((total,), 0, 0, total, lo, hi)  # noqa: E731
    reads = [
        (i, in_have, in_want, n)
        for i, (lo, hi) in enumerate(saved)
        for in_want, in_have, n in overlaps(piece(*want), piece(lo, hi))
    ]
    return sorted(reads, key=lambda read: read[2])


def _random_cut(rng, total):
    cuts = sorted(rng.sample(range(1, total), rng.randint(0, min(5, total - 1))))
    edges = [0, *cuts, total]
    return list(zip(edges, edges[1:]))


def test_the_load_plan_reference_is_dtlab_reshards_overlaps():
    rng = random.Random(0)
    reference = REGISTRY["load_plan"].reference
    for _ in range(300):
        total = rng.randint(1, 40)
        saved = _random_cut(rng, total)
        rng.shuffle(saved)  # file order is any order
        lo = rng.randint(0, total)
        want = (lo, rng.randint(lo, total))
        assert reference(want, saved) == _library_plan(want, saved), (want, saved)
        needed = _library_plan(want, saved)
        if needed:  # drop a piece want needs: a hole, whichever it was
            dropped = rng.choice(needed)[0]
            with pytest.raises(ValueError, match="do not cover"):
                reference(want, [s for i, s in enumerate(saved) if i != dropped])


def one_read_per_element(want, saved):
    """A right plan, never merged: a read of length 1 per element."""
    reads = REGISTRY["load_plan"].reference(want, saved)
    return [(i, s + k, w + k, 1) for i, s, w, n in reads for k in range(n)]


def with_empty_reads(want, saved):
    """A right plan with a read of length 0 for every piece that only touches want
    (they read nothing)."""
    lo, hi = want
    reads = []
    for i, (s_lo, s_hi) in enumerate(saved):
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a <= b:
            reads.append((i, a - s_lo, a - lo, b - a))
    if sum(n for *_, n in reads) != hi - lo:
        raise ValueError("hole")
    return sorted(reads, key=lambda read: (read[2], read[3]))


@pytest.mark.parametrize("answer", [one_read_per_element, with_empty_reads])
def test_the_load_plan_checker_accepts_a_right_plan_written_differently(answer):
    assert exercises.check_load_plan(answer).passed


@pytest.mark.parametrize("field", range(4))
@pytest.mark.parametrize("by", [-1, 1])
def test_every_one_field_slip_of_a_right_plan_is_caught(field, by):
    # a plan that is right but for one field of one read, in every case: it reads
    # an element twice, misses one, reads outside want or a piece, or places an
    # element where another belongs; the run of the plan sees each
    reference = REGISTRY["load_plan"].reference
    for what, want, saved in PLAN_CASES:
        right = reference(want, list(saved))
        for k in range(len(right)):

            def slipped(w, s, k=k, right=right, case=(want, saved)):
                if (tuple(w), tuple(s)) != case:
                    return reference(w, s)
                read = list(right[k])
                read[field] += by
                return [*right[:k], tuple(read), *right[k + 1 :]]

            with pytest.raises(ExerciseFailed, match=re.escape(what)):
                exercises.check_load_plan(slipped)


@pytest.mark.parametrize("mistake", LOAD_PLAN_MISTAKES)
def test_the_load_plan_checker_rejects_the_mistake(mistake):
    with pytest.raises(ExerciseFailed) as failed:
        exercises.check_load_plan(mistake.solution)
    assert mistake.expect in str(failed.value), str(failed.value)


def stub_plan(want, saved):
    """Your plan."""
    raise NotImplementedError


def test_a_load_plan_stub_is_not_attempted_and_substituted_under_the_switch(
    monkeypatch,
):
    monkeypatch.delenv(exercises.SUBSTITUTE_ENV, raising=False)
    assert exercises.check_load_plan(stub_plan).status == "not attempted yet"
    monkeypatch.setenv(exercises.SUBSTITUTE_ENV, "1")
    report = exercises.check_load_plan(stub_plan)
    assert report.status == "reference substituted" and report.lines

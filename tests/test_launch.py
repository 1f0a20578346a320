"""dtlab.launch.spawn: results in rank order, the failing rank named, bounded."""

import time

import pytest

from dtlab.launch import RankError, rank_error, spawn


def _boom_on_one():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("missing on rank one")
    dist.all_reduce(torch.ones(2))
    return dist.get_rank()


def test_spawn_names_the_failing_rank_and_does_not_wait_out_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        spawn(_boom_on_one, 2, timeout=300)
    assert info.value.rank == 1
    assert "missing on rank one" in str(info.value)
    assert "_boom_on_one" in info.value.remote_traceback
    # start-up plus fail-fast, far below the 300 s timeout even on a loaded machine
    assert time.monotonic() - t0 < 120


def test_rank_error_prefers_the_cause_over_its_consequences():
    failures = [
        (0, "RuntimeError: Connection closed by peer", "tb0", 10.0),
        (3, "ValueError: bad shape", "tb3", 10.5),
        (2, "DistBackendError: gloo timeout", "tb2", 9.0),
    ]
    err = rank_error(failures, "step")
    assert err.rank == 3 and "bad shape" in str(err)
    assert "[ranks [0, 2] failed after it]" in str(
        err
    ) and "(while running step)" in str(err)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        spawn(_boom_on_one, 0)


def test_rank_error_says_what_each_rank_was_doing():
    failures = [
        (0, "RuntimeError: Connection closed by peer", "tb0", 10.2,
         "in all_reduce(numel=8, float32, group dp, tag 'ddp') for 3.0s"),
        (1, "KeyError: 'x'", "tb1", 10.1, "not in a collective (none yet)"),
    ]  # fmt: skip
    err = rank_error(failures, "step")
    assert err.rank == 1
    assert err.doing == {0: failures[0][4], 1: failures[1][4]}
    text = str(err)
    assert "rank 0 was in all_reduce(numel=8, float32, group dp, tag 'ddp')" in text
    assert "rank 1 was not in a collective" in text
    # the old four-item form still works, and says nothing it does not know
    assert rank_error([f[:4] for f in failures]).doing == {}

"""A training run that survives a lost replica (issue 19; torchft's idea): an engine
is SIGKILLed mid-run, ``train(..., survive=True)`` replaces it, restores its state
from a replica, and the run ends with the loss curve of a run that never broke.

Tolerance: none. The newcomer receives a replica's state bit for bit (DDP keeps
the replicas identical: the same averaged gradients, the same AdamW step), the data
is a pure function of the step, and the new world reduces in the same ring order
as the old one (same ranks, same sizes), so every loss equals the uninterrupted
run's exactly (measured: equal to the last bit, on pure DP, dp2·tp2 and dp2·pp2).
"""

import os
import signal
import threading
import time

import psutil
import pytest

from dtlab.lab import LabCluster
from dtlab.lab.replicas import time_lost
from dtlab.model import GPTConfig
from dtlab.topology import Layout
from dtlab.train import TrainConfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, n_heads=4, d_model=32)
STEPS = 12


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ipyparallel")
    c = LabCluster(4, backend="gloo", timeout=10).start()
    yield c
    c.stop()


def _kill_at(cluster, rank: int, step: int, seen: list):
    """A ``on_records`` callback that SIGKILLs ``rank``'s engine once step
    ``step`` was reported (like the OOM killer would, mid-run)."""
    killed = []

    def on_records(batch):
        seen.extend(batch)
        if not killed and any(r["step"] >= step for r in batch):
            killed.append((cluster.pids[rank], time.monotonic()))
            threading.Timer(0.05, os.kill, (killed[0][0], signal.SIGKILL)).start()

    return on_records, killed


@pytest.mark.parametrize(
    "layout, victim",
    [(Layout(dp=4), 2), (Layout(dp=2, tp=2), 1), (Layout(dp=2, pp=2), 3)],
    ids=["dp4", "dp2-tp2", "dp2-pp2"],
)
def test_a_killed_engine_is_replaced_and_the_loss_curve_goes_on(
    cluster, layout, victim
):
    config = TrainConfig(model=MODEL, layout=layout, steps=STEPS, global_batch_size=8)
    cluster.train(config.replace(steps=2), live=False)  # warm: imports, first builds
    whole = cluster.train(config, live=False)  # the run that never broke
    seen: list = []
    on_records, killed = _kill_at(cluster, victim, 4, seen)
    old_pids = dict(cluster.pids)
    run = cluster.train(config, live=False, survive=True, on_records=on_records)
    assert killed, "the run ended before the kill"
    (loss,) = run.lost
    lost_s = time_lost(run.records[0], run.seconds, STEPS) - time_lost(
        whole.records[0], whole.seconds, STEPS
    )
    print(
        f"\n{layout}: rank {victim} killed after step {loss['newest_step']}, "
        f"resumed after step {loss['resumed_after']}; detected "
        f"{loss['detect_s']:.2f}s after its last heartbeat, new engine "
        f"{loss['replace_s']:.2f}s, new world {loss['reset_s']:.2f}s, state "
        f"{loss['restore_s']:.3f}s ({loss['restored_bytes']} bytes); run "
        f"{run.seconds:.1f}s vs {whole.seconds:.1f}s uninterrupted: "
        f"{lost_s:.1f}s lost"
    )
    assert loss["ranks"] == [victim]
    assert cluster.pids[victim] != old_pids[victim]  # a new engine ...
    assert not psutil.pid_exists(old_pids[victim]) or _zombie(old_pids[victim])
    others = [r for r in old_pids if r != victim]
    assert all(cluster.pids[r] == old_pids[r] for r in others)  # ... the rest kept
    # the curve of the run that never broke, step by step, exactly
    assert [r["step"] for r in run.records[victim]] == list(range(STEPS))
    for rank in range(4):
        assert run.by_rank("loss")[rank] == whole.by_rank("loss")[rank], rank
    # the newcomer's steps before the loss came from its replica
    restored = [r for r in run.records[victim] if "restored_from" in r]
    replicas = layout.group_of("dp", victim)
    assert restored and all(r["restored_from"] in replicas for r in restored)
    # each step was handed on once, the steps done again were not sent twice
    steps_seen = [(r["rank"], r["step"]) for r in seen]
    assert len(steps_seen) == len(set(steps_seen))
    assert cluster.run(_world_size) == [4] * 4  # the cluster works on


def _world_size():
    import torch.distributed as dist

    return dist.get_world_size()


def _zombie(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_runs_without_replicas_are_refused_before_they_start(cluster):
    zero = TrainConfig(model=MODEL, strategy="zero3", steps=2)
    with pytest.raises(ValueError, match="shards it"):
        cluster.train(zero, live=False, survive=True)
    alone = TrainConfig(model=MODEL, layout=Layout(dp=1, tp=4), steps=2)
    with pytest.raises(ValueError, match="needs dp >= 2"):
        cluster.train(alone, live=False, survive=True)

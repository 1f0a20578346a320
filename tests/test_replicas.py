"""A training run that survives a lost replica (issues 19 and 29; torchft's idea):
an engine is SIGKILLed mid-run, ``train(..., survive=True)`` replaces it, restores
its state from a rank that holds the same shards, and the run ends with the records
of a run that never broke, dropout on.

Tolerance: none. The newcomer receives its holder's weights and optimizer state bit
for bit (DDP keeps the replicas identical: the same averaged gradients, the same
AdamW step; the experts' replicas and HSDP's replicate group likewise) and its own
random state, which its peers kept; the data is a pure function of the step, and
the new world reduces in the same ring order as the old one (same ranks, same
sizes), so every rank's loss, local loss and gradient norm equal the uninterrupted
run's exactly (measured: equal to the last bit at dp4, dp2·tp2, dp2·pp2, dp2·cp2,
dp4·ep2 and HSDP, with dropout 0.1). The layouts refused are in
tests/test_survive_layouts.py.
"""

import os
import signal
import threading
import time

import psutil
import pytest

from dtlab.events import Kind
from dtlab.lab import LabCluster
from dtlab.lab.engine.replica import holders, unsent
from dtlab.lab.kernel import replicas
from dtlab.lab.kernel.failures import EngineDied
from dtlab.lab.kernel.replicas import time_lost
from dtlab.model import GPTConfig
from dtlab.topology import Layout
from dtlab.train import TrainConfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MODEL = GPTConfig(
    vocab_size=64, seq_len=16, n_layers=2, n_heads=4, d_model=32, dropout=0.1
)
STEPS = 12
MOE = GPTConfig(**{**MODEL.__dict__, "n_experts": 4})
# name -> (layout, the rank killed, other config fields)
LAYOUTS = {
    "dp4": (Layout(dp=4), 2, {}),
    "dp2-tp2": (Layout(dp=2, tp=2), 1, {}),
    "dp2-pp2": (Layout(dp=2, pp=2), 3, {}),
    "dp2-cp2": (Layout(dp=2, cp=2), 1, dict(cp_variant="ulysses")),
    "tp2-cp2": (Layout(tp=2, cp=2), 2, dict(cp_variant="ulysses")),  # cp pairs
    "dp4-ep2": (Layout(dp=4, ep=2), 3, dict(model=MOE)),  # rank 1 holds its experts
    "hsdp": (Layout(dp=4), 2, dict(strategy="zero3", zero_shard_size=2)),
}


def _config(name, **changes):
    layout, _, more = LAYOUTS[name]
    more = {"model": MODEL, **more, **changes}
    return TrainConfig(layout=layout, steps=STEPS, global_batch_size=8, **more)


def _numbers(run):
    """What must not change: every rank's loss, local loss and gradient norm."""
    return [
        [(r["step"], r["loss"], r["local_loss"], r["grad_norm"]) for r in recs]
        for recs in run.records
    ]


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ipyparallel")
    c = LabCluster(4, backend="gloo", timeout=20).start()
    yield c
    c.stop()


def _kill_at(cluster, rank: int, step: int, seen: list, then=None):
    """A ``on_records`` callback that SIGKILLs ``rank``'s engine once step
    ``step`` was reported (like the OOM killer would, mid-run); ``then``: another
    ``(rank, step)`` to kill once that step was reported after the first lost
    engine was replaced."""
    plan = [(rank, step)] + ([then] if then else [])
    killed = []

    def on_records(batch):
        seen.extend(batch)
        if len(killed) < len(plan):
            victim, at = plan[len(killed)]
            replaced = not killed or cluster.pids[plan[0][0]] != killed[0][0]
            if replaced and any(r["step"] >= at for r in batch):
                killed.append((cluster.pids[victim], time.monotonic()))
                threading.Timer(0.05, os.kill, (killed[-1][0], signal.SIGKILL)).start()

    return on_records, killed


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_killed_engine_is_replaced_and_the_run_goes_on_unchanged(cluster, name):
    config = _config(name)
    layout, victim, _ = LAYOUTS[name]
    cluster.train(config.replace(steps=1), live=False)  # warm: imports, first builds
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
        f"\n{name}: rank {victim} killed after step {loss['newest_step']}, "
        f"resumed after step {loss['resumed_after']}; detected "
        f"{loss['detect_s']:.2f}s after its last heartbeat, new engine "
        f"{loss['replace_s']:.2f}s, new world {loss['reset_s']:.2f}s, imports "
        f"{loss['warm_s']:.2f}s, trainers {loss['build_s']:.2f}s, state "
        f"{loss['restore_s']:.3f}s ({loss['restored_bytes']} bytes); run "
        f"{run.seconds:.1f}s vs {whole.seconds:.1f}s uninterrupted: "
        f"{lost_s:.1f}s lost; records sent again (rank: steps) "
        f"{_sent_again(seen)}"
    )
    assert loss["ranks"] == [victim]
    assert cluster.pids[victim] != old_pids[victim]  # a new engine ...
    assert not psutil.pid_exists(old_pids[victim]) or _zombie(old_pids[victim])
    others = [r for r in old_pids if r != victim]
    assert all(cluster.pids[r] == old_pids[r] for r in others)  # ... the rest kept
    # the records of the run that never broke, rank by rank, step by step, exactly
    assert _numbers(run) == _numbers(whole)
    # the newcomer's steps before the loss came from a rank holding its shards
    restored = [r for r in run.records[victim] if "restored_from" in r]
    group = holders(config, layout, victim)
    assert restored and all(r["restored_from"] in group for r in restored)
    assert all(r["coords"] == layout.coords(victim) for r in run.records[victim])
    _each_step_once(seen)
    assert cluster.run(_world_size) == [4] * 4  # the cluster works on


def test_two_kills_are_recorded_each_with_its_own_step(cluster):
    """Two engines lost one after the other (rank 1, then rank 2 once the run
    went on past step 8): two entries in ``run.lost``, each with the step it
    resumed after and what its own recovery cost, and the records unchanged."""
    config = _config("dp4")
    whole = cluster.train(config, live=False)
    seen: list = []
    on_records, killed = _kill_at(cluster, 1, 3, seen, then=(2, 8))
    run = cluster.train(config, live=False, survive=True, on_records=on_records)
    assert len(killed) == 2, "the run ended before the second kill"
    first, second = run.lost
    print(f"\nfirst loss {first}\nsecond loss {second}")
    assert (first["ranks"], second["ranks"]) == ([1], [2])
    assert first["resumed_after"] < second["resumed_after"]
    assert first["newest_step"] < second["newest_step"]
    assert first["at_s"] < second["at_s"]
    for loss in (first, second):
        assert loss["restored_bytes"] > 0 and loss["restore_s"] > 0
    # the newest step before each kill is at most one past the step resumed after
    for loss in (first, second):
        assert loss["resumed_after"] <= loss["newest_step"] + 1
    assert _numbers(run) == _numbers(whole)
    _each_step_once(seen)


def _each_step_once(seen):
    """Every step of every rank reached the notebook, none twice: the records a
    kill left in flight (the lost rank's, and the survivors' last ones, which the
    notebook stops listening for when it sees the engine gone) were sent again
    once the run resumed, marked ``recovered``, by the newcomer for a lost rank."""
    steps_seen = [(r["rank"], r["step"]) for r in seen]
    assert len(steps_seen) == len(set(steps_seen)), "a step handed on twice"
    missing = {(r, s) for r in range(4) for s in range(STEPS)} - set(steps_seen)
    assert not missing, f"steps never handed on: {sorted(missing)}"


def test_records_a_kill_left_in_flight_are_sent_again_once(monkeypatch):
    """No engines, every step of the protocol forced: rank 1 dies after step 4;
    its steps 3 and 4 and the survivors' (0, 4) and (3, 4) were still in flight
    (the notebook stops listening to the failed call at once). On resuming after
    step 4 each rank sends what the notebook says it lacks (:func:`unsent`), the
    ranks redo steps 5-11, and the notebook hands on each step once."""
    in_flight = {(1, 3), (1, 4), (0, 4), (3, 4)}
    handed_on, calls = [], []

    def step(rank, s, **more):
        return {"kind": Kind.STEP, "rank": rank, "step": s, **more}

    class Engines:  # the cluster, its engines following replica.train_resuming
        world_size = 4

        def run(self, fn, config, newcomers, pace, handed, *, on_events, **_):
            calls.append((list(newcomers), handed))
            if len(calls) == 1:
                on_events(
                    [
                        step(r, s)
                        for s in range(5)
                        for r in range(4)
                        if (r, s) not in in_flight
                    ]
                )
                raise EngineDied("engine of rank 1 is gone")
            for r in range(4):  # resumed after step 4: records of steps 0-4
                on_events(unsent([step(r, s) for s in range(5)], handed.get(r, ())))
            for s in range(3, STEPS):  # the steps done again, and the rest
                on_events([step(r, s) for r in range(4)])
            restored = {"seconds": 0.1, "bytes": 1, "build_s": 0.1}
            return [{"records": [], "resumed_after": 4, "restored": restored}] * 4

    def replace(cluster, error, newest_step):
        return {"ranks": [1], "newest_step": newest_step}

    monkeypatch.setattr(replicas, "_replace", replace)
    replicas.train_surviving(Engines(), _config("dp4"), on_events=handed_on.extend)
    # the notebook told the ranks which steps it had of each
    assert calls[1][0] == [1]
    assert {r: set(s) for r, s in calls[1][1].items()} == {
        r: {s for s in range(5) if (r, s) not in in_flight} for r in range(4)
    }
    _each_step_once(handed_on)
    again = {(e["rank"], e["step"]) for e in handed_on if e.get("recovered")}
    assert again == in_flight


def _sent_again(seen) -> dict:
    """``{rank: [steps]}`` of the records sent again after a loss."""
    again: dict = {}
    for r in seen:
        if r.get("recovered"):
            again.setdefault(r["rank"], []).append(r["step"])
    return again


def _world_size():
    import torch.distributed as dist

    return dist.get_world_size()


def _zombie(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True

"""The live cluster: start, run, errors on one rank, a rank that never arrives, a
killed engine, reset/restart/stop, and nothing left listening beyond loopback."""

import os
import signal
import time

import psutil
import pytest
import torch

from dtlab import telemetry
from dtlab.lab import EngineDied, LabCluster, RankError, start
from dtlab.lab.engine.publish import PublishSink

pytestmark = pytest.mark.cluster


def _rank_and_sum():
    import torch.distributed as dist

    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return dist.get_rank(), dist.get_world_size(), x.item()


def _fail_on(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on {bad_rank}")
    x = torch.ones(8)
    dist.all_reduce(x)  # the others block here until the failing rank's group dies
    dist.all_reduce(x)
    return x.sum().item()


def test_run_returns_results_in_rank_order(lab_cluster):
    cluster = lab_cluster(4)
    assert cluster.run(_rank_and_sum) == [(r, 4, 6.0) for r in range(4)]
    # %%px cells see rank, world_size and topo on every engine
    for rank, eid in cluster.rank_to_engine.items():
        ns = cluster.client[eid].pull(["rank", "world_size"], block=True)
        assert ns == [rank, 4]
        cluster.client[eid].execute("_topo_rank = topo.rank", block=True)
        assert cluster.client[eid].pull("_topo_rank", block=True) == rank


def _import_dynamo():
    # what the first torch optimizer does; afterwards torch keeps a reference that
    # holds a destroyed group's sockets open (so the engine severs them itself)
    import torch._dynamo  # noqa: F401

    return True


def test_error_on_one_rank_is_reported_fast_with_its_rank(lab_cluster):
    cluster = lab_cluster(4)  # its collective timeout is 20 s
    assert cluster.run(_import_dynamo) == [True] * 4
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(_fail_on, 2)
    elapsed = time.monotonic() - t0
    assert info.value.rank == 2
    assert "deliberate failure on 2" in str(info.value)
    assert "_fail_on" in info.value.remote_traceback  # the rank's own traceback
    assert "[ranks [0, 1, 3] failed after it]" in str(info.value)
    # fail-fast, not the 20 s group timeout (the margin allows a loaded machine)
    assert elapsed < 12, f"peers waited {elapsed:.1f}s instead of failing fast"
    # the next run resets the process group by itself ...
    assert cluster.run(_rank_and_sum)[0] == (0, 4, 6.0)
    # ... and an explicit reset gives a working group too
    with pytest.raises(RankError):
        cluster.run(_fail_on, 0)
    cluster.reset()
    assert [h["initialized"] for h in cluster.health()] == [True] * 4
    assert cluster.run(_rank_and_sum)[3] == (3, 4, 6.0)


def test_a_failed_px_cell_does_not_break_the_next_run(lab_cluster):
    cluster = lab_cluster(4)
    eid = cluster.rank_to_engine[1]
    # what a %%px cell that raises does: IPython's post_run_cell hook on the engine
    # tears the group down so peers blocked in a collective fail fast
    with pytest.raises(Exception, match="ZeroDivisionError"):
        cluster.client[eid].execute("1 / 0", silent=False, block=True)  # as %%px
    assert cluster.health()[1]["initialized"] is False
    assert cluster.run(_rank_and_sum)[1] == (1, 4, 6.0)


def test_live_telemetry_reaches_the_notebook(lab_cluster):
    from dtlab import comm

    def traffic(n):
        for _ in range(n):
            comm.all_reduce(torch.ones(256), tag="t")
            time.sleep(0.05)
        return True

    batches = []
    cluster = lab_cluster(4)
    assert cluster.run(traffic, 10, on_events=batches.append, publish_interval=0.02)
    live = [e for b in batches for e in b]
    assert live, "no telemetry arrived while the call ran"
    assert {e["rank"] for e in cluster.last_events} == {0, 1, 2, 3}
    ops = [e for e in cluster.last_events if e["kind"] == "comm" and e["tag"] == "t"]
    assert len(ops) == 40 and all(e["wire_bytes"] == 2 * 3 / 4 * 1024 for e in ops)
    # without recording, nothing is collected
    cluster.run(traffic, 1)
    assert len([e for e in cluster.last_events if e.get("tag") == "t"]) == 40


def test_publish_sink_batches_under_fresh_keys():
    # ipyparallel's client keeps only the latest value per key: a batch that
    # reused a key would overwrite the one before it unread
    published = []
    sink = PublishSink(interval=3600, max_batch=3, publish=published.append)
    rec = telemetry.Recorder(0, [sink])
    for i in range(7):
        rec.emit("comm", i=i)
    rec.flush()
    keys = [k for batch in published for k in batch]
    assert keys == sorted(set(keys)), "every batch needs its own key"
    events = [e for batch in published for v in batch.values() for e in v]
    assert [e["i"] for e in events] == list(range(7))  # nothing lost, in order
    assert [len(v) for b in published for v in b.values()] == [3, 3, 1]


def test_publish_sink_sends_a_lone_event_without_waiting_for_the_next():
    # a rank that emits one event and then computes for seconds: the sink's own
    # thread sends it once it is ``interval`` old, not at the rank's next event
    published = []
    sink = PublishSink(interval=0.05, publish=published.append)
    rec = telemetry.Recorder(0, [sink])
    rec.emit("comm", i=0)  # fresh sink: not yet ``interval`` since the last send
    deadline = time.monotonic() + 30  # generous: a loaded machine
    while not published and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e["i"] for b in published for v in b.values() for e in v] == [0]
    rec.close()  # ends the thread; nothing left to send
    assert len(published) == 1


def _skip_collective_on(missing):
    import torch.distributed as dist

    if dist.get_rank() != missing:
        dist.all_reduce(torch.ones(2))
    return dist.get_rank()


def _children():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_small_cluster_faults_and_teardown():
    before = _children()
    # through the repository's "local" profile, the one cluster/README.md describes
    profile = os.path.join(os.path.dirname(__file__), "..", "cluster", "local")
    cluster = LabCluster(2, backend="gloo", timeout=3, profile_dir=profile)
    with cluster:
        assert cluster.start_seconds is not None
        pids = set(cluster.pids.values())
        assert pids <= _children()

        # only loopback listens: controller, engines, the rendezvous
        for proc in psutil.Process().children(recursive=True):
            try:
                conns = proc.net_connections(kind="inet")
            except psutil.NoSuchProcess:  # a short helper that ended meanwhile
                continue
            for conn in conns:
                if conn.status == psutil.CONN_LISTEN:
                    assert conn.laddr.ip in ("127.0.0.1", "::1"), (proc, conn)

        # a rank that never arrives: the others fail after the group's timeout
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            cluster.run(_skip_collective_on, 1)
        assert info.value.rank == 0
        assert 2.5 < time.monotonic() - t0 < 3 + 10
        assert cluster.run(_rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]

        # a killed engine is reported as such, quickly, and restart() recovers
        def die():
            import torch.distributed as dist

            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1))

        t0 = time.monotonic()
        with pytest.raises((EngineDied, RankError)) as info:
            cluster.run(die)
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDied, match="rank.? 1"):
            cluster.reset()
        cluster.restart()
        assert cluster.run(_rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]
        pids = set(cluster.pids.values())
    assert not cluster.running
    # no grace period: stop() returns once every process it owns has exited
    assert not (pids & _children()), "engines outlived stop()"
    assert _children() <= before | set(), "processes left behind"


def test_start_reuses_or_replaces_without_orphans():
    a = start(world_size=2, timeout=5)
    try:
        b = start(world_size=2, timeout=5)  # re-running the cell: same cluster
        assert b is a and a.running
        old_pids = set(a.pids.values())
        c = start(world_size=3, timeout=5)  # a different size: the old one stops
        assert not a.running and c.running
        time.sleep(0.5)
        assert not (old_pids & _children())
        assert [r for r, _, _ in c.run(_rank_and_sum)] == [0, 1, 2]
    finally:
        from dtlab.lab import stop_all

        stop_all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), "positive integer"),
        (dict(world_size=10_000), "more than this machine can run"),
        (dict(world_size=2, backend="mpi"), "backend must be"),
    ],
)
def test_bad_requests_fail_before_anything_starts(kwargs, match):
    before = _children()
    with pytest.raises(ValueError, match=match):
        LabCluster(**kwargs)
    assert _children() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="needs GPUs"):
        LabCluster(2, backend="nccl")

"""Engines on several machines: placement, rendezvous, liveness and signals.

No second machine is reachable from CI, so two things are tested here instead:

- the placement rules, on what engines report (:mod:`dtlab.lab.kernel.placement`):
  each rank's GPU is its position among its own host's engines; a host cannot run more
  nccl
  engines than it has GPUs; a world that spans hosts needs a shared ``store_dir``
  for its rendezvous; ``backend="auto"`` follows the engines' GPUs, not the
  notebook machine's;
- a live cluster whose rank 1 *says* it runs on another host. It really runs here,
  so everything a remote engine needs is exercised for real: the rendezvous file in
  the shared folder, gloo without the loopback pin, an interrupt through
  ipyparallel's control channel instead of a pid, and a death noticed by
  ipyparallel's heartbeat instead of a local process check.
"""

import os
import signal
import threading
import time

import psutil
import pytest

from dtlab.lab import EngineDied, LabCluster
from dtlab.lab.kernel import placement

HERE = os.uname().nodename


def _where(hosts, gpus=0, cpus=2):
    return [
        {"pid": 1000 + r, "host": h, "gpus": gpus, "cpus": cpus}
        for r, h in enumerate(hosts)
    ]


# ---- placement, from what the engines report ---------------------------------------
def test_each_rank_gets_a_gpu_of_its_own_host(tmp_path):
    c = LabCluster(4, profile_dir="cluster/ssh", store_dir=tmp_path)
    assert c.backend == "auto"  # the notebook's machine does not decide
    p = c.place(_where(["gpu1", "gpu1", "gpu2", "gpu2"], gpus=2))
    assert c.backend == p.backend == "nccl"
    assert p.devices == {0: 0, 1: 1, 2: 0, 3: 1}
    assert not p.single_host and p.local_pids() == {} and c.local_pids() == {}
    store = c.store_file()
    assert store.startswith(str(tmp_path)) and "dtlab-" in store


def test_engines_that_each_see_their_own_gpu_take_device_0():
    # Slurm's --gpus-per-task=1: every task sees one GPU, its own
    where = _where(["n1", "n1", "n2", "n2"], gpus=1)
    for r, w in enumerate(where):
        w["visible"] = str(r % 2)
    p = placement.place(where, "auto", store_dir="/shared")
    assert p.backend == "nccl" and p.devices == {0: 0, 1: 0, 2: 0, 3: 0}


def test_a_host_with_too_few_gpus_is_refused_by_name():
    with pytest.raises(ValueError, match="host gpu1 runs 3 engines .* share 2 GPUs"):
        placement.place(_where(["gpu1"] * 3, gpus=2), "nccl", store_dir="/shared")


def test_ranks_follow_hosts_this_machine_first():
    # ipyparallel numbers engines as they register, which mixes the hosts
    where = _where(["node-b", HERE, "node-b", "node-a", HERE])
    order = placement.host_order(where, ids=[0, 1, 2, 3, 4])
    assert [where[i]["host"] for i in order] == [
        HERE,
        HERE,
        "node-a",
        "node-b",
        "node-b",
    ]
    assert order == [1, 4, 3, 0, 2]  # by engine id within a host


def test_engines_without_gpus_run_gloo_and_need_a_shared_store(tmp_path):
    with pytest.raises(ValueError, match="store_dir=.*DTLAB_STORE_DIR"):
        placement.place(_where(["node-a", "node-b"]), "auto")
    p = placement.place(_where(["node-a", "node-b"]), "auto", store_dir=tmp_path)
    assert p.backend == "gloo"  # auto: the engines have no GPU
    folder = placement.rendezvous_folder(
        p, private_dir="/private", shared_dir=str(tmp_path), token="abc"
    )
    assert folder == str(tmp_path / "dtlab-abc")


def test_engines_of_this_machine_need_nothing_shared():
    p = placement.place(_where([HERE, HERE]), "gloo")
    assert p.single_host and p.devices == {0: None, 1: None}
    assert p.local_pids() == {0: 1000, 1: 1001}
    assert p.peers(0) == [1000, 1001]
    assert (
        placement.rendezvous_folder(
            p, private_dir="/private", shared_dir=None, token=""
        )
        == "/private"
    )


def test_a_machine_refuses_what_it_cannot_give():
    assert placement.check_request(None, "auto", gpus=0) == (4, "gloo")
    assert placement.check_request(None, "auto", gpus=2) == (2, "nccl")
    assert placement.check_request(3, "auto", gpus=None) == (3, "auto")  # a profile
    with pytest.raises(ValueError, match="needs one GPU per engine"):
        placement.check_request(3, "nccl", gpus=2)
    with pytest.raises(ValueError, match="needs GPUs"):
        placement.check_request(2, "nccl", gpus=0)
    with pytest.raises(ValueError, match="give world_size"):
        placement.check_request(None, "auto", gpus=None)


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="give world_size"):
        LabCluster(profile_dir="cluster/ssh")
    with pytest.raises(ValueError, match="is not a folder"):
        LabCluster(2, store_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="9 CPU engines on 1 cores"):
        placement.place(_where(["node-a"] * 9, cpus=1), "gloo", store_dir=tmp_path)


# ---- a live cluster whose rank 1 is "elsewhere" -----------------------------------
class _TwoHosts(LabCluster):
    """Rank 1's engine reports another host name: the cluster must treat it as a
    machine it cannot see into."""

    def place(self, where):
        where[1] = {**where[1], "host": "node-b"}
        return super().place(where)


def _sum_ranks():
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    return x.item(), os.environ.get("GLOO_SOCKET_IFNAME")


def _sleep_on(rank, seconds):
    import torch.distributed as dist

    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


@pytest.mark.cluster
@pytest.mark.slow  # starts its own 2 engines
def test_a_world_across_hosts_meets_in_the_shared_folder(tmp_path, monkeypatch):
    pytest.importorskip("ipyparallel")
    # the interface a profile would name (DTLAB_IFNAME); loopback on this machine
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    c = _TwoHosts(2, backend="gloo", timeout=10, store_dir=tmp_path)
    with pytest.raises(ValueError, match="store_dir"):
        _TwoHosts(2, backend="gloo", timeout=10).start()  # nothing shared: refused
    c.start()
    try:
        assert c.placement.hosts == {0: HERE, 1: "node-b"}
        assert not c.placement.single_host and list(c.local_pids()) == [0]
        # the rendezvous happened in the shared folder, under this cluster's name
        (folder,) = tmp_path.iterdir()
        assert folder.name.startswith("dtlab-")
        assert c.run(_sum_ranks) == [(3.0, "lo")] * 2
        # an interrupt reaches "node-b" through ipyparallel, not by pid
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="every rank is free again"):
            c.run(_sleep_on, 1, 60, timeout=2)
        assert time.monotonic() - t0 < 30
        assert c.run(_sum_ranks)[0][0] == 3.0  # reset by itself, works again
        # a death over there, mid-run, is noticed by ipyparallel's heartbeat
        killer = threading.Timer(1.0, os.kill, (c.pids[1], signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(EngineDied, match="node-b and stopped answering"):
            c.run(_sleep_on, 1, 30, timeout=60)
        assert time.monotonic() - t0 < 20  # not the 30 s sleep, not the timeout
    finally:
        pids = list(c.pids.values())
        c.stop()
    assert not list(tmp_path.iterdir())  # the rendezvous folder went with it
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p) and _not_zombie(p)]


def _not_zombie(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

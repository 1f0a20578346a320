"""A real second host: half the engines run in a Linux network namespace with an
interface, an address and a host name of their own (the ``cluster/netns``
profile, :mod:`dtlab.lab.kernel.netns`), joined to this one by a veth pair.

The world spans the two: the controller listens on the veth address only, the
rendezvous is a file in a shared folder, gloo's connections between the sides
cross the veth, an error or a Stop on the far side is reported with its rank, a
death there is seen through ipyparallel's heartbeat, ``stop()`` leaves nothing,
and the far engines, which cannot see the kernel, end themselves when the
controller stops beating. The test makes and removes the namespace itself, and is
skipped (saying why) where namespaces cannot be made: not root, no ``ip``, no
CAP_NET_ADMIN in a container.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time

import psutil
import pytest

from dtlab.lab import EngineDied, LabCluster, RankError
from dtlab.lab.kernel import processes

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, "cluster", "netns")
FAR = "dtlab-node-b"
HERE = os.uname().nodename


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """A namespace and a veth pair (removed after); the profile's settings."""
    netns = pytest.importorskip("dtlab.lab.kernel.netns")
    why = None
    if os.geteuid() != 0:
        why = "making a network namespace needs root"
    elif not (shutil.which("ip") and shutil.which("unshare")):
        why = "needs iproute2's ip and util-linux's unshare"
    if why:
        print(f"\nskipped: {why}")
        pytest.skip(why)
    tag = f"{os.getpid() % 10000}{random.randint(0, 9)}"
    name, ifname = f"dtlab-{tag}", f"dtl{tag}"
    subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 250)}"
    here, there = f"{subnet}.1", f"{subnet}.2"
    try:
        netns.make(name, ifname, here, there)
    except OSError as exc:
        print(f"\nskipped: cannot make a network namespace here: {exc}")
        pytest.skip(f"cannot make a network namespace here: {exc}")
    env = {
        "DTLAB_NETNS": name,
        "DTLAB_NETNS_HOST": FAR,
        "DTLAB_CONTROLLER_IP": here,
        "DTLAB_IFNAME": ifname,
    }
    saved = {k: os.environ.get(k) for k in [*env, "GLOO_SOCKET_IFNAME"]}
    os.environ.update(env, GLOO_SOCKET_IFNAME=ifname)
    try:
        yield {"here": here, "there": there, "store": tmp_path_factory.mktemp("shared")}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        netns.remove(name, ifname)


def _cluster(n: int, two_hosts) -> LabCluster:
    store = two_hosts["store"]
    return LabCluster(
        n, backend="gloo", timeout=10, profile_dir=PROFILE, store_dir=store
    )


def _peers():
    """On a rank: its host, and the addresses of the peers its gloo connections
    reach (this process's own network namespace's view)."""
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    addrs = {
        c.raddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.raddr and c.status == psutil.CONN_ESTABLISHED
    }
    return os.uname().nodename, x.item(), sorted(addrs)


def _fail_on(rank):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise ValueError(f"deliberate failure on {rank}")
    dist.all_reduce(torch.ones(4))
    return dist.get_rank()


def _sleep_on(rank, seconds):
    import torch.distributed as dist

    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_world_across_two_hosts(two_hosts):
    c = _cluster(4, two_hosts)
    c.start()
    try:
        assert c.placement.hosts == {0: HERE, 1: HERE, 2: FAR, 3: FAR}
        assert sorted(c.local_pids()) == [0, 1]  # the far side only through ipp
        # the controller listens on the veth address only
        controller = psutil.Process(c.ipp_cluster.controller.process.pid)
        listening = {
            conn.laddr.ip
            for p in [controller, *controller.children(recursive=True)]
            for conn in p.net_connections("tcp")
            if conn.status == psutil.CONN_LISTEN
        }
        assert two_hosts["here"] in listening
        assert listening <= {two_hosts["here"], "127.0.0.1"}
        out = c.run(_peers)
        assert [host for host, _, _ in out] == [HERE, HERE, FAR, FAR]
        assert all(total == 10.0 for _, total, _ in out)
        # gloo across the veth: each side reaches the other at its veth address
        assert two_hosts["there"] in out[0][2] and two_hosts["here"] in out[2][2]
        (folder,) = [p for p in two_hosts["store"].iterdir() if p.is_dir()]
        assert (folder / f"store-{c.generation}").exists()  # the shared rendezvous

        # an error on the far side names its rank, what the others were doing
        with pytest.raises(RankError) as info:
            c.run(_fail_on, 3)
        assert info.value.rank == 3 and "deliberate failure on 3" in str(info.value)
        assert "rank 0 was " in str(info.value)  # boards in the shared folder
        # Stop reaches the far side through ipyparallel, not by pid
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="every rank is free again"):
            c.run(_sleep_on, 2, 60, timeout=2)
        assert time.monotonic() - t0 < 30
        assert c.run(_peers)[3][1] == 10.0

        # a death over there is seen through the heartbeat
        far_pid = c.pids[3]
        killer = threading.Timer(1.0, os.kill, (far_pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(EngineDied, match=f"{FAR} and stopped answering"):
            c.run(_sleep_on, 3, 30, timeout=60)
        elapsed = time.monotonic() - t0 - 1.0
        print(f"\ndeath on the far host -> EngineDied after {elapsed:.2f}s")
        assert elapsed < 20
    finally:
        launched = [x.process.pid for x in processes.local_launchers(c.ipp_cluster)]
        pids = [p.pid for p in processes.tree(launched)]  # this cluster's, both sides
        c.stop()
    assert not [p for p in pids if _alive(p)], "stop() left processes"
    assert not [p for p in two_hosts["store"].iterdir() if p.is_dir()]


def test_far_engines_end_when_the_controller_stops_beating(two_hosts):
    c = _cluster(2, two_hosts)
    c.start()
    try:
        far = c.pids[1]
        assert c.placement.hosts[1] == FAR
        # what a kernel's death looks like from another host: the controller's
        # lifeline ends it, with its schedulers and heart monitor (its group)
        t0 = time.monotonic()
        os.killpg(c.ipp_cluster.controller.process.pid, signal.SIGKILL)
        while _alive(far) and time.monotonic() < t0 + 30:
            time.sleep(0.05)
        took = time.monotonic() - t0
        print(f"\nfar engine ended {took:.2f}s after its controller")
        assert not _alive(far) and took < 5.0
    finally:
        c.stop()

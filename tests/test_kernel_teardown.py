"""Nothing outlives its kernel: a real Jupyter kernel starts a cluster and goes away
in each of the ways JupyterLab (or the machine) makes it go, and no process of the
cluster is left 5 s later.

- restart (JupyterLab's "Restart kernel", ``KernelManager.restart_kernel``) during a
  background Run of the control panel (``start_run``): the kernel is asked to go,
  then SIGTERMed if it has not;
- shutdown during a blocking ``cluster.train`` cell;
- SIGKILL of the kernel (nothing runs in it: the processes watch it,
  :mod:`dtlab.lab.kernel.lifeline`);
- death of the Jupyter server: its kernels ``os._exit`` (skipping every exit hook)
  when their parent is gone.

The time from the kernel's end to the last process gone is printed (``-s``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.kernels import execute, start_kernel

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
pytest.importorskip("jupyter_client")

GRACE = 5.0  # seconds a cluster may outlive its kernel (issue 19)

START = """
import psutil
from dtlab.lab import start
from dtlab.train import TrainConfig
from dtlab.model import GPTConfig
cluster = start(world_size=2, timeout=10)
CONFIG = TrainConfig(
    model=GPTConfig(vocab_size=32, seq_len=8, n_layers=1, n_heads=2, d_model=16),
    steps=100_000,
)
print("PIDS", *[p.pid for p in psutil.Process().children(recursive=True)])
"""


def _cluster_pids(text: str) -> list[int]:
    line = next(x for x in text.splitlines() if x.startswith("PIDS"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) >= 5, f"expected a controller and 2 engines, got {pids}"
    return pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pids, since: float, what: str) -> None:
    """Every one of ``pids`` exits within GRACE seconds of ``since``."""
    while time.monotonic() < since + GRACE + 10:  # watch a while past the bound
        left = [p for p in pids if _alive(p)]
        if not left:
            break
        time.sleep(0.05)
    took = time.monotonic() - since
    left = [p for p in pids if _alive(p)]
    for p in left:  # never leave them to the next test
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    print(f"\n{what}: {len(pids)} processes gone {took:.2f}s after the kernel")
    assert not left, f"{what}: {left} still running {took:.1f}s after the kernel"
    assert took <= GRACE, f"{what}: the last process took {took:.1f}s"


def test_restart_during_a_background_run_then_shutdown_during_train():
    km, kc = start_kernel()
    try:
        pids = _cluster_pids(execute(kc, START))
        execute(
            kc,
            """
            from dtlab.lab.kernel.training import start_run
            live = start_run(cluster, CONFIG, pace=0.02)
            import time
            while live.step < 1:
                time.sleep(0.1)
            print("running", live.step)
            """,
        )
        old = km.provisioner.pid
        km.restart_kernel(now=False)  # what JupyterLab's "Restart kernel" does
        ended = _kernel_exit_of(old)
        _gone_within(pids, ended, "restart during a background run")

        kc.wait_for_ready(timeout=120)
        pids = _cluster_pids(execute(kc, START))
        execute(kc, "run = cluster.train(CONFIG, live=False)", wait=False)
        time.sleep(3.0)  # the cell is training now
        old = km.provisioner.pid
        km.shutdown_kernel(now=False)  # JupyterLab's "Shut down kernel"
        _gone_within(pids, _kernel_exit_of(old), "shutdown during train")
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def _kernel_exit_of(pid: int) -> float:
    while _alive(pid):
        time.sleep(0.02)
    return time.monotonic()


def test_sigterm_of_a_busy_kernel_then_sigkill_of_an_idle_one():
    km, kc = start_kernel()
    try:
        # SIGTERM while a cell waits on the ranks: JupyterLab's second step when a
        # kernel does not go on request; the kernel's handler stops the cluster
        pids = _cluster_pids(execute(kc, START))
        execute(kc, "cluster.run(__import__('time').sleep, 600)", wait=False)
        time.sleep(2.0)
        pid = km.provisioner.pid
        os.kill(pid, signal.SIGTERM)
        _gone_within(pids, _kernel_exit_of(pid), "SIGTERM of a busy kernel")
        assert km.provisioner.process.wait(10) == -signal.SIGTERM  # as before

        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=120)
        pids = _cluster_pids(execute(kc, START))
        pid = km.provisioner.pid
        os.kill(pid, signal.SIGKILL)
        _gone_within(pids, _kernel_exit_of(pid), "SIGKILL of an idle kernel")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


SERVER = """
import os, sys, time
import jupyter_client
km = jupyter_client.KernelManager(kernel_name="python3")
km.start_kernel()
kc = km.client()
kc.start_channels()
kc.wait_for_ready(timeout=120)
kc.execute_interactive(sys.argv[1], timeout=240)
print("KERNEL", km.provisioner.pid, flush=True)
time.sleep(600)
"""


def test_death_of_the_server():
    pytest.importorskip("jupyter_client")
    code = START
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, code],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        while not any(x.startswith("KERNEL") for x in lines):
            line = server.stdout.readline()
            assert line, f"the server ended early: {lines}"
            lines.append(line)
        pids = _cluster_pids("".join(lines))
        kernel = int(next(x for x in lines if x.startswith("KERNEL")).split()[1])
        server.kill()  # the Jupyter server dies; its kernel os._exits (~1 s later)
        server.wait()
        _gone_within(pids, _kernel_exit_of(kernel), "death of the server")
    finally:
        if server.poll() is None:
            server.kill()

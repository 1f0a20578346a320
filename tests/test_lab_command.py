"""``dtlab lab`` ended by a signal takes JupyterLab, its kernels and their clusters
with it; its command line turns JupyterLab's news pop-up off.

A real server is started; a kernel is opened through its REST API and driven
with jupyter_client through the connection file the server wrote; then
``dtlab lab`` gets SIGTERM (with a cluster in the kernel), SIGHUP or SIGINT, and
every process under it must be gone within a few seconds.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

from dtlab.cli import lab_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "sesame"
GRACE = 5.0  # seconds after dtlab lab returns by which nothing of it may be left


def test_lab_command_turns_the_news_off():
    cmd = lab_command(pathlib.Path("/x"))
    assert "--LabApp.news_url=None" in cmd  # page_config news: disabled
    assert "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate" in cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url, method="GET"):
    req = urllib.request.Request(url, method=method, data=b"" if method else None)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _serve(tmp_path):
    """``dtlab lab`` on a free port; returns (process, base URL)."""
    port = _free_port()
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtlab.cli", "lab", "--no-browser", "--port",
         str(port), "--token", TOKEN],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _request(f"{base}/api/status?token={TOKEN}")
            return proc, base
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("dtlab lab did not start serving")
            time.sleep(0.5)


def _open_kernel(base, runtime_dir):
    """A kernel of the server, and a jupyter_client client connected to it."""
    from jupyter_client import BlockingKernelClient

    kernel = _request(f"{base}/api/kernels?token={TOKEN}", method="POST")
    (path,) = glob.glob(os.path.join(runtime_dir, f"kernel-{kernel['id']}.json"))
    kc = BlockingKernelClient()
    kc.load_connection_file(path)
    # a client without its kernel's manager judges "alive" by heartbeats, 1 s by
    # default: a starting kernel on a loaded machine missed one and was taken for
    # dead. A dead kernel still fails below, at wait_for_ready's timeout.
    kc.hb_channel.time_to_dead = 30.0
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return kc


def _everything_under(pid: int) -> list:
    return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]


def _alive(p) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop_and_check(proc, signum, what):
    procs = _everything_under(proc.pid)
    t0 = time.monotonic()
    os.kill(proc.pid, signum)
    try:
        code = proc.wait(timeout=60)
    finally:
        returned = time.monotonic()
        while time.monotonic() < returned + GRACE and any(map(_alive, procs)):
            time.sleep(0.05)
        left = [p.pid for p in procs if _alive(p)]
        for p in procs:
            if _alive(p):
                p.kill()
    print(f"\n{what}: dtlab lab returned {returned - t0:.2f}s after the signal")
    assert not left, f"{what}: {left} outlived dtlab lab"
    return code


@pytest.mark.cluster
@pytest.mark.slow
def test_sigterm_stops_jupyterlab_its_kernels_and_their_clusters(tmp_path):
    pytest.importorskip("jupyter_client")
    proc, base = _serve(tmp_path)
    try:
        kc = _open_kernel(base, tmp_path)
        reply = kc.execute_interactive(
            "from dtlab.lab import start\ncluster = start(world_size=2, timeout=10)",
            timeout=240,
            output_hook=lambda msg: None,
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        kc.stop_channels()
        # the page JupyterLab serves says: no news (no pop-up asking for them)
        with urllib.request.urlopen(f"{base}/lab?token={TOKEN}", timeout=10) as r:
            page = r.read().decode()
        found = re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S)
        assert json.loads(found.group(1))["news"] == {"disabled": True}
        n = len(_everything_under(proc.pid))
        assert n >= 8, "the server, a kernel, a controller, 2 engines and nannies"
        _stop_and_check(proc, signal.SIGTERM, "SIGTERM")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGINT], ids=["HUP", "INT"])
def test_sighup_and_sigint_stop_jupyterlab_and_its_kernels(tmp_path, signum):
    pytest.importorskip("jupyter_client")
    proc, base = _serve(tmp_path)
    try:
        _open_kernel(base, tmp_path).stop_channels()
        assert len(_everything_under(proc.pid)) >= 3  # dtlab, server, kernel
        _stop_and_check(proc, signum, signal.Signals(signum).name)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

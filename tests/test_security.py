"""Nothing the course starts is reachable from the network, and nothing is open
without a key.

The ipyparallel controller, the engines (and the gloo connections between them),
the torch.distributed rendezvous and JupyterLab all listen on loopback only; the
ipyparallel connection files are private (0600) and carry an HMAC key; JupyterLab
refuses requests without its token. Each check lists the real listening sockets of
the real processes (psutil), not the settings that are supposed to produce them.
"""

import json
import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from dtlab.lab.kernel.processes import tree
from dtlab.launch import spawn

LOOPBACK = ("127.0.0.1", "::1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _listening(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP/UDP socket in LISTEN state (TCP) or bound
    without a peer (UDP) of ``pids`` and their children."""
    out = []
    for p in tree(pids):
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            listens = c.status == psutil.CONN_LISTEN or (
                c.type == socket.SOCK_DGRAM and not c.raddr
            )
            if listens:
                out.append((p.pid, c.laddr.ip, c.laddr.port))
    return out


def _own_listening_sockets():
    """On a rank: the addresses this process listens on, and the store's type."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore -> the real one
        store = store.underlying_store
    mine = _listening([os.getpid()])
    return type(store).__name__, sorted({ip for _, ip, _ in mine}), len(mine)


# ---- the live cluster ----------------------------------------------------------------
@pytest.mark.cluster
def test_cluster_processes_listen_on_loopback_only(lab_cluster):
    cluster = lab_cluster(2)
    controller = cluster.ipp_cluster.controller.process.pid
    out = cluster.run(_own_listening_sockets)
    for rank, (store, ips, n) in enumerate(out):
        # the rendezvous is a file, not a TCPStore (which binds every interface)
        assert store == "FileStore", (rank, store)
        # gloo's own listening sockets are pinned to lo
        assert n > 0 and set(ips) <= set(LOOPBACK), (rank, ips)
    found = _listening([controller, *cluster.pids.values()])
    assert any(pid == controller for pid, _, _ in found), "controller not seen"
    wide = [s for s in found if s[1] not in LOOPBACK]
    assert not wide, f"listening beyond loopback: {wide}"


@pytest.mark.cluster
def test_connection_files_are_private_and_keyed(lab_cluster):
    cluster = lab_cluster(2)
    ipp = cluster.ipp_cluster
    security = os.path.join(ipp.profile_dir, "security")
    files = [
        os.path.join(security, f"ipcontroller-{ipp.cluster_id}-{who}.json")
        for who in ("client", "engine")
    ]
    for path in files:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path} is {oct(mode)}"
        info = json.load(open(path))
        assert len(info["key"]) >= 16, "no message-signing key"
        assert info["signature_scheme"].startswith("hmac-")
        assert info["interface"] == "tcp://127.0.0.1"
    # the cluster's own folder (rendezvous file, status boards) is private too
    assert stat.S_IMODE(os.stat(cluster.private_dir).st_mode) == 0o700
    for name in os.listdir(cluster.private_dir):
        if name.startswith("board-"):
            mode = stat.S_IMODE(
                os.stat(os.path.join(cluster.private_dir, name)).st_mode
            )
            assert mode == 0o600, (name, oct(mode))


def test_spawned_ranks_listen_on_loopback_only():
    for store, ips, n in spawn(_own_listening_sockets, 2, timeout=30):
        assert store == "FileStore"
        assert n > 0 and set(ips) <= set(LOOPBACK), ips


# ---- JupyterLab ----------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url) -> int:
    """HTTP status without following redirects."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_dtlab_lab_needs_its_token_and_listens_on_loopback():
    """``dtlab lab`` as a learner runs it (no --token: Jupyter makes one)."""
    pytest.importorskip("jupyterlab")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtlab.cli", "lab", "--no-browser", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in proc.stdout], daemon=True
    ).start()
    try:
        token, deadline = None, time.monotonic() + 120
        while token is None and time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "JupyterLab exited"
                continue
            m = re.search(rf"127\.0\.0\.1:{port}/\S*token=([0-9a-f]+)", line)
            token = m.group(1) if m else None
        assert token and len(token) >= 32, "no token printed: authentication off?"
        base = f"http://127.0.0.1:{port}"
        while True:  # the URL can be printed a moment before the port answers
            try:
                _status(f"{base}/api/status")
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "JupyterLab never answered"
                time.sleep(0.5)
        # no token: the API refuses, the UI sends to the login page
        assert _status(f"{base}/api/contents/index.ipynb") == 403
        assert _status(f"{base}/api/kernels") == 403
        assert _status(f"{base}/lab") in (302, 303)
        assert _status(f"{base}/api/contents/index.ipynb?token=wrong{token}") == 403
        # with it: in
        assert _status(f"{base}/api/contents/index.ipynb?token={token}") == 200
        found = _listening([proc.pid])
        assert found and all(ip in LOOPBACK for _, ip, _ in found), found
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

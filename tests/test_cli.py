"""``dtlab lab``: JupyterLab on the chapter index, loopback only, token required."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

from dtlab.cli import lab_command, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_lab_command_binds_loopback_and_opens_the_index():
    cmd = lab_command(__import__("pathlib").Path("/x"), port=9999, no_browser=True)
    assert "--ServerApp.ip=127.0.0.1" in cmd and "--no-browser" in cmd
    assert "--LabApp.default_url=/lab/tree/index.ipynb" in cmd
    with pytest.raises(ValueError, match="token"):
        lab_command(__import__("pathlib").Path("/x"), token="")


def test_missing_index_is_a_clear_error(tmp_path, capsys):
    assert main(["lab", "--notebooks", str(tmp_path)]) == 2
    assert "no chapter index" in capsys.readouterr().err


def test_dtlab_lab_serves_the_course_with_a_token():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtlab.cli", "lab", "--no-browser", "--port",
         str(port), "--token", "sesame"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline:
            try:
                status = _get(f"{base}/lab?token=sesame")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        assert status == 200
        assert _get(f"{base}/api/contents/index.ipynb?token=sesame") == 200
        assert _get(f"{base}/api/contents/index.ipynb") == 403  # no token, no access
        server = psutil.Process(proc.pid)
        listening = [
            c.laddr.ip
            for p in [server, *server.children(recursive=True)]
            for c in _connections(p)
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _connections(p: psutil.Process) -> list:
    """``p``'s inet sockets, or none if it ended meanwhile (the server starts short
    helper processes; on a busy machine one may exit between listing and reading)."""
    try:
        return p.net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return []


def _help(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's -h exits
        return exc.code


def test_run_and_bench_have_their_own_options(capsys):
    assert _help(["--help"]) == 0
    top = capsys.readouterr().out
    assert "run" in top and "bench" in top
    for argv, expected in (
        (["run", "-h"], "--nproc"),
        (["bench", "-h"], "--quick"),
        (["bench", "pp", "-h"], "--steps"),  # a part takes the same options
    ):
        assert _help(argv) == 0
        assert expected in capsys.readouterr().out
    assert _help(["bench", "ddp", "--bogus"]) == 2  # not silently ignored
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err

"""Starting a launcher (``torchrun``, ``mp.spawn``, ``accelerate launch``) from a
subprocess with a bounded wait, and reading back what its ranks wrote.

Taught in chapters 02 and 07 ("from dtlab to the real thing"). A notebook cell or a
test that starts a launcher must never hang on it nor leave its workers behind:
:func:`run_bounded` starts the command in a process group of its own and kills the
whole group (the launcher and every worker it started) when the time is up. The
ranks write ``rank{R}.json`` into a directory; :func:`read_rank_records` collects
them in rank order.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess

__all__ = [
    "free_loopback_port",
    "run_bounded",
    "write_rank_record",
    "read_rank_records",
]


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the launcher binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(**extra) -> dict[str, str]:
    """This process's environment for a launcher's subprocess: gloo on loopback,
    one thread per rank, and none of this process's own rank variables (they are
    the launcher's to set)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra)
    return env


def run_bounded(command: list[str], *, timeout: float, env: dict) -> str:
    """Run ``command`` in its own process group; kill the whole group if it is
    not done within ``timeout`` seconds. Returns its output (stdout and stderr);
    raises ``RuntimeError`` with the output's tail on failure or timeout."""
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own: killpg reaches every worker
    )
    what = " ".join(command[:4]) + " ..."
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RuntimeError(
            f"{what} did not finish within {timeout:.0f}s and was killed; its "
            f"output:\n{output[-4000:]}"
        ) from None
    finally:
        try:  # workers that outlived their launcher go too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited with {proc.returncode}:\n{output[-4000:]}")
    return output


def write_rank_record(out_dir: str, record: dict) -> None:
    """Write ``record`` (with its ``"rank"``) as ``rank{R}.json``, atomically."""
    path = os.path.join(out_dir, f"rank{record['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def read_rank_records(out_dir: str, n: int, output: str = "") -> list[dict]:
    """The ``n`` records the ranks wrote, in rank order."""
    records = []
    for rank in range(n):
        path = os.path.join(out_dir, f"rank{rank}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"rank {rank} wrote no record; output:\n{output}")
        with open(path) as f:
            records.append(json.load(f))
    return records

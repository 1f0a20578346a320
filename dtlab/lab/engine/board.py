"""What this rank is doing, in a file the notebook can read while the rank is stuck.

An engine blocked in a collective cannot answer the notebook (and a dead one
cannot answer at all), so each rank writes its state into a small memory-mapped
file instead, and the notebook reads it without asking
(:func:`dtlab.lab.kernel.failures.read_board`, :mod:`dtlab.lab.kernel.status`). The
file holds two lines. The first, at offset 0, is ``state<TAB>t_wall<TAB>text<NUL>``,
with state

- ``in``: inside the collective ``text`` since ``t_wall``;
- ``after``: running Python after the collective ``text``;
- ``running``: the user's function, before any collective;
- ``failed``: the function raised; ``text`` says what the rank was doing;
- ``idle``: between calls.

The second, at :data:`HEART_AT`, is the rank's *heartbeat*, rewritten every
:data:`BEAT` seconds by a thread of its own (so it goes on while the rank computes
or waits in a collective, and stops when the process is stopped or dead):
``t_wall<TAB>pid<TAB>host<TAB>rss_bytes<TAB>device<TAB>device_bytes<TAB>cgroup
<TAB>oom_kills<NUL>``: the last two are the rank's memory cgroup and its count of
OOM-killer kills, so that the notebook can tell, once the rank is dead, whether
the kernel's OOM killer ended it (the count went up after the last beat).

A write is a copy into the page cache: cheap enough for every collective, and
still there after the process was killed. Engines of one host keep their boards in
the cluster's private folder; engines of a world across hosts in the shared one.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

from dtlab import comm
from dtlab.lab.engine.state import state

BOARD_BYTES = 1024
HEART_AT = 384  # the op line gets the bytes before, the heartbeat the rest
BEAT = 0.5  # seconds between heartbeats


class StatusBoard:
    """This rank's status file; also a :func:`dtlab.comm.watch` watcher, so every
    collective's start and end is written as it happens."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, BOARD_BYTES)
            self._mm = mmap.mmap(fd, BOARD_BYTES)
        finally:
            os.close(fd)
        self.path = path
        self._entry, self._text = None, ""
        self._closed = threading.Event()
        self.beat()
        threading.Thread(
            target=self._beating, name="dtlab-heartbeat", daemon=True
        ).start()

    def write(self, status: str, text: str = "", t: float | None = None) -> None:
        line = f"{status}\t{time.time() if t is None else t:.3f}\t{text}"
        data = line.encode()[: HEART_AT - 1] + b"\0"  # the reader stops at NUL
        self._mm[: len(data)] = data

    def beat(self) -> None:
        """Write the heartbeat line now."""
        device, used = _device_memory()
        cgroup = memory_cgroup()
        kills = oom_kills(cgroup)
        line = (
            f"{time.time():.3f}\t{os.getpid()}\t{os.uname().nodename}\t"
            f"{_rss()}\t{device}\t{used}\t{cgroup or ''}\t"
            f"{-1 if kills is None else kills}"
        )
        data = line.encode()[: BOARD_BYTES - HEART_AT - 1] + b"\0"
        self._mm[HEART_AT : HEART_AT + len(data)] = data

    def _beating(self) -> None:
        while not self._closed.wait(BEAT):
            try:
                self.beat()
            except (ValueError, OSError):  # closed meanwhile
                return

    def __call__(self, entry, active: bool) -> None:  # a dtlab.comm watcher
        if entry is not self._entry:  # each op is described once, not per write
            self._entry, self._text = entry, comm.describe_op(entry)
        self.write("in" if active else "after", self._text, entry[5])

    def close(self) -> None:
        comm.unwatch(self)
        self._closed.set()
        self._mm.close()


def decode(raw: bytes) -> tuple[str, float, str]:
    """``(state, t_wall, text)`` from a board file's bytes (``ValueError`` if they
    are not a board line)."""
    line = raw[:HEART_AT].split(b"\0", 1)[0].decode(errors="replace")
    status, t, text = line.split("\t", 2)
    return status, float(t), text


def decode_heartbeat(raw: bytes) -> dict | None:
    """The heartbeat line of a board file's bytes as a dict (``t``, ``pid``,
    ``host``, ``rss``, ``device``, ``device_bytes``, ``cgroup``, ``oom_kills``),
    or ``None``."""
    line = raw[HEART_AT:].split(b"\0", 1)[0].decode(errors="replace")
    try:
        t, pid, host, rss, device, used, cgroup, kills = line.split("\t")
        return {
            "t": float(t),
            "pid": int(pid),
            "host": host,
            "rss": int(rss),
            "device": device,
            "device_bytes": int(used),
            "cgroup": cgroup or None,
            "oom_kills": None if int(kills) < 0 else int(kills),
        }
    except ValueError:
        return None


def memory_cgroup() -> str | None:
    """The folder of this process's memory cgroup (v1 ``memory`` controller, or
    the unified v2 hierarchy), or ``None``."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
    for line in lines:
        if line.startswith("0::"):
            return os.path.join("/sys/fs/cgroup", line[3:].lstrip("/"))
    return None


def oom_kills(cgroup: str | None) -> int | None:
    """How many processes the kernel's OOM killer ended in ``cgroup`` (``oom_kill``
    in v1's ``memory.oom_control``, v2's ``memory.events``), or ``None``."""
    if not cgroup:
        return None
    for name in ("memory.oom_control", "memory.events"):
        try:
            with open(os.path.join(cgroup, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _rss() -> int:
    """This process's resident memory, in bytes (from /proc: no psutil call on
    every beat)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _device_memory() -> tuple[str, int]:
    """This rank's device and the bytes allocated on it (``("cpu", 0)`` on gloo)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        return f"cuda:{index}", int(torch.cuda.memory_allocated(index))
    return "cpu", 0


def open_board(path: str | None) -> None:
    """Make ``path`` this rank's board (``None``: none), closing a previous one."""
    old = state.board
    if old is not None and old.path == path:
        return
    if old is not None:
        old.close()
        state.board = None
    if path:
        board = state.board = StatusBoard(path)
        board.write("idle")
        comm.watch(board)


def post(status: str, text: str = "") -> None:
    """Write ``status`` on this rank's board, if it has one."""
    if state.board is not None:
        state.board.write(status, text)

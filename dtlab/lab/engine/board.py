"""What this rank is doing, in a file the notebook can read while the rank is stuck.

An engine blocked in a collective cannot answer the notebook (and a dead one
cannot answer at all), so each rank writes its state into a small memory-mapped
file instead, and the notebook reads it without asking
(:func:`dtlab.lab.failures.read_board`). The file holds one line,
``state<TAB>t_wall<TAB>text<NUL>``, with state

- ``in``: inside the collective ``text`` since ``t_wall``;
- ``after``: running Python after the collective ``text``;
- ``running``: the user's function, before any collective;
- ``failed``: the function raised; ``text`` says what the rank was doing;
- ``idle``: between calls.

A write is a 512-byte copy into the page cache: cheap enough for every collective,
and still there after the process was killed.
"""

from __future__ import annotations

import mmap
import os
import time

from dtlab import comm
from dtlab.lab.engine.state import state

BOARD_BYTES = 512


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

    def write(self, status: str, text: str = "", t: float | None = None) -> None:
        line = f"{status}\t{time.time() if t is None else t:.3f}\t{text}\0".encode()
        n = min(len(line), BOARD_BYTES)
        self._mm[:n] = line[:n]  # the reader stops at the first NUL

    def __call__(self, entry, active: bool) -> None:  # a dtlab.comm watcher
        if entry is not self._entry:  # each op is described once, not per write
            self._entry, self._text = entry, comm.describe_op(entry)
        self.write("in" if active else "after", self._text, entry[5])

    def close(self) -> None:
        comm.unwatch(self)
        self._mm.close()


def decode(raw: bytes) -> tuple[str, float, str]:
    """``(state, t_wall, text)`` from a board file's bytes (``ValueError`` if they
    are not a board line)."""
    line = raw.split(b"\0", 1)[0].decode(errors="replace")
    status, t, text = line.split("\t", 2)
    return status, float(t), text


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

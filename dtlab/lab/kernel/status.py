"""Every rank at a glance: pid, host, device, memory in use, what it is doing, and
how long since its last heartbeat, as text, as a table, or as a live widget.

Taught in chapter 01.

    cluster.status()               # a table (text in a terminal, HTML in a notebook)
    status_widget(cluster)         # the same table, refreshed every second

It reads the ranks' status boards (:mod:`dtlab.lab.engine.board`), never asks the
engines: it answers while every rank is busy in a long step or stuck in a
collective, and it shows a stopped rank (its heartbeat gets old) and a dead one (its
last operation stays). What a board cannot tell (a process of this machine that is
stopped or gone, an engine the controller dropped) comes from the processes
themselves and from ipyparallel's registry.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass

from dtlab.lab.engine import board
from dtlab.lab.kernel import failures, processes

SILENT = 3.0  # seconds without a heartbeat after which a rank is called silent


@dataclass(frozen=True)
class RankStatus:
    """One rank's row (``memory``: resident bytes of its process; ``device_memory``:
    bytes allocated on its GPU; ``heartbeat_s``: seconds since its heartbeat,
    ``None`` without a board)."""

    rank: int
    pid: int | None
    host: str
    device: str
    memory: int | None
    device_memory: int | None
    doing: str
    heartbeat_s: float | None
    state: str  # running | stopped | dead | dropped | silent


COLUMNS = ("rank", "pid", "host", "device", "memory", "doing", "heartbeat", "state")


class Status:
    """The rows of :func:`status`; prints as a text table, shows as HTML."""

    def __init__(self, rows: list[RankStatus]):
        self.rows = rows

    def __getitem__(self, rank: int) -> RankStatus:
        return next(r for r in self.rows if r.rank == rank)

    def cells(self) -> list[tuple[str, ...]]:
        return [
            (
                str(r.rank),
                str(r.pid or "?"),
                r.host,
                r.device,
                _memory(r),
                r.doing,
                "?" if r.heartbeat_s is None else f"{r.heartbeat_s:.1f}s ago",
                r.state,
            )
            for r in self.rows
        ]

    def __str__(self) -> str:
        table = [COLUMNS, *self.cells()]
        widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]
            for row in table
        )

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in COLUMNS)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self.cells()
        )
        return f"<table><tr>{head}</tr>{body}</table>"


def _memory(row: RankStatus) -> str:
    if row.memory is None:
        return "?"
    text = f"{row.memory / 2**20:.0f} MiB"
    if row.device_memory:
        text += f" (+{row.device_memory / 2**20:.0f} MiB on {row.device})"
    return text


def status(cluster) -> Status:
    """Each rank's :class:`RankStatus`, from its board, its process and the
    controller's registry."""
    now = time.time()
    placement = cluster.placement
    local = cluster.local_pids()
    registered = set(cluster.client.ids) if cluster.client is not None else set()
    rows = []
    for rank in sorted(cluster.rank_to_engine):
        path = cluster.board_file(rank)
        raw = _read(path)
        beat = board.decode_heartbeat(raw) if raw else None
        entry = failures.read_board(path)
        doing = failures.describe_board(entry, now) if entry else "unknown"
        age = now - beat["t"] if beat else None
        pid = placement.pids.get(rank) if placement else None
        if rank in local and not processes.alive(local[rank]):
            state = "dead"
        elif rank in local and processes.stopped(local[rank]):
            state = "stopped"
        elif cluster.rank_to_engine[rank] not in registered:
            state = "dropped"
        elif age is not None and age > SILENT:
            state = "silent"
        else:
            state = "running"
        device = beat["device"] if beat else _device(placement, rank)
        rows.append(
            RankStatus(
                rank=rank,
                pid=pid,
                host=placement.hosts.get(rank, "?") if placement else "?",
                device=device,
                memory=beat["rss"] if beat else None,
                device_memory=beat["device_bytes"] if beat else None,
                doing=doing,
                heartbeat_s=age,
                state=state,
            )
        )
    return Status(rows)


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(board.BOARD_BYTES)
    except OSError:
        return None


def _device(placement, rank: int) -> str:
    if placement is None:
        return "?"
    device = placement.devices.get(rank)
    return "cpu" if device is None else f"cuda:{device}"


def status_widget(cluster, interval: float = 1.0):
    """An HTML widget showing :func:`status`, refreshed every ``interval`` seconds
    by a thread of the kernel until the cluster stops (it then says so)."""
    import ipywidgets

    widget = ipywidgets.HTML(status(cluster)._repr_html_())

    def refresh():
        while cluster.running:
            time.sleep(interval)
            try:
                widget.value = status(cluster)._repr_html_()
            except Exception as exc:  # noqa: BLE001 - shown, never raised here
                widget.value = f"<pre>{html.escape(str(exc))}</pre>"
        widget.value = "<p>the cluster is stopped</p>"

    threading.Thread(target=refresh, name="dtlab-status", daemon=True).start()
    return widget

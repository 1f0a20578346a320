"""This engine's own state: its rank, its world, and whether that world still works.

An engine is a long-lived process: it joins a world at start, and a new one at
every ``cluster.reset()`` (a new *generation*). Between calls it keeps what the
notebook needs to know about it here, and gives ``%%px`` cells their names
(``rank``, ``world_size``, ``topo``) through IPython's user namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineState:
    """What one engine knows about itself (one instance per process: :data:`state`).

    ``broken``: why the process group cannot be used (a rank failed, the group was
    torn down), or ``None`` while it works. ``peers``: the pids of the other
    engines of this world on this host (what :mod:`~dtlab.lab.engine.failfast`
    cuts loose on an error). ``board``: this rank's
    :class:`~dtlab.lab.engine.board.StatusBoard`, or ``None``."""

    rank: int | None = None
    world_size: int | None = None
    generation: int = 0
    broken: str | None = None
    peers: list[int] = field(default_factory=list)
    board: object | None = None


state = EngineState()


def user_namespace() -> dict:
    """The namespace ``%%px`` cells run in (IPython's user namespace; empty outside
    IPython)."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:  # pragma: no cover - engines always have IPython
        shell = None
    return shell.user_ns if shell is not None else {}

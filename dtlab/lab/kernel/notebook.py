"""The notebook's cluster: :func:`start` makes (or reuses) it, and ``%%px`` cells
and dtlab's magics (:mod:`dtlab.lab.kernel.magics`) follow it.

Taught in chapter 01; every later chapter starts with ``cluster = start(...)``.
"""

from __future__ import annotations

from dtlab.lab.kernel import teardown
from dtlab.lab.kernel.cluster import LabCluster


def start(world_size: int | None = None, **kwargs) -> LabCluster:
    """Start (or reuse) the notebook's cluster.

    Re-running a notebook's start cell must not leave orphan engines: a running
    cluster with the same settings is reused (its process group reset); any other
    cluster this kernel started is stopped first. In IPython, ``%%px`` cells and
    the magics ``%%rank``, ``%ranks``, ``%push``, ``%pull``, ``%status`` then
    target it.
    """
    # a request this machine cannot serve fails here, before anything is stopped
    fresh = LabCluster(world_size, **kwargs)
    for old in teardown.live():
        same = (
            old.running
            and (world_size is None or old.world_size == world_size)
            and all(getattr(old, k, None) == v for k, v in kwargs.items())
        )
        if same:
            try:
                return _follow(old.reset())
            except Exception:  # noqa: BLE001 - fall through to a fresh start
                pass
        old.stop()
    return _follow(fresh.start())


def _follow(cluster: LabCluster) -> LabCluster:
    """Make ``%%px`` cells and dtlab's magics target ``cluster`` in IPython."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return cluster
    shell = get_ipython()
    if shell is None:
        return cluster
    for other in teardown.live():
        other.px_active = other is cluster
    cluster.px_active = True
    cluster.connect_view()
    from dtlab.lab.kernel.magics import load_ipython_extension

    load_ipython_extension(shell)
    return cluster

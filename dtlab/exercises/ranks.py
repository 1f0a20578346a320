"""Running a checker's probe on every rank, and turning what goes wrong there into
a verdict.

Used by every chapter's live exercises. A *probe* is a function of
:mod:`dtlab.exercises` that runs on each rank: it builds the inputs, calls the
learner's function under a :class:`dtlab.exercises.watch.Watch`, and returns what it
observed (values, comm events, calls, peak bytes). The checker then judges the
observations of all ranks together, in the notebook's process.

Where the ranks are:

- ``cluster`` (a :class:`dtlab.lab.LabCluster`, or anything with ``run(fn, *args,
  timeout=...)`` and ``world_size``): the probe runs on its engines;
- no cluster, but ``torch.distributed`` is up (a script under ``torchrun`` calling
  the checker on every rank): the probe runs here and the ranks share their
  observations (``all_gather_object``);
- neither: ``world_size`` fresh processes (:func:`dtlab.launch.spawn`), the
  learner's function shipped by value (cloudpickle, when installed).
"""

from __future__ import annotations

import pickle

import torch.distributed as dist

from dtlab import launch
from dtlab.exercises.grading import ExerciseFailed, NotAttempted
from dtlab.topology import Layout, Topology

__all__ = ["on_every_rank", "world_size_of", "topology", "rank_and_size"]


def world_size_of(cluster, default: int = 4) -> int:
    """How many ranks the checker will get from ``cluster`` (or would spawn)."""
    if cluster is not None:
        return int(cluster.world_size)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return default


def on_every_rank(cluster, probe, *args, world_size: int = 4, timeout: float = 300):
    """``probe(*args)`` on every rank; the results in rank order. An error raised on
    a rank becomes an :class:`ExerciseFailed` naming the rank, what it raised and
    what every rank was doing; a ``NotImplementedError`` becomes
    :class:`NotAttempted`."""
    if cluster is not None:
        try:
            return cluster.run(probe, *args, timeout=timeout)
        except launch.RankError as exc:
            raise verdict(exc) from None
    if dist.is_available() and dist.is_initialized():
        try:
            mine = probe(*args)
        except NotImplementedError as exc:
            raise NotAttempted(str(exc)) from None
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out
    try:
        return launch.spawn(run_shipped, world_size, ship(probe, args), timeout=timeout)
    except launch.RankError as exc:
        raise verdict(exc) from None


def verdict(exc: launch.RankError) -> Exception:
    """The learner-facing form of an error raised on a rank."""
    first = str(exc).split("\n", 1)[0]
    if "NotImplementedError" in first:
        return NotAttempted(first)
    # what each rank was doing matters when one of them was in a collective
    stuck = any(what.startswith("in ") for what in exc.doing.values())
    doing = "".join(
        f"\n  rank {r} was {what}" for r, what in sorted(exc.doing.items()) if stuck
    )
    return ExerciseFailed(f"your function raised on {first}{doing}")


def ship(probe, args) -> bytes:
    """``(probe, args)`` as bytes a fresh process can load: by value where
    cloudpickle is installed (a function defined in a notebook has no module a
    spawned process could import)."""
    try:
        import cloudpickle
    except ImportError:  # the core alone: functions must be importable by name
        return pickle.dumps((probe, args))
    return cloudpickle.dumps((probe, args))


def run_shipped(payload: bytes):
    probe, args = pickle.loads(payload)
    return probe(*args)


# ---- on a rank -----------------------------------------------------------------------
def rank_and_size() -> tuple[int, int]:
    """This rank and the world size (0 and 1 without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Building a Topology creates process groups (a collective, and gloo threads and
# sockets on every rank), so each layout's topology is built once per world and
# reused by every probe after it; a world torn down (a failed probe, a reset)
# releases the groups, and the next probe builds them anew. Every rank runs the
# same probes in the same order, so every rank builds the same groups in order.
_TOPOLOGIES: dict[Layout, Topology] = {}


def topology(layout: Layout) -> Topology:
    """This rank's :class:`Topology` of ``layout``, built once per world."""
    topo = _TOPOLOGIES.get(layout)
    if topo is None or topo.released:
        topo = _TOPOLOGIES[layout] = Topology(layout)
    return topo

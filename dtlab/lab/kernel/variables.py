"""Variables between the notebook and the ranks: push a value into every rank's
namespace, pull a name back from each.

Taught in chapter 01 (each rank is a process with variables of its own).

    cluster.push(lr=0.1, data=batch)   # every rank now has lr and data
    cluster.pull("loss")               # [rank 0's loss, rank 1's loss, ...]

The namespace is the one ``%%rank`` and ``%%px`` cells run in (each engine's
IPython user namespace, which already holds ``rank``, ``world_size``, ``topo``);
values travel pickled (cloudpickle), through ipyparallel's push and pull. Both wait
the way ``cluster.run`` does (:mod:`dtlab.lab.kernel.waiting`): a dead or stopped rank
is named instead of waited for.
"""

from __future__ import annotations

from dtlab.lab.kernel import replacing, waiting

TIMEOUT = 60.0  # seconds: moving a value is quick, unless a rank is busy


def _targets(cluster, ranks) -> list[int]:
    ranks = sorted(cluster.rank_to_engine) if ranks is None else sorted(ranks)
    unknown = [r for r in ranks if r not in cluster.rank_to_engine]
    if unknown:
        raise ValueError(
            f"ranks {unknown} are not in this world of {cluster.world_size} "
            f"(ranks 0..{cluster.world_size - 1})"
        )
    return ranks


def push(cluster, values: dict, ranks=None) -> None:
    """Set ``values`` (``{name: value}``) in the namespace of ``ranks`` (all)."""
    for name in values:
        if not name.isidentifier():
            raise ValueError(f"push: {name!r} is not a Python variable name")
    _on_each(cluster, ranks, lambda view: view.push(values, block=False), "push")


def pull(cluster, name: str, ranks=None) -> list:
    """Each rank's (of ``ranks``, all by default) variable ``name``, in rank
    order; a rank without it raises a :class:`dtlab.launch.RankError` naming it."""
    if not name.isidentifier():
        raise ValueError(f"pull: {name!r} is not a Python variable name")
    return _on_each(
        cluster, ranks, lambda view: view.pull(name, block=False), f"pull {name!r}"
    )


def _on_each(cluster, ranks, request, what: str) -> list:
    """``request(view)`` on each rank's engine (ipyparallel's non-blocking
    ``DirectView`` call), waited for as ``cluster.run`` waits."""
    cluster.check_running()
    ranks = _targets(cluster, ranks)
    replacing.require_registered(cluster, ranks)
    pending = [request(cluster.client[cluster.rank_to_engine[r]]) for r in ranks]
    return waiting.wait_for_ranks(
        cluster, pending, ranks=ranks, timeout=TIMEOUT, what=what
    )

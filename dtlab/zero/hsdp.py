"""HSDP, hybrid sharding: ZeRO within a shard group, plain replicas across groups.

Taught in chapter 11 (beyond 3D; HSDP vs FSDP across nodes), on top of chapter 03's
ZeRO. Fully sharded data parallelism over all N = R·S data-parallel ranks gathers
every weight from N ranks, twice a step, across the slowest links of the cluster.
Hybrid sharding arranges the ranks as an R × S grid (a 2D device mesh)::

                 shard group (size S): within a node, fast links
    replica 0    [ 0   1 ]      each rank holds 1/S of the model state:
    replica 1    [ 2   3 ]      the all-gathers and reduce-scatters stay in a row
                   |   |
                 replicate group (size R): the ranks that hold the same slice,
                 across nodes; the only traffic between them is one all-reduce
                 of each reduced gradient slice, Ψ/S per step

- **Sharded** over the shard group (the rows): parameters, gradients and optimizer
  state, exactly as ZeRO stage ``stage`` shards them over S ranks; the memory per
  rank is the S-way figure (:func:`dtlab.estimate.hsdp_states_per_rank`).
- **Replicated** across the replicate group (the columns): rank (i, j) holds the
  slice that (i', j) holds, and steps it identically.
- **Synchronised**: after the shard group's reduce-scatter, the summed slice is
  all-reduced over the replicate group, then divided by R·S (the data-parallel
  degree). Per step and rank: the shard group's (S−1)/S·Ψ-sized collectives, and
  2(R−1)/R · Ψ/S across replicas (:func:`dtlab.estimate.hsdp_comm_per_step`).

Zhao et al. 2023, "PyTorch FSDP", §3.2 calls it hybrid sharding with sharding factor
F = S (F = N is full sharding, F = 1 is DDP). FSDP2 runs it as ``fully_shard(module,
mesh=mesh_2d)`` with mesh dims ``(replicate, shard)``; torchtitan names the axes
``dp_replicate`` and ``dp_shard``; DeepSpeed's ZeRO++ (Wang et al. 2023, hpZ) keeps a
secondary copy of the weights in each node for the same reason: gathers stay inside.

:func:`hsdp_groups` builds the two groups; :class:`Replicas` is the replicate side
(one replica, ``Replicas(None)``, does nothing). The wrapper takes them as
``FullyShardedDataParallel(module, ..., process_group=shard, replicate_group=rep)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtlab import comm
from dtlab.checks import divisors, positive_int
from dtlab.topology import Axis

__all__ = [
    "SHARD_AXIS",
    "REPLICATE_AXIS",
    "HybridGroups",
    "Replicas",
    "hsdp_groups",
    "hybrid_axes",
]

# torchtitan's names; comm records them as the axis of each collective
SHARD_AXIS = "dp_shard"
REPLICATE_AXIS = "dp_replicate"


@dataclass(frozen=True)
class HybridGroups:
    """This rank's two HSDP groups, each a :class:`dtlab.topology.Axis` (``None``
    on a rank outside the data-parallel ranks they were built for)."""

    shard: Axis | None
    replicate: Axis | None


def hsdp_groups(shard_size: int, dp_groups=None, *, backend=None) -> HybridGroups:
    """Cut each data-parallel group into replicas of ``shard_size`` consecutive
    ranks: ``dp_groups=[[0, 1, 2, 3]]``, ``shard_size=2`` gives the shard groups
    ``[0, 1], [2, 3]`` and the replicate groups ``[0, 2], [1, 3]``.

    ``dp_groups``: one list of global ranks, or every data-parallel group of a
    layout (``topo.layout.groups("dp")``, or ``"dp_cp"``), default the whole world.
    A collective: every rank of the world calls it with the same arguments, and
    creates every group in the same order (``new_group`` is collective), so pass all
    the groups, not only this rank's. Consecutive ranks share a shard group because
    dtlab numbers a node's devices consecutively: the gathers stay inside a node."""
    positive_int("shard_size", shard_size)
    world = dist.get_world_size()
    if dp_groups is None:
        dp_groups = [list(range(world))]
    elif dp_groups and all(isinstance(r, int) for r in dp_groups):
        dp_groups = [list(dp_groups)]
    rows, columns = [], []
    for ranks in dp_groups:
        ranks = list(ranks)
        if len(ranks) % shard_size:
            raise ValueError(
                f"shard_size={shard_size} does not divide the {len(ranks)} "
                f"data-parallel ranks {ranks}: pick it from {divisors(len(ranks))}"
            )
        rows += [ranks[i : i + shard_size] for i in range(0, len(ranks), shard_size)]
        columns += [ranks[j::shard_size] for j in range(shard_size)]
    me = dist.get_rank()
    return HybridGroups(
        shard=_make_axis(SHARD_AXIS, rows, me, backend),
        replicate=_make_axis(REPLICATE_AXIS, columns, me, backend),
    )


def _make_axis(name: str, groups, me: int, backend) -> Axis | None:
    mine = None
    for ranks in groups:  # every rank creates every group, in this order
        group = dist.new_group(ranks, backend=backend)
        if me in ranks:
            mine = Axis(name, tuple(ranks), ranks.index(me), group)
    return mine


def _labelled(group, name: str) -> Axis:
    """``group`` as an Axis, so that comm records its collectives under ``name``
    (an Axis passed in keeps its own name: ``tp``, ``dp`` of a Topology)."""
    if isinstance(group, Axis):
        return group
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    return Axis(name, ranks, ranks.index(dist.get_rank()), group)


def hybrid_axes(process_group, replicate_group) -> tuple[Axis, Axis]:
    """Check that the shard and replicate groups form a grid through this rank, and
    return both as Axes (raw groups get the names ``dp_shard``, ``dp_replicate``).

    A collective over the replicate group: its ranks compare their places in their
    shard groups, since an all-reduce across ranks holding *different* slices would
    silently add unrelated gradients."""
    shard = _labelled(process_group, SHARD_AXIS)
    rep = _labelled(replicate_group, REPLICATE_AXIS)
    crossing = set(shard.ranks) & set(rep.ranks)
    mine = torch.tensor([shard.index, shard.size, len(crossing)], dtype=torch.int64)
    every = torch.empty(rep.size * 3, dtype=torch.int64)
    comm.all_gather(every, mine, rep, tag="zero/hsdp-check")
    places = every.view(rep.size, 3)
    if (places[:, 2] != 1).any():
        raise ValueError(
            f"the shard group {list(shard.ranks)} and the replicate group "
            f"{list(rep.ranks)} must have exactly one rank in common (a 2D mesh: "
            "shard along a row, replicate down a column); build them with "
            "dtlab.zero.hsdp_groups"
        )
    if (places[:, :2] != places[0, :2]).any():
        raise ValueError(
            f"the replicate group {list(rep.ranks)} joins ranks at different places "
            f"of their shard groups (index, size per rank: {places[:, :2].tolist()}):"
            " each must hold the same slice; build the groups with "
            "dtlab.zero.hsdp_groups"
        )
    return shard, rep


class Replicas:
    """The replicate side of HSDP: the ranks that hold this rank's slice. With
    ``group=None`` there is one replica (plain ZeRO) and every method does nothing.
    """

    def __init__(self, group: Axis | None = None):
        self.group = group
        self.size = 1 if group is None else comm.group_size(group)

    def all_reduce(self, t: torch.Tensor, tag: str):
        """Start summing ``t`` (a reduced gradient slice) over the replicas; the work
        handle, or ``None`` when there is nobody to add."""
        if self.size == 1:
            return None
        return comm.all_reduce(t, group=self.group, async_op=True, tag=tag)

    def broadcast(self, t: torch.Tensor, tag: str) -> None:
        """Replica 0's ``t`` on every replica (``sync_module_states``)."""
        if self.size > 1:
            comm.broadcast(t, 0, self.group, tag=tag)

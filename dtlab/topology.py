"""Layouts and topologies: which rank holds which slice of the job.

Taught in chapter 01 (ranks and groups) and chapter 07 (3D parallelism).

A *layout* is the shape of the job: ``Layout(dp=2, tp=2, pp=1)`` asks for two
data-parallel replicas, each split over two tensor-parallel ranks, in one pipeline
stage. Two more axes go beyond 3D (chapter 11): ``cp``, context parallelism, splits
every sequence over cp ranks; ``ep``, expert parallelism, spreads a mixture of
experts over ep ranks carved out of the ``dp·cp`` ranks that replicate the rest of
the model (ep adds no ranks). The world size is ``dp * cp * tp * pp``.

Rank order follows Megatron-LM: **tp varies fastest, then cp, then dp, then pp**::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

so the ranks of one tensor-parallel group are neighbours (on a real machine: the GPUs
of one node, joined by NVLink); the context-parallel ranks come next, because ring
attention passes K/V every layer and wants the next-fastest links; the pipeline stages
are the slowest-varying coordinate (on a real cluster: different nodes). Expert
parallelism is folded into ``dp·cp`` (``ep`` consecutive replicas hold one set of
experts between them), as torchtitan and Megatron-Core fold it. This is the one place
that order is written down; everything else asks a ``Layout`` or a ``Topology``.

Axes: the coordinates ``pp``, ``dp``, ``cp``, ``tp``; and three derived groups:
``dp_cp`` (every replica of the dense weights: what DDP and ZeRO reduce over when
cp > 1), ``ep`` (the ranks that split one MoE layer's experts) and ``edp`` (the ranks
that hold the same experts: what the experts' gradients are reduced over).

A ``Topology`` is a layout bound to one rank of a live ``torch.distributed`` world:
it creates one process group per axis slice, in the same order on every rank (creating
groups is itself a collective call, so the order must match), and hands them out by
axis name. There is no global state: two topologies can live in one process.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

from dtlab.checks import divisors, positive_int

AXES = ("pp", "dp", "cp", "tp")  # the coordinates, slowest -> fastest varying
DERIVED = ("dp_cp", "ep", "edp")  # groups made of the coordinates' ranks


@dataclass(frozen=True)
class Layout:
    """The degree of each kind of parallelism. ``world_size = dp * cp * tp * pp``;
    ``ep`` divides ``dp * cp``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep"):
            positive_int(axis, getattr(self, axis))
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp*cp={self.dp * self.cp}: expert "
                "parallelism places the experts on the data-parallel ranks; pick ep "
                f"from {divisors(self.dp * self.cp)}"
            )

    # ---- sizes ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def size(self, axis: str) -> int:
        _check_axis(axis)
        if axis == "dp_cp":
            return self.dp * self.cp
        if axis == "edp":
            return self.dp * self.cp // self.ep
        return getattr(self, axis)

    # ---- rank <-> coordinates ---------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """``{'pp': i, 'dp': j, 'cp': c, 'tp': k}`` of a global rank."""
        self._check_rank(rank)
        tp_index = rank % self.tp
        cp_index = (rank // self.tp) % self.cp
        dp_index = (rank // (self.tp * self.cp)) % self.dp
        pp_index = rank // (self.tp * self.cp * self.dp)
        return {"pp": pp_index, "dp": dp_index, "cp": cp_index, "tp": tp_index}

    def rank(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """The global rank at these coordinates (inverse of :meth:`coords`)."""
        for axis, value in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not 0 <= value < self.size(axis):
                raise ValueError(
                    f"{axis} coordinate {value} is outside 0..{self.size(axis) - 1}"
                )
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the rank lists that differ only in that
        coordinate (for a derived axis: in their dp·cp position), in a fixed order
        (the order groups are created on every rank)."""
        _check_axis(axis)
        if axis in AXES:
            others = [a for a in AXES if a != axis]
            out = []
            for fixed in itertools.product(*(range(self.size(a)) for a in others)):
                where = dict(zip(others, fixed))
                out.append(
                    [self.rank(**where, **{axis: i}) for i in range(self.size(axis))]
                )
            return out
        out = []
        for pp, tp in itertools.product(range(self.pp), range(self.tp)):
            # the dp·cp replicas of one (pp, tp) slice, in dp-major order
            replicas = [
                self.rank(pp=pp, dp=d, cp=c, tp=tp)
                for d, c in itertools.product(range(self.dp), range(self.cp))
            ]
            if axis == "dp_cp":
                out.append(replicas)
            elif axis == "ep":  # consecutive blocks share one set of experts
                out += [
                    replicas[i : i + self.ep] for i in range(0, len(replicas), self.ep)
                ]
            else:  # edp: the same place in every block holds the same experts
                out += [replicas[j :: self.ep] for j in range(self.ep)]
        return out

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``axis``."""
        for ranks in self.groups(axis):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is in no {axis} group")

    # ---- validation against a world and a model ---------------------------------
    def validate(
        self,
        world_size: int | None = None,
        *,
        n_layers: int | None = None,
        n_heads: int | None = None,
        microbatches: int | None = None,
        schedule: str | None = None,
        chunks: int = 1,
    ) -> Layout:
        """Raise ``ValueError`` naming the factor that does not fit; return self.

        - the product must equal ``world_size`` when one is given;
        - tensor parallelism splits attention heads: ``n_heads % tp == 0``;
        - pipeline parallelism splits layers: ``n_layers % (pp * chunks) == 0``;
        - 1F1B-style schedules need at least ``pp`` microbatches to fill the pipe
          (GPipe runs with fewer, just with a larger bubble).
        """
        if world_size is not None:
            positive_int("world_size", world_size)
            if self.world_size != world_size:
                cp = f" x cp={self.cp}" if self.cp > 1 else ""
                raise ValueError(
                    f"layout dp={self.dp} x tp={self.tp} x pp={self.pp}{cp} = "
                    f"{self.world_size} ranks, but the world has {world_size}: "
                    "make the product of dp, tp, pp (and cp) equal the world size"
                )
        if n_heads is not None and n_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide n_heads={n_heads}: tensor parallelism "
                "gives each rank whole attention heads; pick tp from "
                f"{divisors(n_heads)}"
            )
        positive_int("chunks", chunks)
        if n_layers is not None and n_layers % (self.pp * chunks):
            what = f"pp={self.pp}" + (f" x chunks={chunks}" if chunks > 1 else "")
            per = "pp x chunks" if chunks > 1 else "pp"
            raise ValueError(
                f"{what} does not divide n_layers={n_layers}: each pipeline stage "
                f"must hold the same number of layers; pick {per} from "
                f"{divisors(n_layers)}"
            )
        if microbatches is not None:
            positive_int("microbatches", microbatches)
            if schedule and schedule.lower() != "gpipe" and microbatches < self.pp:
                raise ValueError(
                    f"schedule {schedule!r} needs microbatches >= pp ({self.pp}), got "
                    f"{microbatches}: use more microbatches or GPipe"
                )
        return self

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside 0..{self.world_size - 1}")

    def __str__(self) -> str:
        beyond = "".join(
            f"·{a}{getattr(self, a)}" for a in ("cp", "ep") if getattr(self, a) > 1
        )
        return f"dp{self.dp}·tp{self.tp}·pp{self.pp}{beyond}"


def _check_axis(axis: str) -> None:
    if axis not in AXES and axis not in DERIVED:
        raise ValueError(f"unknown axis {axis!r}: expected one of {AXES + DERIVED}")


def factorisations(world_size: int, *, beyond_3d: bool = False) -> list[Layout]:
    """Every ``Layout`` whose ranks multiply to ``world_size``, ordered by tp, then
    pp (then cp, then ep): dp × tp × pp, and with ``beyond_3d`` every cp that
    divides what is left and every ep that divides dp·cp (chapter 11)."""
    positive_int("world_size", world_size)
    out = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            rest = world_size // (tp * pp)
            for cp in divisors(rest) if beyond_3d else [1]:
                dp = rest // cp
                for ep in divisors(dp * cp) if beyond_3d else [1]:
                    out.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep))
    return out


def layouts_for(world_size: int, **model) -> list[Layout]:
    """Every ``Layout`` with this world size that passes :meth:`Layout.validate`
    for the given model facts (``n_layers``, ``n_heads``, ...)."""
    positive_int("world_size", world_size)
    out = []
    for tp in divisors(world_size):
        for pp in divisors(world_size // tp):
            layout = Layout(dp=world_size // (tp * pp), tp=tp, pp=pp)
            try:
                layout.validate(world_size, **model)
            except ValueError:
                continue
            out.append(layout)
    return out


def padded_vocab(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """Vocabulary size rounded up so every tp rank holds the same number of rows."""
    positive_int("vocab_size", vocab_size)
    step = tp * multiple
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class Axis:
    """One axis of a topology as seen from one rank: its process group, the global
    ranks in it, and this rank's index along it."""

    name: str
    ranks: tuple[int, ...]
    index: int
    group: object = field(default=None, compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)


_LIVE: weakref.WeakSet = weakref.WeakSet()  # topologies holding process groups


def release_groups() -> None:
    """Make every topology in this process drop its process groups (called when the
    world is torn down: a group object that is still referenced keeps its sockets
    open). Their axes keep ranks and indices; ``group`` becomes ``None``."""
    for topo in list(_LIVE):
        topo._axes = {
            name: Axis(a.name, a.ranks, a.index, None) for name, a in topo._axes.items()
        }
        topo.released = True
    _LIVE.clear()


class Topology:
    """A layout bound to one rank, with a process group per axis.

    ``Topology(layout, rank)`` with ``torch.distributed`` initialised creates every
    group of every axis (all ranks must construct it together). Without an
    initialised default group it only does rank arithmetic, which is what a
    one-rank layout needs: ``Topology(Layout(), 0)`` just works.
    """

    def __init__(self, layout: Layout, rank: int | None = None, *, backend=None):
        import torch.distributed as dist

        self.layout = layout
        live = dist.is_available() and dist.is_initialized()
        if rank is None:
            if not live:
                raise ValueError("rank is required when torch.distributed is not up")
            rank = dist.get_rank()
        if live and dist.get_world_size() != layout.world_size:
            layout.validate(dist.get_world_size())
        layout._check_rank(rank)
        self.rank = rank
        self.coords = layout.coords(rank)
        self._axes: dict[str, Axis] = {}
        self.released = False
        made: dict[tuple[int, ...], object] = {}  # one group per set of ranks
        for axis in AXES + DERIVED:
            mine = None
            for ranks in layout.groups(axis):
                key = tuple(ranks)
                if key not in made:
                    # new_group is collective over the whole world: every rank
                    # creates every group, in the same order, even the ones it is
                    # not in (an axis whose groups another axis has reuses them)
                    made[key] = dist.new_group(ranks, backend=backend) if live else None
                if rank in ranks:
                    mine = Axis(axis, key, ranks.index(rank), made[key])
            self._axes[axis] = mine
        if live:
            _LIVE.add(self)

    def axis(self, name: str) -> Axis:
        _check_axis(name)
        return self._axes[name]

    def replicas(self) -> Axis:
        """The ranks that hold the same dense weights: dp, or dp·cp with context
        parallelism (its ranks split sequences, not weights)."""
        return self.axis("dp_cp" if self.layout.cp > 1 else "dp")

    def group(self, name: str):
        if self.released:
            raise RuntimeError(
                "this topology's process groups were torn down (an error on some "
                "rank, or a reset): build a new Topology on the new world"
            )
        return self.axis(name).group

    def size(self, name: str) -> int:
        return self.layout.size(name)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def __repr__(self) -> str:
        c = self.coords
        where = " ".join(f"{a}={c[a]}" for a in AXES)
        return f"Topology({self.layout}, rank={self.rank}: {where})"

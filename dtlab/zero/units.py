"""The layout ZeRO shards: units, their flat buffers, a rank's slice, local shards.

Taught in chapter 03. A *unit* is a module whose parameters are gathered, reduced and
freed together: each block of a GPT, and the root (whatever no block owns: the
embeddings, the final norm, the head). Its parameters are flattened in
``named_parameters`` order into one buffer and padded with zeros to a multiple of N
(FSDP1's ``FlatParameter``, Zhao et al. 2023, "PyTorch FSDP", §3.2)::

    flat = [ p0 (k0 elements) | p1 (k1) | ... | padding ]     N·S elements
    rank r owns the slice [r·S, (r+1)·S)                       (stage 0: all of it)

The layout of the parameters inside ``flat`` does not depend on N, only the padding
does: that is what lets :mod:`dtlab.checkpoint` re-cut slices for another world size.

Where a parameter meets a rank's slice, the rank holds a :class:`LocalShard` of it:
elements ``[start, stop)`` of the flattened parameter, a *view* of the rank's fp32
master slice. The optimizer steps the local shards, one tensor per parameter piece,
as FSDP2's per-parameter sharding (and FSDP1's ``use_orig_params=True``) gives:

- element-wise optimizers (SGD, Adam, AdamW, ...) compute on a piece exactly what
  they compute on the whole parameter, bit for bit;
- a piece whose parameter got no gradient (frozen, or unused this step) keeps
  ``.grad = None``, so torch's optimizers skip it: it does not move under weight
  decay or momentum, and its state (Adam's moments and step count) does not advance;
- the collectives still move one flat buffer per unit, so the traffic is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dtlab import comm

__all__ = [
    "LocalShard",
    "FlatUnit",
    "InFlight",
    "padded",
    "make_units",
    "split_replicated",
]


def padded(numel: int, n: int) -> int:
    """``numel`` rounded up to a multiple of ``n`` (at most n-1 zeros of padding)."""
    return math.ceil(numel / n) * n


class InFlight:
    """The communication buffers alive right now (gather sources, gradient buckets
    and reduced slices), which :mod:`dtlab.memory` counts as ``buffers``."""

    def __init__(self):
        self.live: dict[int, torch.Tensor] = {}

    def add(self, t: torch.Tensor) -> torch.Tensor:
        self.live[id(t)] = t
        return t

    def drop(self, t: torch.Tensor | None) -> None:
        if t is not None:
            self.live.pop(id(t), None)


@dataclass(frozen=True)
class LocalShard:
    """This rank's piece of one parameter: ``tensor`` is elements ``[start, stop)``
    of ``param.view(-1)`` (FSDP2's local shard), a view of the fp32 master slice. It
    is what the optimizer steps; ``param`` is the module's own parameter, the one
    forward and backward compute with. At stage 0 the piece is the whole parameter,
    in its shape; otherwise it is 1-D, and empty where the slice misses it."""

    name: str
    param: nn.Parameter
    tensor: nn.Parameter
    start: int
    stop: int


@dataclass
class Entry:
    """A parameter inside its unit's flat buffer: ``flat[offset : offset + numel]``;
    ``places`` are the ``(module, attribute)`` pairs that hold it (two for a tied
    embedding and head)."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    places: list = field(default_factory=list)
    shard: LocalShard | None = None


class FlatUnit:
    """One unit: its parameters flattened, this rank's slice of them, its local
    shards, and where it stands within a step (gathered, gradients counted,
    reduced)."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        entries: list[Entry],
        replicated: bool = False,
    ):
        self.name = name
        self.module = module
        self.entries = entries
        # replicated: every rank holds and steps all of it, its gradient is
        # all-reduced (stage 0 for this unit, whatever the wrapper's stage)
        self.replicated = replicated
        self.sharding = None  # this unit's Sharding, set by its wrapper
        self.numel = sum(e.numel for e in entries)
        self.n_grads = sum(e.param.requires_grad for e in entries)
        self.padded = self.S = self.lo = 0
        self.full: torch.Tensor | None = None  # compute dtype, padded: module views
        self.master: torch.Tensor | None = None  # this rank's fp32 slice (S,)
        self.lowp: torch.Tensor | None = None  # stage 3: the slice cast, to gather
        self.alias = False  # master is a view of full (fp32 on device, stages 0-2)
        # within a step
        self.handle = None  # the all-gather in flight: (work, source)
        self.gathered = True
        self.ready = 0  # gradients accumulated in this backward
        self.reduced = False
        self.flat_grad: torch.Tensor | None = None  # stages 0-1: the kept bucket

    @torch.no_grad()
    def materialise(
        self, sharding, placement, compute_dtype, group, sync: bool, replicas
    ):
        """Flatten the parameters (the module's ``p.data`` become views of
        :attr:`full`), cut this rank's master slice and its local shards. ``sync``:
        rank 0's weights first, over ``group`` and then over ``replicas`` (HSDP's
        other replicas, :class:`~dtlab.zero.hsdp.Replicas`)."""
        if not self.entries:
            return
        dtypes = {e.param.dtype for e in self.entries}
        if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"unit {self.name!r} has parameters of dtypes {dtypes}: one floating "
                "dtype per unit (cast the module first)"
            )
        master_dtype = next(iter(dtypes))
        cdtype = compute_dtype or master_dtype
        n, rank = comm.group_size(group), comm.group_rank(group)
        n_shards = sharding.n_shards(n)
        # padding to a multiple of N even at stage 0 keeps the all-reduce's chunks
        # where the reduce-scatter's slices are: stages then sum in the same order
        self.padded = padded(self.numel, n)
        self.S = self.padded // n_shards
        self.lo = rank * self.S if n_shards > 1 else 0
        master_full = torch.zeros(
            self.padded, dtype=master_dtype, device=placement.device
        )
        for e in self.entries:
            master_full[e.offset : e.offset + e.numel].copy_(e.param.reshape(-1))
        if sync:
            comm.broadcast(master_full, 0, group, tag="zero/sync")
            replicas.broadcast(master_full, tag="zero/sync")
        self.alias = (
            cdtype == master_dtype
            and not placement.offload
            and not sharding.shards_params
        )
        self.full = master_full if cdtype == master_dtype else master_full.to(cdtype)
        for e in self.entries:  # the module computes on these views
            e.param.data = self.full[e.offset : e.offset + e.numel].view_as(e.param)
        mine = master_full[self.lo : self.lo + self.S]
        self.master = mine if self.alias else placement.master_copy(mine)
        if sharding.shards_params:
            if cdtype != master_dtype or placement.offload:
                # the compute-dtype slice that is gathered (2Ψ/N under bf16)
                self.lowp = torch.empty(self.S, dtype=cdtype, device=placement.device)
            self.free()
        for e in self.entries:
            e.shard = self._local_shard(e, whole=not sharding.shards_optimizer)

    def _local_shard(self, e: Entry, whole: bool) -> LocalShard:
        a = max(self.lo, e.offset)
        b = min(self.lo + self.S, e.offset + e.numel)
        if a >= b:  # the slice misses this parameter: an empty piece
            a = b = e.offset
            view = self.master[:0]
        else:
            view = self.master[a - self.lo : b - self.lo]
        if whole:  # stage 0: nothing is cut, the piece is the parameter
            view = view.view(e.param.shape)
        tensor = nn.Parameter(view, requires_grad=e.param.requires_grad)
        return LocalShard(e.name, e.param, tensor, a - e.offset, b - e.offset)

    def grad_view(self, grad: torch.Tensor, e: Entry) -> torch.Tensor:
        """The part of a reduced gradient slice ``grad`` (S,) that belongs to ``e``'s
        local shard, in the shard's shape: a view, no copy."""
        a = e.offset + e.shard.start - self.lo
        return grad[a : a + e.shard.tensor.numel()].view_as(e.shard.tensor)

    def free(self) -> None:
        """Drop the full weights' bytes. The parameters keep their shapes and views
        (FSDP's trick): tensors autograd saved point at this storage and see the
        bytes come back with the next gather."""
        if self.full is None:  # a unit without parameters (a pipeline stage's root)
            return
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def show(self, local: bool) -> None:
        """Put the local shards (``local=True``) or the compute parameters back into
        the module's attributes. Swapping the attribute, never ``.data``, leaves any
        pending backward untouched: autograd saved the compute parameter itself."""
        for e in self.entries:
            value = e.shard.tensor if local else e.param
            for module, attr in e.places:
                setattr(module, attr, value)


def make_units(module: nn.Module, units) -> list[FlatUnit]:
    """The units of ``module``, root first: ``units`` is None (every element of every
    ``nn.ModuleList``: a GPT's blocks), a module class or tuple of classes, or a list
    of submodules. A parameter belongs to the innermost unit that contains it."""
    if units is None:
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
        picked = [block for lst in lists for block in lst]
    elif isinstance(units, type) or (
        isinstance(units, tuple) and all(isinstance(t, type) for t in units)
    ):
        picked = [
            m for m in module.modules() if isinstance(m, units) and m is not module
        ]
    else:
        picked = list(units)
        for m in picked:
            if not isinstance(m, nn.Module) or m is module:
                raise ValueError(
                    "units must be None, module classes, or submodules of the "
                    f"wrapped module (not the module itself); got {m!r}"
                )
    names = {m: n for n, m in module.named_modules()}
    for m in picked:
        if m not in names:
            raise ValueError(f"unit {type(m).__name__} is not inside the module")
    prefixes = sorted(((names[m], m) for m in picked), key=lambda x: -len(x[0]))

    def owner(qualname):
        for prefix, m in prefixes:
            if qualname.startswith(prefix + "."):
                return m
        return module

    places: dict[int, list] = {}  # every attribute that holds each parameter
    for sub in module.modules():
        for attr, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            places.setdefault(id(p), []).append((sub, attr))
    members: dict[nn.Module, list[Entry]] = {m: [] for m in [module, *picked]}
    seen: dict[int, nn.Module] = {}
    offsets: dict[nn.Module, int] = {}
    for qualname, p in module.named_parameters(remove_duplicate=False):
        m = owner(qualname)
        if id(p) in seen:
            if seen[id(p)] is not m:
                raise ValueError(
                    f"parameter {qualname} is shared by two units: tied weights "
                    "must live in one unit (leave them to the root)"
                )
            continue  # a tied weight: flattened once, under its first name
        seen[id(p)] = m
        off = offsets.get(m, 0)
        members[m].append(Entry(qualname, p, off, p.numel(), places[id(p)]))
        offsets[m] = off + p.numel()
    position = {m: i for i, m in enumerate(names)}  # named_modules order
    ordered = [module] + sorted(picked, key=position.__getitem__)
    return [
        FlatUnit(names[m] or "root", m, members[m])
        for m in ordered
        if members[m] or m is module
    ]


def split_replicated(units: list[FlatUnit], replicate) -> list[FlatUnit]:
    """Move the parameters ``replicate`` picks out of each unit into a replicated
    unit of their own, next to it (a unit they fill entirely becomes replicated
    itself). ``replicate``: None (nothing), a module class or tuple of classes (the
    parameters such modules hold themselves), or ``fn(name, param) -> bool``."""
    if replicate is None:
        return units
    if isinstance(replicate, type) or (
        isinstance(replicate, tuple) and all(isinstance(t, type) for t in replicate)
    ):
        classes = replicate

        def picked(e: Entry) -> bool:
            return any(isinstance(m, classes) for m, _ in e.places)

    elif callable(replicate):

        def picked(e: Entry) -> bool:
            return bool(replicate(e.name, e.param))

    else:
        raise ValueError(
            "replicate must be None, a module class or tuple of classes, or a "
            f"function (name, param) -> bool; got {replicate!r}"
        )
    out = []
    for u in units:
        rep = [e for e in u.entries if picked(e)]
        keep = [e for e in u.entries if not picked(e)]
        if not rep:
            out.append(u)
        elif not keep:
            out.append(FlatUnit(u.name, u.module, u.entries, replicated=True))
        else:
            out.append(FlatUnit(u.name, u.module, _packed(keep)))
            name = f"{u.name}(replicated)"
            out.append(FlatUnit(name, u.module, _packed(rep), replicated=True))
    return out


def _packed(entries: list[Entry]) -> list[Entry]:
    """The same parameters laid out back to back from offset 0."""
    out, off = [], 0
    for e in entries:
        out.append(Entry(e.name, e.param, off, e.numel, e.places))
        off += e.numel
    return out

"""What a ZeRO-wrapped module holds, and what its users see of it.

Taught in chapter 03. :class:`ShardedState` builds the units (:mod:`.units`) of a
module for one stage (:mod:`.stages`) and placement (:mod:`.offload`), and offers
what does not depend on *when* things move: the local shards as parameters (what an
optimizer steps), the whole weights gathered back, the global gradient norm, the
bytes by category. :class:`~dtlab.zero.fsdp.FullyShardedDataParallel` adds the hooks
that move the weights and gradients through a step.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import comm
from dtlab.zero.gather import Gatherer
from dtlab.zero.hsdp import Replicas, hybrid_axes
from dtlab.zero.offload import Placement
from dtlab.zero.stages import Sharding
from dtlab.zero.units import InFlight, LocalShard, make_units, split_replicated

__all__ = ["ShardedState"]


class ShardedState(nn.Module):
    """``module``'s parameters flattened into units and cut for ``stage`` over
    ``process_group`` (see :class:`~dtlab.zero.fsdp.FullyShardedDataParallel`)."""

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None,
        process_group,
        stage: int,
        units,
        offload: bool,
        sync_module_states: bool,
        replicate_group=None,
        replicate=None,
    ):
        super().__init__()
        self.sharding = Sharding(stage)
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"module must be an nn.Module, got {type(module).__name__}"
            )
        if compute_dtype is not None and not (
            isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"compute_dtype must be a floating torch.dtype (torch.bfloat16, "
                f"torch.float16) or None, got {compute_dtype!r}"
            )
        params = list(module.parameters())
        if not params:
            raise ValueError("the module has no parameters: nothing to shard")
        if len({p.device for p in params}) > 1:
            raise ValueError("all parameters must be on one device; move the module")
        if replicate_group is not None:  # HSDP: shard in a row, replicate down
            process_group, replicate_group = hybrid_axes(process_group, replicate_group)
        # the ranks holding the same slice as this one (one replica: plain ZeRO)
        self.replicas = Replicas(replicate_group)
        self.module = module
        self.stage = stage
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.world_size = comm.group_size(process_group)
        self.rank = comm.group_rank(process_group)
        self.compute_dtype = compute_dtype
        self.offload = bool(offload)
        self.device = params[0].device
        self.placement = Placement(self.device, self.offload)
        self._units = split_replicated(make_units(module, units), replicate)
        for u in self._units:
            u.sharding = Sharding(0) if u.replicated else self.sharding
            u.materialise(
                u.sharding,
                self.placement,
                compute_dtype,
                process_group,
                sync_module_states,
                self.replicas,
            )
        self._in_flight = InFlight()
        self._dirty = False  # an optimizer stepped the shards since the last gather
        self._gather = Gatherer(self.placement, process_group, self._in_flight)
        shards = [e.shard for u in self._units for e in u.entries]
        self._shards = [s for s in shards if s.tensor.numel()]  # what optimizers step
        self._empty = [s for s in shards if not s.tensor.numel()]  # only shown

    def _forget_empty_grads(self) -> None:
        # an empty piece holds a gradient only to be shown; after a step it is stale
        for s in self._empty:
            s.tensor.grad = None

    def _show(self, local: bool) -> None:
        for u in self._units:
            u.show(local)

    # ---- what users see -------------------------------------------------------
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """This rank's local shards, named as the module names their parameters
        (a tied weight once, under its first name)."""
        for s in self._shards:
            yield prefix + ("." if prefix else "") + s.name, s.tensor

    def local_shards(self) -> list[LocalShard]:
        """The pieces this rank holds, in :meth:`parameters` order: each
        :class:`~dtlab.zero.units.LocalShard` names its parameter, the module's own
        parameter object, the shard the optimizer steps and its ``[start, stop)``
        within the flattened parameter. What composed layouts need to weigh each
        gradient in a norm or to sum a tied embedding across pipeline stages."""
        return list(self._shards)

    def compute_parameters(self) -> dict[str, nn.Parameter]:
        """``{name: parameter}`` of the module's own parameters, the ones forward
        and backward compute with (between backward and the next forward the module
        shows its local shards instead)."""
        return {e.name: e.param for u in self._units for e in u.entries}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients; the module shows its compute parameters
        again."""
        self._show(local=False)
        for u in self._units:
            for e in u.entries:
                grad = e.shard.tensor.grad
                if grad is None:
                    continue
                if set_to_none:
                    e.shard.tensor.grad = None
                else:
                    grad.zero_()

    def sync_params(self, wait: bool = False) -> None:
        """All-gather the updated slices into the full weights now (stages 0-2 and
        replicated units do it by themselves at the next forward after an optimizer
        step; stage 3 gathers from the slices before every use anyway). The gathers
        are in flight on return, each unit's forward waiting for its own; ``wait``:
        until all of them have landed."""
        self._dirty = False
        units = self._kept_whole()
        self._gather.refresh(units)
        for u in units if wait else ():
            self._gather.wait(u)

    def _kept_whole(self) -> list:
        """The units whose full weights live between steps: all of them below stage
        3, and replicated units at every stage."""
        return [u for u in self._units if not u.sharding.shards_params]

    @property
    def units(self) -> list[dict]:
        """Each unit's name, parameter count, padded size and slice ``[lo, lo+S)``
        (a replicated unit: all of it), whether it is replicated, and its parameters
        ``(name, shape, offset)`` in the flat layout."""
        return [
            dict(
                name=u.name,
                numel=u.numel,
                padded=u.padded,
                lo=u.lo,
                S=u.S,
                replicated=u.replicated,
                params=[(e.name, tuple(e.param.shape), e.offset) for e in u.entries],
            )
            for u in self._units
        ]

    @property
    def n_shards(self) -> int:
        """How many ranks the master weights are cut over: N, or 1 at stage 0."""
        return self.sharding.n_shards(self.world_size)

    @property
    def n_replicas(self) -> int:
        """HSDP's R: how many ranks hold this rank's slice (1 without
        ``replicate_group``). The data-parallel degree is ``world_size · R``."""
        return self.replicas.size

    @property
    def replica_rank(self) -> int:
        """Which of the R replicas this rank belongs to (0 without HSDP): one replica
        is the whole sharded state, so a writer of checkpoints needs only replica 0."""
        return (
            0 if self.replicas.group is None else comm.group_rank(self.replicas.group)
        )

    @property
    def padded_numel(self) -> int:
        """Ψ as the shards see it: every unit padded to a multiple of N."""
        return sum(u.padded for u in self._units)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self._units)

    def state_dict(self, *args, **kwargs):
        """This rank's shards only (a whole-model state dict is
        :meth:`gather_full_params`; checkpoints: :mod:`dtlab.checkpoint`)."""
        return {n: p.detach() for n, p in self.named_parameters()}

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """``{name: full tensor}`` from the master slices, as the unwrapped module
        would name them (tied weights once). A collective: every rank calls it."""
        out = {}
        for u in self._units:
            if u.master is None:
                continue
            if u.replicated:  # every rank holds all of it
                full = u.master.detach().cpu()
            else:
                full = self.gather_slices(u.master)
            for e in u.entries:
                flat = full[e.offset : e.offset + e.numel]
                out[e.name] = flat.view_as(e.param).clone()
        return out

    @torch.no_grad()
    def gather_slices(self, mine: torch.Tensor) -> torch.Tensor:
        """The whole flat tensor, on the CPU, of which ``mine`` is this rank's slice
        (a unit's master, or per-element state laid out like it), all-gathered from
        every rank's. A collective."""
        src = mine.detach().to(self.device)  # nccl gathers device tensors
        if self.n_shards == 1:
            return src.cpu()
        full = torch.empty(
            src.numel() * self.n_shards, dtype=src.dtype, device=src.device
        )
        # a local shard's piece of one parameter (not a slice) differs in size from
        # rank to rank, which gloo would not notice: the sizes are checked first
        comm.all_gather(
            full, src, self.process_group, tag="zero/gather-full", check_sizes=True
        )
        return full.cpu()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None = None) -> torch.Tensor:
        """The global L2 norm of the gradient, from the shards: each rank sums the
        squares of its pieces, one all-reduce adds them. With ``max_norm``, scales
        every shard's gradient by ``min(1, max_norm/norm)`` as
        ``torch.nn.utils.clip_grad_norm_`` does. A collective."""
        replicated = {
            id(e.shard.tensor) for u in self._units if u.replicated for e in u.entries
        }
        sq = torch.zeros((), dtype=torch.float64)
        sq_replicated = torch.zeros((), dtype=torch.float64)  # the same on each rank
        grads = []
        for p in self.parameters():
            if p.grad is not None:
                grads.append(p.grad)
                part = sq_replicated if id(p) in replicated else sq
                part += p.grad.detach().double().pow(2).sum().cpu()
        if self.n_shards > 1:
            sq = sq.to(self.device)
            comm.all_reduce(sq, group=self.process_group, tag="zero/grad-norm")
        norm = (sq.cpu() + sq_replicated).sqrt().float()
        if max_norm is not None:
            if max_norm <= 0:
                raise ValueError(f"max_norm must be positive, got {max_norm}")
            scale = min(1.0, max_norm / (float(norm) + 1e-6))
            for g in grads:
                g.mul_(scale)
        return norm

    # ---- memory accounting (dtlab.memory) --------------------------------------
    def memory_tensors(self, optimizer=None):
        """``(category, tensor)`` pairs of what this rank holds, for
        :class:`dtlab.memory.MemoryTracker` (each storage counts once, under its
        first category). A master copy that differs from the weights the model
        computes with counts as optimizer state (the ZeRO paper's K includes it);
        ``host_`` marks what offload keeps on the CPU."""
        place = self.placement
        for u in self._units:
            if u.full is not None:
                yield "params", u.full
            if u.lowp is not None:
                yield "params", u.lowp
            if u.master is None:
                continue
            copy = not u.alias and (place.offload or u.master.dtype != u.full.dtype)
            yield (place.category("optimizer") if copy else "params"), u.master
            if u.flat_grad is not None:
                yield "grads", u.flat_grad
            for e in u.entries:
                if e.param.grad is not None:  # before its reduction
                    yield "grads", e.param.grad
            for e in u.entries:
                if e.shard.tensor.grad is not None:
                    yield place.category("grads"), e.shard.tensor.grad
            if optimizer is not None:
                for e in u.entries:
                    for v in optimizer.state.get(e.shard.tensor, {}).values():
                        if torch.is_tensor(v):
                            yield place.category("optimizer"), v
        for t in list(self._in_flight.live.values()):
            yield "buffers", t

"""Where gradients go after backward: ZeRO's all-reduce and reduce-scatter.

Taught in chapter 03. Rajbhandari et al. 2020, §5.2 and §7. When a unit's gradients
are complete (every trainable parameter's post-accumulate hook fired, or backward
ended), :meth:`Reducer.bucket` copies them into one flat buffer in the unit's layout
and :meth:`Reducer.launch` starts its reduction while backward goes on:

- stage 0 all-reduces the bucket: every rank gets the whole sum (DDP's 2Ψ);
- stages 1-3 reduce-scatter it: rank r receives the sum of its own slice
  ``[r·S, (r+1)·S)`` only, Ψ of traffic (P_os+g, §5.2: *this* is ZeRO-2's
  reduce-scatter; stage 1 uses it too, since it steps only its slice).

Stages 0-1 keep the bucket until the optimizer step (``keeps_full_grads``): the
compute parameters' ``.grad`` are views of it, and under ``no_sync`` later backward
passes add into it without communicating. Stages 2-3 free it as soon as its
reduce-scatter is done: the full gradient of a unit never outlives its reduction,
which is the memory ZeRO-2 saves.

:meth:`Reducer.launch` divides each bucket by N before its sum (by a power of two
exactly, barring subnormals: ``a/2 + b/2`` has the bits of DDP's, which divides the
same way). :meth:`Reducer.finish` moves the averaged slice where the master lives
(:mod:`~dtlab.zero.offload`) and hands each local shard its part
as ``.grad``: views of the one averaged slice, no copy, added to what an earlier
backward of the same step left. A parameter that got no gradient in this backward
is skipped, so a frozen or unused one keeps ``.grad = None``. That is decided on each
rank, as FSDP does, so it assumes every rank takes the same branches: the ranks that
did not use a parameter others used drop its averaged gradient.

HSDP (:mod:`~dtlab.zero.hsdp`) adds a second hop: once the shard group's
reduce-scatter (stage 0: all-reduce) has landed, the reduced slice is all-reduced
across the replicas that hold the same slice, ``2(R-1)/R · Ψ/S`` more per step, and
the sum is divided by the data-parallel degree R·S. The replicas' all-reduces start
in the order the units were reduced, on every rank (a rank that started them in the
order its reduce-scatters finished could pair one unit's slice with another's).

At most ``max_inflight`` reductions are in flight; beyond that, backward waits for
the oldest (FSDP2 bounds its reduce-scatters the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtlab import comm, memory
from dtlab.zero.hsdp import Replicas

__all__ = ["Reducer", "Reduction"]


@dataclass
class Reduction:
    """One unit's gradients on their way: ``work`` is the collective in flight, over
    the shard group first (``across_replicas=False``), then over the replicas."""

    unit: object
    work: object
    flat: torch.Tensor  # the bucket: the unit's full gradient
    out: torch.Tensor  # what this rank keeps: its reduced slice (stage 0: flat)
    with_grad: list
    across_replicas: bool = False


class Reducer:
    """The gradient reductions of one wrapper's units over ``group`` (and, under
    HSDP, over ``replicas``); each unit's stage (``u.sharding``) says whether it is
    all-reduced (stage 0, or a replicated unit) or reduce-scattered."""

    def __init__(
        self,
        placement,
        group,
        in_flight,
        max_inflight: int = 2,
        replicas: Replicas | None = None,
    ):
        self.placement = placement
        self.group = group
        self.replicas = replicas or Replicas()
        # the average is over every data-parallel rank: S in the group, R replicas
        self.dp_degree = comm.group_size(group) * self.replicas.size
        self.in_flight = in_flight
        self.max_inflight = max_inflight
        self.pending: list[Reduction] = []  # oldest first

    @torch.no_grad()
    def bucket(self, u):
        """Copy ``u``'s gradients into its flat bucket (stages 0-1: the kept one, if
        an earlier backward of this step made it). Returns the bucket and the
        entries that have a gradient in it."""
        flat = u.flat_grad
        if flat is None:
            flat = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
        with_grad = []
        for e in u.entries:
            view = flat[e.offset : e.offset + e.numel].view_as(e.param)
            if e.param.grad is None:
                if u.flat_grad is not None:
                    view.zero_()  # a kept bucket whose .grad someone set to None
                continue
            with_grad.append(e)
            if e.param.grad.data_ptr() != view.data_ptr():
                view.copy_(e.param.grad)  # (autograd adds into a kept view in place)
            e.param.grad = view if u.sharding.keeps_full_grads else None
        if u.sharding.shards_grads:
            self.in_flight.add(flat)
        return flat, with_grad

    def launch(self, u, flat: torch.Tensor, with_grad) -> None:
        """Start reducing ``u``'s bucket ``flat``: divided by the number of replicas
        first, then summed (as DDP and PyTorch's reducer do: a sum of N 16-bit
        gradients can overflow where their mean does not; exact in fp32 when N is a
        power of two)."""
        with torch.no_grad():
            flat.mul_(1.0 / self.dp_degree)
        if not u.sharding.shards_optimizer:  # every rank steps everything
            work = comm.all_reduce(
                flat,
                group=self.group,
                async_op=True,
                tag=u.sharding.tag(f"ar/{u.name}"),
            )
            out = flat
        else:  # P_os+g: each rank receives the sum of its own slice only
            out = self.in_flight.add(
                torch.empty(u.S, dtype=flat.dtype, device=flat.device)
            )
            work = comm.reduce_scatter(
                out,
                flat,
                group=self.group,
                async_op=True,
                tag=u.sharding.tag(f"rs/{u.name}"),
            )
        self.pending.append(Reduction(u, work, flat, out, with_grad))
        memory.current().update()
        self.drain(block=False)
        while len(self.pending) >= self.max_inflight:
            # bound the buckets in flight: wait for the oldest
            self.complete(self.pending.pop(0))

    def _across_replicas(self, r: Reduction) -> None:
        """The shard group's reduction of ``r`` has landed: start its second hop,
        the all-reduce of the slice over the replicas (none without HSDP)."""
        r.work = self.replicas.all_reduce(
            r.out, tag=r.unit.sharding.tag(f"ar-replicas/{r.unit.name}")
        )
        r.across_replicas = True

    def complete(self, r: Reduction) -> None:
        """Wait for ``r``'s hops in turn, then finish it."""
        if not r.across_replicas:
            r.work.wait()
            self._across_replicas(r)
        if r.work is not None:
            r.work.wait()
        self.finish(r.unit, r.flat, r.out, r.with_grad)

    @torch.no_grad()
    def finish(self, u, flat, out, with_grad) -> None:
        """Give each local shard its part of the averaged gradient as ``.grad`` (the
        bucket was divided by the replicas before its sum)."""
        if u.alias and not u.sharding.shards_optimizer:  # stage 0, fp32
            grad = flat  # in place: the compute .grad views see it (as DDP)
        elif u.alias and u.sharding.keeps_full_grads:  # stage 1, fp32
            # the kept bucket's own slice becomes the averaged gradient
            grad = flat[u.lo : u.lo + u.S].copy_(out)
        else:
            grad = self.placement.master_gradient(out, u.master)
        if u.sharding.shards_optimizer:
            self.in_flight.drop(out)
        if u.sharding.shards_grads:
            self.in_flight.drop(flat)  # stage 2's promise: the full bucket is gone
        for e in with_grad:
            shard = e.shard.tensor
            if shard.numel() == 0:  # nothing of it here, but the module shows it
                if shard.grad is None:
                    shard.grad = torch.zeros_like(shard)
            elif shard.grad is None:
                shard.grad = u.grad_view(grad, e)
            else:  # gradient accumulation over several backward passes
                shard.grad.add_(u.grad_view(grad, e))

    def drain(self, block: bool) -> None:
        """Move on the reductions whose collective is done (``block``: all of them,
        to the end): a finished shard-group hop starts its replicas' hop, a finished
        last hop gives the shards their gradients."""
        if block:
            while self.pending:
                self.complete(self.pending.pop(0))
            return
        keep, blocked = [], False
        for r in self.pending:
            if not r.across_replicas and not blocked:
                if r.work.is_completed():
                    r.work.wait()
                    self._across_replicas(r)
                else:  # the replicas' hops start oldest first, on every rank alike
                    blocked = self.replicas.size > 1
            if r.across_replicas and (r.work is None or r.work.is_completed()):
                if r.work is not None:
                    r.work.wait()
                self.finish(r.unit, r.flat, r.out, r.with_grad)
            else:
                keep.append(r)
        self.pending = keep

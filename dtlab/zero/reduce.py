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

:meth:`Reducer.finish` divides the sum by N (by a power of two exactly, barring
subnormals: ``(a + b) / 2`` has the bits of DDP's ``a/2 + b/2``), moves it where
the master lives (:mod:`~dtlab.zero.offload`) and hands each local shard its part
as ``.grad``: views of the one averaged slice, no copy, added to what an earlier
backward of the same step left. A parameter that got no gradient in this backward
is skipped, so a frozen or unused one keeps ``.grad = None``. That is decided on each
rank, as FSDP does, so it assumes every rank takes the same branches: the ranks that
did not use a parameter others used drop its averaged gradient.

At most ``max_inflight`` reductions are in flight; beyond that, backward waits for
the oldest (FSDP2 bounds its reduce-scatters the same way).
"""

from __future__ import annotations

import torch

from dtlab import comm, memory

__all__ = ["Reducer"]


class Reducer:
    """The gradient reductions of one wrapper's units over ``group``."""

    def __init__(self, sharding, placement, group, in_flight, max_inflight: int = 2):
        self.sharding = sharding
        self.placement = placement
        self.group = group
        self.world_size = comm.group_size(group)
        self.in_flight = in_flight
        self.max_inflight = max_inflight
        self.pending: list[tuple] = []  # (unit, work, bucket, output, entries)

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
            e.param.grad = view if self.sharding.keeps_full_grads else None
        if self.sharding.shards_grads:
            self.in_flight.add(flat)
        return flat, with_grad

    def launch(self, u, flat: torch.Tensor, with_grad) -> None:
        """Start reducing ``u``'s bucket ``flat``."""
        if not self.sharding.shards_optimizer:  # every rank steps everything
            work = comm.all_reduce(
                flat,
                group=self.group,
                async_op=True,
                tag=self.sharding.tag(f"ar/{u.name}"),
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
                tag=self.sharding.tag(f"rs/{u.name}"),
            )
        self.pending.append((u, work, flat, out, with_grad))
        memory.current().update()
        self.drain(block=False)
        while len(self.pending) >= self.max_inflight:
            # bound the buckets in flight: wait for the oldest
            u0, work0, *rest = self.pending.pop(0)
            work0.wait()
            self.finish(u0, *rest)

    @torch.no_grad()
    def finish(self, u, flat, out, with_grad) -> None:
        """Average the reduced sum and give each local shard its part as ``.grad``."""
        n = self.world_size
        if u.alias and not self.sharding.shards_optimizer:  # stage 0, fp32
            grad = flat.div_(n)  # in place: the compute .grad views see it (as DDP)
        elif u.alias and self.sharding.keeps_full_grads:  # stage 1, fp32
            # the kept bucket's own slice becomes the averaged gradient
            grad = flat[u.lo : u.lo + u.S].copy_(out).div_(n)
        else:
            grad = self.placement.master_gradient(out, u.master).div_(n)
        if self.sharding.shards_optimizer:
            self.in_flight.drop(out)
        if self.sharding.shards_grads:
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
        """Finish the reductions that are done (``block``: all of them)."""
        keep = []
        for item in self.pending:
            u, work, *rest = item
            if block or work.is_completed():
                work.wait()
                self.finish(u, *rest)
            else:
                keep.append(item)
        self.pending = keep

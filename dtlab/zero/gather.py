"""How a unit's full weights come back from the slices: ZeRO's all-gathers.

Taught in chapter 03. Rajbhandari et al. 2020, §5.1 and §5.3:

- stages 0-2 keep the full weights. After an optimizer step each rank has updated
  only its slice, so the slices are all-gathered into every rank's full buffer once,
  before the next forward (:meth:`Gatherer.refresh`; P_os's Ψ of traffic). Stage 0
  owns the whole master, so it copies locally at most.
- stage 3 (P_os+g+p) keeps only the slice. A unit's weights are gathered just before
  its forward, freed after it, gathered again just before its backward and freed
  once its gradients are reduced (:meth:`Gatherer.start`, :meth:`Gatherer.wait`,
  :meth:`dtlab.zero.units.FlatUnit.free`): 2Ψ of gathers plus the gradients'
  reduce-scatter, 3Ψ a step. While one unit computes, the next one's gather is
  already on the wire (prefetch; Zhao et al. 2023, "PyTorch FSDP", §3.4).

Under a ``compute_dtype`` the weights travel cast (bf16: half the bytes), and a
unit's backward gathers the same cast slice as its forward: no step came between.
"""

from __future__ import annotations

from dtlab import comm, memory

__all__ = ["Gatherer"]


class Gatherer:
    """The all-gathers of one wrapper's units over ``group`` (asynchronous; a unit
    holds its work in flight in ``unit.handle`` until :meth:`wait`)."""

    def __init__(self, placement, group, in_flight):
        self.placement = placement
        self.group = group
        self.in_flight = in_flight

    def start(self, u, why: str) -> None:
        """Start gathering ``u``'s full weights (no-op if there or on the way);
        ``why`` is ``fwd``, ``bwd`` or ``step`` (after an optimizer step)."""
        if u.master is None or u.gathered or u.handle is not None:
            return
        if not u.sharding.shards_optimizer:  # every rank holds everything
            if not u.alias:  # bf16 weights or a host master: a local cast/copy
                u.full.copy_(u.master)
            u.gathered = True
            return
        if u.lowp is not None:
            if why != "bwd":  # backward reuses the forward's cast: no step between
                u.lowp.copy_(u.master)
            source = u.lowp
        elif u.sharding.shards_params:
            source = u.master  # fp32 on the device: the slice itself
        else:  # stages 1-2: full stays allocated, and the input must not alias it
            source = self.in_flight.add(
                self.placement.on_device(u.master, u.full.dtype)
            )
        nbytes = u.padded * u.full.element_size()
        if u.full.untyped_storage().nbytes() != nbytes:  # stage 3: freed, re-grown
            u.full.untyped_storage().resize_(nbytes)
        work = comm.all_gather(
            u.full,
            source,
            self.group,
            async_op=True,
            tag=u.sharding.tag(f"ag-{why}/{u.name}"),
        )
        u.handle = (work, source)
        memory.current().update()

    def wait(self, u) -> None:
        """Block until ``u``'s gather (if any) has landed."""
        if u.handle is None:
            return
        work, source = u.handle
        work.wait()
        if source is not u.lowp:
            self.in_flight.drop(source)
        u.handle = None
        u.gathered = True

    def refresh(self, units) -> None:
        """Stages 0-2, after an optimizer step: start gathering every unit's updated
        slices at once (each unit's forward waits only for its own: overlap)."""
        for u in units:
            u.gathered = False
            self.start(u, "step")

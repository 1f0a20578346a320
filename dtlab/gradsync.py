"""Who finishes gradient synchronization: one interface for every layout.

Taught in chapter 02 (DDP's ``no_sync`` and its explicit finish), chapter 03 (ZeRO),
chapter 05 (a pipeline synchronizes once, after its last flush) and chapter 07 (how
the axes compose).

Every data-parallel arrangement answers the same four questions, whatever it does
inside: may gradients add up over several backward passes before any communication
(:meth:`GradSync.no_sync`), what finishes the step's synchronization
(:meth:`GradSync.finish_gradient_synchronization`), what the rank holds
(:meth:`GradSync.memory_tensors`) and what it saves (:meth:`GradSync.state_dict`).
The trainer, the memory record and checkpointing ask those questions and never which
wrapper they hold. Two arrangements exist (what :func:`dtlab.parallelize.parallelize`
builds):

- :class:`Replicated`: this rank's modules are whole replicas of its tp/pp slice.
  DDP (:class:`dtlab.ddp.DistributedDataParallel`) averages their gradients during
  backward, or a pipeline's one flat all-reduce does after its last flush; expert
  parallelism then reduces the experts over the ranks that hold the same ones.
- :class:`Sharded`: ZeRO (:class:`dtlab.zero.FullyShardedDataParallel`) over each
  module; a tied embedding split over the first and last pipeline stage is summed
  shard by shard afterwards.

"Off is an object that does nothing" (nanoGPT's habit): a single process gets a
:class:`Replicated` with no wrapper and nothing to do after, not an ``if`` in the
trainer.

:func:`all_reduce_flat` is the one coalesced all-reduce every gradient sum uses
(context parallelism's, expert parallelism's, sequence parallelism's, the
pipeline's): one collective over one flat buffer instead of one per tensor, as
DDP's buckets and Megatron's grad buffer do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from dtlab import comm

__all__ = ["GradSync", "Replicated", "Sharded", "all_reduce_flat"]


@torch.no_grad()
def all_reduce_flat(
    tensors: Sequence[torch.Tensor], group, *, tag: str, divide_by: int = 1
) -> None:
    """Sum ``tensors`` over ``group`` in place with one all-reduce of one flat
    buffer (their concatenation), then divide by ``divide_by`` (the replicas, for a
    mean). Every rank of the group calls it with tensors of the same shapes in the
    same order; an empty list or a group of one rank sends nothing (the division
    still happens)."""
    tensors = list(tensors)
    if not tensors:
        return
    if comm.group_size(group) > 1:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        comm.all_reduce(flat, group=group, tag=tag)
        if divide_by != 1:
            flat /= divide_by
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))
    elif divide_by != 1:
        for t in tensors:
            t /= divide_by


@runtime_checkable
class GradSync(Protocol):
    """What a rank's gradient synchronization answers (see the module docstring)."""

    records_backward: bool
    """Whether the arrangement records its own backward span (DDP times its
    buckets against backward); otherwise the trainer records it."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside add their gradients up without communicating,
        where the arrangement holds whole gradients; elsewhere (ZeRO 2-3, which
        reduce-scatter every backward) it does nothing."""
        ...

    def finish_gradient_synchronization(self) -> None:
        """After the step's last backward: every gradient this rank steps is the
        gradient of the global batch's mean loss. Every rank calls it."""
        ...

    def memory_tensors(self, optimizer=None) -> Iterable[tuple[str, torch.Tensor]]:
        """``(category, tensor)`` pairs of what this rank holds for the model and
        ``optimizer``'s state (see :func:`dtlab.memory.count_bytes`)."""
        ...

    def state_dict(self) -> list[dict]:
        """This rank's model state, one entry per module (copies are the caller's
        business)."""
        ...

    def load_state_dict(self, states: list[dict]) -> None:
        """Put :meth:`state_dict` back, after the optimizer's state is back."""
        ...

    def stats(self) -> dict:
        """The last step's synchronization figures (DDP's bucket timings), or
        ``{}``."""
        ...


class Replicated:
    """Whole replicas of this rank's modules (DDP, or a pipeline's bare stages, or
    a single process). ``ddp`` is the :class:`~dtlab.ddp.DistributedDataParallel`
    around the one module (``None`` under a pipeline or alone); ``after`` are the
    steps that finish the synchronization once it is done (a pipeline's flat
    all-reduce, expert parallelism's expert sum), in order."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        ddp: nn.Module | None = None,
        after: Sequence[Callable[[], None]] = (),
    ):
        self.modules, self.ddp, self.after = list(modules), ddp, list(after)
        self.records_backward = ddp is not None

    def no_sync(self):
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        if self.ddp is not None:
            self.ddp.finish_gradient_synchronization()
        for step in self.after:
            step()

    def memory_tensors(self, optimizer=None) -> Iterator[tuple[str, torch.Tensor]]:
        # by storage: DDP's gradients are views of its buckets (one Ψ, not two)
        weights = [p for m in self.modules for p in m.parameters()]
        for p in weights:
            yield "params", p
        for p in weights:
            if p.grad is not None:
                yield "grads", p.grad
        if optimizer is not None:
            for state in optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        yield "optimizer", v
        for b in self.ddp.buckets if self.ddp is not None else ():
            if b.buffer is not None:
                yield "buffers", b.buffer

    def state_dict(self) -> list[dict]:
        return [m.state_dict() for m in self.modules]

    def load_state_dict(self, states: list[dict]) -> None:
        for module, state in zip(self.modules, states, strict=True):
            module.load_state_dict(state)

    def stats(self) -> dict:
        """DDP's bucket timings and a digest of the replica (equal on every rank
        iff the replicas are); ``{}`` without DDP."""
        if self.ddp is None:
            return {}
        sync = self.ddp.last_sync  # {} until DDP's first synchronization
        with torch.no_grad():
            digest = sum(
                float(p.double().sum()) * (i + 1)
                for i, p in enumerate(self.ddp.module.parameters())
            )
        return {
            "buckets": sync.get("buckets", 0),
            "wire_bytes": sync.get("wire_bytes", 0.0),
            "backward_s": sync.get("backward_s", 0.0),
            "comm_s": sync.get("comm_s", 0.0),
            "exposed_comm_s": sync.get("exposed_s", 0.0),
            "overlap": sync.get("overlap", 1.0),
            "replica_digest": digest,
        }


class Sharded:
    """ZeRO over each of this rank's modules (one
    :class:`~dtlab.zero.FullyShardedDataParallel` per module or pipeline chunk).
    Stages 0-1 hold whole gradients, so backward passes may add up under
    ``no_sync``; stages 2-3 reduce-scatter every backward. ``after``: as for
    :class:`Replicated` (the tied embedding's shard sum across pipeline stages)."""

    records_backward = False

    def __init__(
        self, wrappers: Sequence[nn.Module], after: Sequence[Callable[[], None]] = ()
    ):
        self.wrappers, self.after = list(wrappers), list(after)
        self.accumulates = all(not w.sharding.shards_grads for w in self.wrappers)

    def no_sync(self):
        stack = contextlib.ExitStack()
        if self.accumulates:
            for w in self.wrappers:
                stack.enter_context(w.no_sync())
        return stack

    def finish_gradient_synchronization(self) -> None:
        for w in self.wrappers:
            w.finish_gradient_synchronization()
        for step in self.after:
            step()

    def memory_tensors(self, optimizer=None) -> Iterator[tuple[str, torch.Tensor]]:
        for w in self.wrappers:
            yield from w.memory_tensors(optimizer)

    def state_dict(self) -> list[dict]:
        return [w.state_dict() for w in self.wrappers]  # the local shards

    def load_state_dict(self, states: list[dict]) -> None:
        """The shards are the optimizer's masters and came back with its state:
        the full weights follow them."""
        if len(states) != len(self.wrappers):
            raise ValueError(
                f"the state holds {len(states)} modules, this rank {len(self.wrappers)}"
            )
        for w in self.wrappers:
            w.sync_params()

    def stats(self) -> dict:
        return {}

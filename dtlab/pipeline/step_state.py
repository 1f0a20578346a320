"""What one pipeline step holds between its actions, and what it measures.

Taught in chapter 05 (pipeline parallelism). :meth:`dtlab.pipeline.Pipeline.step`
walks its rank's actions; this is its bookkeeping, kept out of that loop so the
loop reads as the schedule: the tensors each microbatch-chunk keeps until its
backward, the sends still in flight, the telemetry spans and memory samples, and
the count of activation bytes autograd saved (which tells Megatron's output-freeing
trick which outputs it may free).
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from dtlab.events import Span
from dtlab.memory import SavedBytes
from dtlab.pipeline.schedules import Action

__all__ = ["StepState"]


class StepState:
    """One :meth:`Pipeline.step <dtlab.pipeline.Pipeline.step>` of one rank.

    Keyed by ``(chunk, microbatch)``: ``inputs`` (received activations, whose
    ``.grad`` goes upstream), ``outputs`` (what the chunk's backward starts from:
    its output, or the scaled loss on the last virtual stage), ``grads`` (received
    gradients of the outputs). ``weights``: the parameters the stages compute with
    (inside a ZeRO wrapper too), which are not counted as activations. ``message``:
    ``(shape, dtype, device)`` of every activation or gradient on the wire.
    ``local``: what this rank sent itself (a V schedule's turn), not yet taken.
    """

    def __init__(self, rec, stage: int, replica: int, weights, message):
        self.rec, self.stage, self.replica = rec, stage, replica
        self.weights, self.message = list(weights), message
        self.inputs, self.outputs, self.grads = {}, {}, {}
        # messages this rank sends itself (a V's turn), per kind, in order sent
        self.local = {"act": deque(), "grad": deque()}
        self.saved: dict[tuple, int] = {}  # (chunk, mb) -> activation bytes held
        self.saved_ptrs: dict[tuple, set] = {}  # (chunk, mb) -> their storages
        self.sends: list = []  # (work, tensor, free when done)
        self.losses: list = []
        self.peak_n = self.peak_bytes = self.freed = 0

    def span(self, name, a: Action | None = None, **fields):
        """A telemetry span of this stage and replica (and of ``a``'s microbatch
        and chunk)."""
        if a is not None:
            fields.update(microbatch=a.microbatch, chunk=a.chunk)
        return self.rec.span(name, stage=self.stage, replica=self.replica, **fields)

    def new_message(self) -> torch.Tensor:
        """An empty buffer for one received activation or gradient, ``(b, T, C)``,
        on the batch's device (nccl moves device tensors only)."""
        shape, dtype, device = self.message
        return torch.empty(shape, dtype=dtype, device=device)

    @contextlib.contextmanager
    def recording(self, key):
        """Count the bytes autograd saves for backward (weights excluded), each
        storage once: the activation memory this microbatch-chunk holds. Where
        the weights are is looked up again for an unknown storage (ZeRO-3 gathers
        a stage's weights into fresh memory before its forward)."""
        counter = SavedBytes(lambda: self.weights)
        with counter:
            yield
        self.saved[key] = counter.bytes
        self.saved_ptrs[key] = counter.ptrs

    def sending(self, work, tensor, output_of: tuple | None = None) -> None:
        """Keep ``tensor`` alive until its ``isend`` completes. The output of
        ``output_of`` is then freed (Megatron's trick), unless a backward node
        saved that very storage: ``backward(out, grad)`` needs only its shape."""
        free = output_of is not None and (
            tensor.untyped_storage().data_ptr() not in self.saved_ptrs[output_of]
        )
        self.sends.append((work, tensor, free))

    def hand_over(self, a: Action, key) -> None:
        """``send_act`` or ``send_grad`` to this very rank (a V schedule's turn,
        stage ``p-1`` to ``p``): keep the tensor for the receive, in order sent.
        Nothing crosses a link and nothing is freed: the next chunk reads it."""
        kind = a.op[5:]
        out = self.outputs[key] if kind == "act" else self.inputs.pop(key).grad
        self.local[kind].append(out.detach())

    def release(self, key, a: Action) -> None:
        """The last backward pass of ``key`` ran: drop its graph and buffers."""
        del self.outputs[key]
        self.grads.pop(key, None)
        self.saved.pop(key)
        self.saved_ptrs.pop(key)
        self.note_memory(a)

    def note_memory(self, a: Action) -> None:
        """A memory sample: activation bytes and microbatch-chunks held now."""
        held = sum(self.saved.values())
        self.peak_n = max(self.peak_n, len(self.saved))
        self.peak_bytes = max(self.peak_bytes, held)
        self.rec.memory(
            "pp",
            activations=held,
            in_flight=len(self.saved),
            stage=self.stage,
            replica=self.replica,
            microbatch=a.microbatch,
            chunk=a.chunk,
        )

    def reap(self, wait_all: bool = False) -> None:
        """Finish completed sends (all of them if ``wait_all``, as idle time) and
        free the stage outputs they carried: the next stage has its copy."""
        for item in list(self.sends):
            work, tensor, free = item
            if wait_all:
                with self.span(Span.IDLE, microbatch=None, chunk=None):
                    work.wait()
            elif work.is_completed():
                work.wait()  # returns at once; closes the telemetry record
            else:
                continue
            self.sends.remove(item)
            if free:
                self.freed += tensor.untyped_storage().nbytes()
                tensor.untyped_storage().resize_(0)

    def stats(self) -> dict:
        """The step's loss (``mean_i L_i``; ``None`` off the last stage) and its
        measurements on this rank."""
        loss = torch.stack(self.losses).mean().item() if self.losses else None
        return {
            "loss": loss,
            "peak_in_flight": self.peak_n,
            "peak_activation_bytes": self.peak_bytes,
            "freed_bytes": self.freed,
        }

"""Fault-tolerant data parallelism: a quorum every step, gradients averaged over the
replicas that are alive, and a replica that comes back healed from a live peer
(chapter 13; chapter 08's lost replica generalised; the design of torchft, Meta
2024-25).

Chapter 08 stops the whole job when an engine dies, replaces it, and resumes every
rank from the newest step they all kept. Here the job never stops. Each step
begins with a *quorum*: the replicas say whether they take part and which step
their state is at (one all-gather of three integers per rank, tag ``"quorum"``,
standing in for torchft's lighthouse). Then:

- the *live* replicas (those taking part) average their gradients over the live
  ones only: one all-reduce (sum) over a process group formed of them, divided by
  the live count L. The step's global batch is what the live replicas saw, so its
  gradient is ``1/L · Σ_{r live} ∇L_r(w)``;
- a live replica whose state is behind (a new process at step 0, or one that sat
  out) *heals* before it steps: the first live replica at the newest step sends it
  the weights, the optimizer state and the step (``dtlab.comm.send``, tag
  ``"heal"``, bytes recorded), so after healing it equals its peers bit for bit;
- a replica that does not take part does nothing else this step.

A process group over the live replicas is made once per set of live ranks
(``new_group(..., use_local_synchronization=True)``: only its members take part
in making it, so a lost rank is not waited for) and reused when that set comes
again; a set of one needs no group and no communication.

The lost replica here is simulated: its process still answers the quorum (with
"not taking part") while it is down, and the caller wipes its state (a new
process would start from a fresh initialisation at step 0). A process that really
died could not answer an all-gather; torchft's lighthouse gives the quorum a join
timeout for that, and dtlab's chapter 08 (:mod:`dtlab.lab.kernel.replicas`) re-forms the
world. What is exact here is the arithmetic: with the same live sets, training
equals a single process that averages the live shards' gradients
(``tests/test_fault_tolerance.py`` derives and checks it bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtlab import comm
from dtlab.objects import recv_object, send_object

__all__ = ["Quorum", "FaultTolerantReplica"]

QUORUM_TAG = "quorum"
HEAL_TAG = "heal"
GRAD_TAG = "ft_grads"


@dataclass(frozen=True)
class Quorum:
    """What the replicas agreed at the start of one step.

    ``step``: the step the live replicas take (the newest state's step);
    ``live``: the ranks that take part; ``healing``: the live ranks whose state is
    behind and is sent to them first; ``source``: the rank that sends it."""

    step: int
    live: tuple[int, ...]
    healing: tuple[int, ...] = ()
    source: int | None = None


class FaultTolerantReplica:
    """One data-parallel replica of ``model`` stepped by ``optimizer``, fault
    tolerant in the torchft style (see the module docstring).

    One step::

        q = replica.start_quorum(taking_part=True)   # agree; heal if behind
        if replica.rank in q.live:
            loss = model(x_shard, y_shard)[1]; loss.backward()
            replica.average_gradients(q)             # over the live replicas
            replica.optimizer_step()

    ``replica.step`` counts the steps this replica's state has taken.
    """

    def __init__(self, model, optimizer, *, group=None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        self.step = 0
        self.healed_bytes = 0  # bytes this replica received while healing
        self._groups: dict[tuple[int, ...], object] = {}

    # ---- the quorum ---------------------------------------------------------------
    def start_quorum(self, taking_part: bool = True) -> Quorum:
        """Agree on the live replicas and the step; heal the live ones that are
        behind. Every rank of the group calls it every step."""
        mine = torch.tensor([int(taking_part), self.step, self.rank], dtype=torch.int64)
        every = torch.empty(self.world_size * 3, dtype=torch.int64)
        comm.all_gather(every, mine, self.group, tag=QUORUM_TAG)
        rows = every.view(self.world_size, 3).tolist()  # (N, 3): flag, step, rank
        live = tuple(r for r, (flag, _, _) in enumerate(rows) if flag)
        if not live:
            raise RuntimeError(
                "no replica takes part in this step: at least one must stay live"
            )
        newest = max(rows[r][1] for r in live)
        healing = tuple(r for r in live if rows[r][1] < newest)
        source = min(r for r in live if rows[r][1] == newest) if healing else None
        quorum = Quorum(step=newest, live=live, healing=healing, source=source)
        if healing:
            self._heal(quorum)
        return quorum

    def _live_group(self, live: tuple[int, ...]):
        """The process group of the ``live`` ranks (made once per set)."""
        if len(live) == self.world_size:
            return self.group
        if live not in self._groups:
            members = [comm.global_rank(self.group, r) for r in live]
            self._groups[live] = dist.new_group(members, use_local_synchronization=True)
        return self._groups[live]

    # ---- the step -----------------------------------------------------------------
    def average_gradients(self, quorum: Quorum) -> None:
        """Sum the gradients over ``quorum.live`` and divide by the live count: the
        gradient of the mean loss over the shards the live replicas saw."""
        if self.rank not in quorum.live:
            raise ValueError(
                f"rank {self.rank} is not in this step's quorum {quorum.live}: only "
                "live replicas average gradients"
            )
        params = [p for p in self.model.parameters() if p.grad is not None]
        if len(quorum.live) > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # (Ψ,)
            group = self._live_group(quorum.live)
            comm.all_reduce(flat, group=group, tag=GRAD_TAG)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        for p in params:
            p.grad.div_(len(quorum.live))

    def optimizer_step(self) -> None:
        """The optimizer's step, and this replica's step count with it."""
        self.optimizer.step()
        self.step += 1

    # ---- healing --------------------------------------------------------------------
    def state(self) -> dict:
        """What a healing replica receives: weights, optimizer state and step."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])

    def _heal(self, quorum: Quorum) -> None:
        """``quorum.source`` sends its state to each healing replica, as bytes
        through :func:`dtlab.comm.send` (:func:`dtlab.objects.send_object`)."""
        for newcomer in quorum.healing:
            if self.rank == quorum.source:
                send_object(self.state(), newcomer, self.group, tag=HEAL_TAG)
            elif self.rank == newcomer:
                state, nbytes = recv_object(quorum.source, self.group, tag=HEAL_TAG)
                self.load_state(state)
                self.healed_bytes += nbytes

    def lose_state(self, model, optimizer) -> None:
        """Stand for a replica replaced by a new process: a fresh ``model`` and
        ``optimizer`` at step 0 (it heals when it next takes part)."""
        self.model, self.optimizer, self.step = model, optimizer, 0

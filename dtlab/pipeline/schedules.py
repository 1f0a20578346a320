"""Pipeline schedules as data: which rank does what, in which order.

Taught in chapter 05 (pipeline parallelism). Pure data and pure functions: nothing
here needs a process group, so a schedule can be built, printed and unit-tested
anywhere (:func:`dtlab.pipeline.simulate` checks and times it, and
:class:`dtlab.pipeline.Pipeline` runs it).

A :class:`Schedule` holds, for every rank, an ordered list of :class:`Action` s:
``F``/``B``/``W`` compute and ``send_act``/``recv_act``/``send_grad``/``recv_grad``
messages, each with its microbatch and chunk. The builders:

- :func:`gpipe` (Huang et al. 2019, GPipe): all ``m`` forwards, then all ``m``
  backwards. Stage ``i`` holds the activations of all ``m`` microbatches at once.
- :func:`one_f_one_b` (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", §2.2.1; the *PipeDream-Flush*
  schedule of Narayanan et al. 2020): a **warm-up** of ``p - i - 1`` forwards, a
  **steady state** alternating one forward and one backward, a **cool-down** of the
  remaining backwards. Same bubble as GPipe, but stage ``i`` holds at most
  ``p - i`` microbatches of activations instead of ``m``.
- :func:`interleaved_1f1b` (same paper, §2.2.2): each rank holds ``v`` *chunks*
  (virtual stages ``c·p + rank``); the bubble shrinks by ``v`` for ``v`` times the
  point-to-point messages.
- :func:`zb_h1` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1): the
  backward splits into ``B`` (gradient of the input, on the critical path) and
  ``W`` (gradient of the weights, which nobody waits for); rank ``i`` runs each
  ``W`` ``i`` backwards late, moving work into the cool-down where 1F1B idles.

ZB-V and DualPipeV, two chunks per rank placed in a *V*, are built in
:mod:`dtlab.pipeline.zero_bubble`; :mod:`dtlab.pipeline.catalogue` finds every
schedule by its name.

Where a virtual stage lives is data too, :attr:`Schedule.placement`:
``"interleaved"`` puts chunk ``c`` of rank ``r`` at virtual stage ``c·p + r``
(Megatron), ``"v"`` puts chunk 0 at stage ``r`` and chunk 1 at stage ``2p-1-r``
(:func:`virtual_stage`, :func:`stage_place`): a microbatch runs down the ranks and
back up, and the turn at the bottom (stage ``p-1`` to ``p``, both on rank ``p-1``)
is a message a rank sends to itself, which the executor hands over in memory.

Each builder gives only the *compute* order of every rank; :func:`from_compute_orders`
puts each receive right before the compute that needs it and each send right after
the compute that produced it, so a learner's own order (chapter 05's exercise) becomes
a schedule the same way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dtlab.checks import positive_int

__all__ = [
    "COMPUTE",
    "MESSAGES",
    "PLACEMENTS",
    "virtual_stage",
    "stage_place",
    "Action",
    "Schedule",
    "ScheduleError",
    "from_compute_orders",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "in_flight",
]

COMPUTE = ("F", "B", "W")
"""Compute actions: forward, backward (input gradient), weight gradient."""
MESSAGES = ("send_act", "recv_act", "send_grad", "recv_grad")
"""Message actions: activations travel forwards, gradients backwards."""
PLACEMENTS = ("interleaved", "v")
"""Where each rank's chunks sit among the virtual stages (:func:`virtual_stage`)."""


def virtual_stage(p: int, rank: int, chunk: int, placement="interleaved") -> int:
    """The virtual stage chunk ``chunk`` of rank ``rank`` runs. ``"interleaved"``:
    ``chunk·p + rank`` (Megatron's assignment, ``v`` chunks). ``"v"``: chunk 0 is
    stage ``rank`` and chunk 1 stage ``2p - 1 - rank`` (ZB-V's and DualPipeV's V:
    rank 0 holds the first and the last stage)."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_place(p: int, vstage: int, placement="interleaved") -> tuple[int, int]:
    """``(rank, chunk)`` that runs virtual stage ``vstage``: the inverse of
    :func:`virtual_stage`."""
    if placement == "v":
        return (vstage, 0) if vstage < p else (2 * p - 1 - vstage, 1)
    return vstage % p, vstage // p


@dataclass(frozen=True)
class Action:
    """One step of one rank. ``op`` is ``F``, ``B``, ``W`` (compute) or
    ``send_act``/``recv_act``/``send_grad``/``recv_grad``; ``chunk`` is the local
    chunk index (0 unless interleaved); ``peer`` the pp index of the other rank of a
    message."""

    op: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        c = f".{self.chunk}" if self.chunk else ""
        if self.op in COMPUTE:
            return f"{self.op}{self.microbatch}{c}"
        arrow = "→" if self.op.startswith("send") else "←"
        kind = "a" if self.op.endswith("act") else "g"
        return f"{kind}{self.microbatch}{c}{arrow}{self.peer}"


@dataclass(frozen=True)
class Schedule:
    """Every rank's ordered actions. ``actions[r]`` is rank ``r``'s list.

    ``p`` stages (ranks), ``m`` microbatches, ``v`` chunks per rank, ``p·v``
    virtual stages in all; ``placement`` says which chunk runs which virtual stage
    (:func:`virtual_stage`: ``c·p + r`` when interleaved, the V otherwise).
    ``split_backward``: backward is ``B`` + ``W``.
    """

    name: str
    p: int
    m: int
    v: int
    actions: tuple
    split_backward: bool = False
    placement: str = "interleaved"

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement {self.placement!r}: expected one of {PLACEMENTS}"
            )
        if self.placement == "v" and self.v != 2:
            raise ValueError(f"the V placement holds 2 chunks per rank, not v={self.v}")

    @property
    def n_virtual(self) -> int:
        return self.p * self.v

    @property
    def loss_rank(self) -> int:
        """The rank that runs the last virtual stage: it computes the loss (rank 0
        in a V, rank ``p - 1`` otherwise)."""
        return self.place(self.n_virtual - 1)[0]

    @property
    def last_pass(self) -> str:
        """The backward pass after which a microbatch's activations can go."""
        return "W" if self.split_backward else "B"

    def vstage(self, rank: int, chunk: int) -> int:
        return virtual_stage(self.p, rank, chunk, self.placement)

    def place(self, vstage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that holds virtual stage ``vstage``."""
        return stage_place(self.p, vstage, self.placement)

    def compute_order(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.op in COMPUTE]

    def __str__(self) -> str:
        lines = [f"{self.name}: p={self.p} m={self.m} v={self.v}"]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order, or would deadlock."""


def _check_sizes(p, m, v=1) -> None:
    positive_int("p", p)
    positive_int("m", m)
    positive_int("v", v)


def from_compute_orders(
    name: str,
    p: int,
    m: int,
    orders,
    *,
    v: int = 1,
    split_backward: bool = False,
    placement: str = "interleaved",
) -> Schedule:
    """A full schedule from each rank's *compute* order (``F``/``B``/``W`` actions,
    or ``("F", mb)`` / ``("F", mb, chunk)`` tuples): the receive goes right before
    the compute that needs it, the send right after the compute that produced it."""
    _check_sizes(p, m, v)
    if len(orders) != p:
        raise ValueError(f"need one compute order per rank: got {len(orders)}, p={p}")
    S = p * v

    def peer(vstage: int) -> int:  # the rank of a neighbouring virtual stage
        return stage_place(p, vstage, placement)[0]

    out = []
    for r, order in enumerate(orders):
        acts = []
        for a in order:
            a = a if isinstance(a, Action) else Action(*a)
            if a.op not in COMPUTE:
                raise ValueError(
                    f"rank {r}: {a.op!r} is not a compute action; give only F, B, W "
                    "(messages are inserted for you)"
                )
            s = virtual_stage(p, r, a.chunk, placement)
            if a.op == "F" and s > 0:
                acts.append(Action("recv_act", a.microbatch, a.chunk, peer(s - 1)))
            if a.op == "B" and s < S - 1:
                acts.append(Action("recv_grad", a.microbatch, a.chunk, peer(s + 1)))
            acts.append(Action(a.op, a.microbatch, a.chunk))
            if a.op == "F" and s < S - 1:
                acts.append(Action("send_act", a.microbatch, a.chunk, peer(s + 1)))
            if a.op == "B" and s > 0:
                acts.append(Action("send_grad", a.microbatch, a.chunk, peer(s - 1)))
        out.append(tuple(acts))
    return Schedule(name, p, m, v, tuple(out), split_backward, placement)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs ``F0 … F(m-1)`` then ``B0 … B(m-1)``."""
    _check_sizes(p, m)
    order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return from_compute_orders("gpipe", p, m, [order] * p)


def _one_f_one_b_order(p: int, m: int, rank: int) -> list:
    warmup = min(p - rank - 1, m)  # forwards before the first backward
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]  # cool-down
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank ``i`` warms up with ``min(p-i-1, m)`` forwards,
    then alternates ``F``/``B``, then cools down with the backwards left. At most
    ``p - i`` microbatches are in flight on rank ``i``."""
    _check_sizes(p, m)
    orders = [_one_f_one_b_order(p, m, r) for r in range(p)]
    return from_compute_orders("1f1b", p, m, orders)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B with ``v`` chunks per rank (Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``).

    Forwards go in groups of ``p`` microbatches per chunk: the k-th forward of a rank
    runs chunk ``(k // p) % v`` on microbatch ``(k // (p·v))·p + k % p``; backwards
    the same with chunks reversed. Warm-up: ``2(p - i - 1) + (v - 1)·p`` forwards.
    Needs ``m`` to be a multiple of ``p``.
    """
    _check_sizes(p, m, v)
    if v == 1:
        sched = one_f_one_b(p, m)
        return Schedule("interleaved", p, m, 1, sched.actions)
    if m % p:
        raise ValueError(
            f"interleaved 1F1B sends microbatches in groups of p={p}: m={m} is not a "
            f"multiple of p; use m in {[p * k for k in range(1, 5)]}"
        )
    total = m * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        c = (k % (p * v)) // p
        return (c if forward else v - 1 - c), (k // (p * v)) * p + k % p

    orders = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = []
        for k in range(warmup):
            c, i = chunk_mb(k, True)
            order.append(("F", i, c))
        for k in range(total - warmup):  # steady state: F of one, B of another
            c, i = chunk_mb(warmup + k, True)
            order.append(("F", i, c))
            c, i = chunk_mb(k, False)
            order.append(("B", i, c))
        for k in range(total - warmup, total):
            c, i = chunk_mb(k, False)
            order.append(("B", i, c))
        orders.append(order)
    return from_compute_orders("interleaved", p, m, orders, v=v)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, §3.1): the 1F1B order with each backward split into
    ``B`` (input gradient, sent upstream at once) and ``W`` (weight gradient, which
    nobody waits for). Rank ``i`` runs its ``W`` passes ``i`` backwards late: the
    last stages, which 1F1B keeps busiest, push work into the cool-down where the
    first stages idle. With ``t_b = t_B + t_W`` the bubble drops from
    ``(p-1)(t_f+t_b)`` to ``(p-1)(t_f+t_B-t_W)``, a third of it when all are equal;
    the price is up to ``p`` microbatches' activations (held until ``W``) on every
    stage instead of ``p - i``."""
    _check_sizes(p, m)
    orders = []
    for r in range(p):
        order, pending = [], deque()
        for op, i in _one_f_one_b_order(p, m, r):
            order.append((op, i))
            if op == "B":
                pending.append(i)
                if len(pending) > r:  # W trails its B by r backwards
                    order.append(("W", pending.popleft()))
        order += [("W", i) for i in pending]
        orders.append(order)
    return from_compute_orders("zb_h1", p, m, orders, split_backward=True)


def in_flight(schedule: Schedule) -> list[list[int]]:
    """For each rank, the number of microbatch-chunks whose activations are held
    after each of its compute actions (forward done, last backward pass not yet).
    ``max(in_flight(s)[r])`` is rank ``r``'s peak."""
    out = []
    for r in range(schedule.p):
        n, trace = 0, []
        for a in schedule.compute_order(r):
            n += (a.op == "F") - (a.op == schedule.last_pass)
            trace.append(n)
        out.append(trace)
    return out

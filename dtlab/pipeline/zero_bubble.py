"""Zero-bubble schedules in a V: ZB-V and DualPipeV, as data.

Taught in chapter 12 (the frontier), after chapter 05's ZB-H1
(:func:`dtlab.pipeline.schedules.zb_h1`). Like :mod:`dtlab.pipeline.schedules`,
pure functions of data: no process group.

Both hold two chunks per rank placed in a *V* (``placement="v"``,
:func:`dtlab.pipeline.schedules.virtual_stage`): chunk 0 of rank ``r`` is stage
``r`` and chunk 1 is stage ``2p - 1 - r``, so a microbatch goes down the ranks and
back up, the last stage (and the loss) sits on rank 0 beside the first, and every
rank holds one early and one late stage, so its work is balanced from the warm-up
on. Both split each backward into ``B`` (input gradient, which the stage before
waits for) and ``W`` (weight gradient, which nobody waits for), and run ``W`` where
a rank would otherwise idle (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

- :func:`zb_v` (Qi et al. 2023, §6; PyTorch's ``ScheduleZBVZeroBubble``).
- :func:`dualpipe_v` (DeepSeek's DualPipe, DeepSeek-AI 2024, "DeepSeek-V3
  Technical Report", §3.2.1, cut in half to a V; PyTorch's ``ScheduleDualPipeV``).

Each rank's order is written by kind, not by microbatch (:class:`_Order`): every
chunk runs its forwards, input gradients and weight gradients in microbatch order,
so "the next ``F`` of chunk 1" names one action. The orders are PyTorch's, action
for action (``tests/test_pipeline_v.py`` compares them for many ``p`` and ``m``).
"""

from __future__ import annotations

from collections import Counter, deque

from dtlab.checks import positive_int
from dtlab.pipeline.schedules import Schedule, from_compute_orders

__all__ = ["zb_v", "dualpipe_v", "V_BUILDERS"]


class _Order(list):
    """One rank's compute order, written by kind: ``add("F1")`` appends the
    forward of chunk 1 on the next microbatch that chunk has not run forward on
    and returns that microbatch (the last one's, given several)."""

    def __init__(self):
        super().__init__()
        self.done: Counter = Counter()  # (op, chunk) -> microbatches run

    def add(self, *ops: str) -> int | None:
        i = None
        for op in ops:  # "F0": forward of chunk 0
            kind, chunk = op[0], int(op[1])
            i = self.done[kind, chunk]
            self.append((kind, i, chunk))
            self.done[kind, chunk] += 1
        return i


def _zb_v_order(p: int, m: int, r: int) -> list:
    n = max(m, 2 * p - 1)  # enough to fill the V; the extra ones are dropped below
    o = _Order()
    # warm-up: chunk 0 alone until microbatch 0 has gone down and come back up to
    # chunk 1 (stage 2p-1-r, 2(p-r)-1 forwards later), then both chunks, then
    # chunk 1's backwards start (on rank 0, which holds the loss, at once)
    o.add(*["F0"] * (2 * (p - r) - 1))
    for _ in range(r):
        o.add("F1", "F0")
    for _ in range(p - r):
        o.add("F1", "B1", "W1")
    # steady state: F, B, W of one chunk, then of the other; each W at once
    while o.done["F", 0] < n or o.done["F", 1] < o.done["F", 0]:
        if o.done["F", 0] < n:
            o.add("F0")
        o.add("B0", "W0", "F1", "B1", "W1")
    # cool-down: input gradients first (the other ranks wait for them), W after
    for _ in range(r):
        o.add("B0", "B1")
    for _ in range(p - r):
        o.add("B0", "W0")
    while o.done["W", 1] < n:
        o.add("W1")
    while o.done["W", 0] < n:
        o.add("W0")
    return [a for a in o if a[1] < m]


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2023, §6): two chunks per rank in a V, backward split into
    ``B`` and ``W``. Rank ``r`` warms up with ``2(p-r)-1`` forwards of chunk 0;
    in the steady state it runs ``F``, ``B``, ``W`` of one chunk, then of the
    other; it cools down with the input gradients first and the deferred ``W``
    last, in what would be bubbles.

    With equal times per chunk, ``t_F = t_B = t_W`` (``simulate(s, 1, 2, 1)``),
    the step lasts ``m(t_f + t_b) + (p-1)·t_f/2``, which no schedule beats: rank
    ``r`` cannot start before microbatch 0 has come down the ``r`` chunks above it
    (``r·t_f/2``), and every rank has the same work. Rank ``r`` idles then, and
    ``(p-1-r)·t_f/2`` at the end, never in between. ZB-H1 adds ``(p-1)·t_f``,
    1F1B ``(p-1)(t_f + t_b)``. Every rank peaks at ``2p``
    microbatch-chunks in flight, ``p`` microbatches of a whole rank's layers: 1F1B's
    first stage. Any ``m`` runs, as in PyTorch (the orders are built for
    ``max(m, 2p-1)`` microbatches and the extra ones dropped), but below ``2p - 1``
    the V never fills."""
    positive_int("p", p)
    positive_int("m", m)
    orders = [_zb_v_order(p, m, r) for r in range(p)]
    return from_compute_orders(
        "zb_v", p, m, orders, v=2, split_backward=True, placement="v"
    )


def _dualpipe_v_order(p: int, m: int, r: int) -> list:
    o, deferred = _Order(), deque()  # (microbatch, chunk) of each W put off

    def backward(chunk: int, split: bool) -> None:
        i = o.add(f"B{chunk}")  # the input gradient, sent on at once
        if split:  # the weight gradient later, into a bubble
            deferred.append((i, chunk))
        else:  # the whole backward at once
            o.append(("W", i, chunk))

    def deferred_w() -> None:
        if deferred:
            o.append(("W", *deferred.popleft()))

    o.add(*["F0"] * (2 * (p - r - 1)))  # 1. chunk 0 fills the V
    for _ in range(r + 1):  # 2. both chunks
        o.add("F0", "F1")
    for _ in range(p - r - 1):  # 3. chunk 1's first backwards
        backward(1, split=True)
        deferred_w()
        o.add("F1")
    for _ in range(m - 2 * p + r + 1):  # 4. steady state: two F&B pairs
        o.add("F0")  # F of chunk 0 beside B of chunk 1
        backward(1, split=False)
        o.add("F1")  # F of chunk 1 beside B of chunk 0
        backward(0, split=False)
    for _ in range(p - r - 1):  # 5. chunk 0 has run all its forwards
        backward(1, split=False)
        o.add("F1")
        backward(0, split=False)
    half = (r + 1) // 2  # 6. backwards only; W put off from the middle on
    for k in range(r + 1):
        backward(1, split=k > half or (k == half and r % 2 == 1))
        backward(0, split=k >= half)
    for _ in range(p - r - 1):  # 7. a W while waiting for each gradient
        deferred_w()
        backward(0, split=True)
    while deferred:  # 8. the W left
        deferred_w()
    return list(o)


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV: DeepSeek's DualPipe (DeepSeek-AI 2024, §3.2.1) cut in half to a
    V on ``p`` ranks, in the order of PyTorch's ``ScheduleDualPipeV`` (after
    deepseek-ai/DualPipe's ``DualPipeV``); placement as :func:`zb_v`.

    Its steady state pairs the forward of one chunk with the backward of the
    other ("F&B"); on a GPU the pair overlaps, one's communication hidden behind
    the other's compute. dtlab's executor runs one action at a time, so a pair is
    written as the sequence a rank runs: ``F``, then the whole backward ``B``,
    ``W`` (PyTorch too runs a pair's halves one after the other). Only chunk 1's
    first backwards and the cool-down put ``W`` off into bubbles.

    With ``t_F = t_B = t_W`` per chunk it takes as long as :func:`zb_v`,
    ``m(t_f + t_b) + (p-1)·t_f/2`` (the DualPipe paper's bubble, ``(PP/2 - 1)(F&B
    + B - 3W)`` with ``PP = 2p`` stages, counts an overlapped ``F&B``). It holds
    one microbatch-chunk more than ZB-V: ``2p + 1`` in flight on every rank (the
    paper's ``PP + 1``). Needs ``m >= 2p``, as PyTorch does."""
    positive_int("p", p)
    positive_int("m", m)
    if m < 2 * p:
        raise ValueError(
            f"dualpipe_v runs at least 2p = {2 * p} microbatches (one per stage of "
            f"its V), got m={m}: use m >= {2 * p}, or fewer stages"
        )
    orders = [_dualpipe_v_order(p, m, r) for r in range(p)]
    return from_compute_orders(
        "dualpipe_v", p, m, orders, v=2, split_backward=True, placement="v"
    )


V_BUILDERS = {"zb_v": zb_v, "dualpipe_v": dualpipe_v}
"""The builders of this module's schedules (:data:`dtlab.events.V_SCHEDULES`),
each placing 2 chunks per rank in a V."""

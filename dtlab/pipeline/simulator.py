"""The simulator: a schedule played out, proved to run, timed; and measured.

Taught in chapter 05 (pipeline parallelism). Like :mod:`dtlab.pipeline.schedules`,
pure functions of data: no process group.

Communication model (what :func:`validate` proves and :class:`dtlab.pipeline.Pipeline`
relies on): a send is posted without waiting (``isend``), a receive waits for its
data. Messages between two ranks travel on two channels, activations and gradients
(two process groups), and each channel delivers in order: the n-th ``recv_act`` from
rank ``j`` gets the n-th ``send_act`` rank ``j`` posted to it. A message a rank sends
to itself (a V schedule's turn: two consecutive stages on one rank) follows the same
rule, without latency.

:func:`validate` and :func:`simulate` play every rank's list together under that
model (one loop, :func:`_play`): the first checks that every receive gets the
message it expects and that every rank finishes; the second also runs a clock per
rank, giving the *ideal* timeline. :func:`measured_timeline` gives the *measured*
one, from the telemetry spans of a real step, in the same format, so the two can be
plotted side by side and :func:`bubble` measures either.

Bubble: with ``t_f``, ``t_b`` per microbatch and stage, GPipe and 1F1B take
``(m + p - 1)(t_f + t_b)`` for ``m(t_f + t_b)`` of work, so a fraction
``(p - 1)/(m + p - 1)`` of every stage's step is idle
(:func:`dtlab.estimate.pipeline_bubble_fraction`).
"""

from __future__ import annotations

from collections import deque

from dtlab.events import Kind, Span
from dtlab.pipeline.schedules import COMPUTE, Action, Schedule, ScheduleError

__all__ = ["validate", "simulate", "measured_timeline", "bubble"]


# ---- the validator -------------------------------------------------------------------
def _expected_actions(s: Schedule, r: int) -> dict[Action, int]:
    """Every action rank ``r`` must run exactly once."""
    need = {}
    S = s.n_virtual
    for c in range(s.v):
        vs = s.vstage(r, c)
        for i in range(s.m):
            ops = ["F", "B"] + (["W"] if s.split_backward else [])
            for op in ops:
                need[Action(op, i, c)] = 1
            if vs > 0:
                up = s.place(vs - 1)[0]  # the rank of the stage before
                need[Action("recv_act", i, c, up)] = 1
                need[Action("send_grad", i, c, up)] = 1
            if vs < S - 1:
                down = s.place(vs + 1)[0]  # the rank of the stage after
                need[Action("send_act", i, c, down)] = 1
                need[Action("recv_grad", i, c, down)] = 1
    return need


# (action that must come first, action it enables) within one rank
_LOCAL_ORDER = (
    ("recv_act", "F"),
    ("F", "send_act"),
    ("F", "B"),
    ("recv_grad", "B"),
    ("B", "send_grad"),
    ("B", "W"),
)


def validate(schedule: Schedule) -> Schedule:
    """Prove ``schedule`` runs: raise :class:`ScheduleError` naming the first
    problem, return the schedule otherwise.

    1. *Complete*: each rank runs each of its ``F``, ``B`` (``W``) and messages
       exactly once, with the right peers.
    2. *Ordered*: on each rank a microbatch is received before its forward, sent
       after it, and so on (:data:`_LOCAL_ORDER`).
    3. *No deadlock*: all ranks are executed together under the communication
       model (non-blocking sends, blocking receives, in-order channels); every
       receive must get the message it expects, and every rank must finish.
    """
    s = schedule
    if len(s.actions) != s.p:
        raise ScheduleError(f"{s.name}: {len(s.actions)} rank lists for p={s.p}")
    for r, acts in enumerate(s.actions):
        need = _expected_actions(s, r)
        seen: dict[Action, int] = {}
        for a in acts:
            seen[a] = seen.get(a, 0) + 1
        for a, k in seen.items():
            if a not in need:
                raise ScheduleError(f"{s.name}: rank {r} has an unexpected action {a}")
            if k > 1:
                raise ScheduleError(f"{s.name}: rank {r} runs {a} {k} times")
        missing = [str(a) for a in need if a not in seen]
        if missing:
            raise ScheduleError(
                f"{s.name}: rank {r} never runs {', '.join(missing[:6])}"
                + (" …" if len(missing) > 6 else "")
            )
        pos = {(a.op, a.microbatch, a.chunk): k for k, a in enumerate(acts)}
        for first, then in _LOCAL_ORDER:
            for (op, i, c), k in pos.items():
                if op != then or (first, i, c) not in pos:
                    continue
                if pos[first, i, c] > k:
                    raise ScheduleError(
                        f"{s.name}: rank {r} runs {then} of microbatch {i} chunk {c} "
                        f"before its {first}: move {first} earlier"
                    )
    _play(s, dict.fromkeys(COMPUTE, 0.0))
    return s


def _play(s: Schedule, cost: dict[str, float], t_comm: float = 0.0) -> list[dict]:
    """Run every rank's list together against in-order channels, each rank until it
    blocks on a receive, round after round. A compute action advances the rank's
    clock by ``cost[op] / v``; a receive waits for the message's arrival (its send
    time plus ``t_comm``). Returns the spans; raises :class:`ScheduleError` on a
    message that is not the one expected, or a deadlock."""
    ptr = [0] * s.p
    clock = [0.0] * s.p
    # (src, dst, "act" | "grad") -> (microbatch, destination virtual stage, arrival)
    channels: dict[tuple, deque] = {}
    spans = []
    while True:
        progress = False
        for r in range(s.p):
            acts = s.actions[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.op.startswith("send"):
                    kind = a.op[5:]
                    dst_v = s.vstage(r, a.chunk) + (1 if kind == "act" else -1)
                    latency = t_comm if a.peer != r else 0.0  # the V's turn: local
                    channels.setdefault((r, a.peer, kind), deque()).append(
                        (a.microbatch, dst_v, clock[r] + latency)
                    )
                elif a.op.startswith("recv"):
                    kind = a.op[5:]
                    q = channels.get((a.peer, r, kind))
                    if not q and a.peer == r:  # nobody else can send it
                        raise ScheduleError(
                            f"{s.name}: rank {r} waits for its own {kind} of "
                            f"microbatch {a.microbatch} (virtual stage "
                            f"{s.vstage(r, a.chunk)}) before it computes it: run the "
                            "neighbouring stage's compute first"
                        )
                    if not q:
                        break  # blocked until the peer sends
                    *got, arrive = q.popleft()
                    want = [a.microbatch, s.vstage(r, a.chunk)]
                    if got != want:
                        raise ScheduleError(
                            f"{s.name}: rank {r} waits for {kind} of microbatch "
                            f"{want[0]} (virtual stage {want[1]}) from rank {a.peer}, "
                            f"but the next {kind} on that link is microbatch {got[0]} "
                            f"(virtual stage {got[1]}): messages on a link arrive in "
                            "the order they were sent"
                        )
                    if arrive > clock[r]:  # waiting is the bubble
                        spans.append(_span(r, Span.IDLE, a, clock[r], arrive))
                        clock[r] = arrive
                else:
                    end = clock[r] + cost[a.op] / s.v
                    spans.append(_span(r, Span(a.op), a, clock[r], end))
                    clock[r] = end
                ptr[r] += 1
                progress = True
        if all(ptr[r] == len(s.actions[r]) for r in range(s.p)):
            return spans
        if not progress:
            waits = [
                f"rank {r} at step {ptr[r]} waits for {s.actions[r][ptr[r]]}"
                for r in range(s.p)
                if ptr[r] < len(s.actions[r])
            ]
            raise ScheduleError(f"{s.name} deadlocks: " + "; ".join(waits))


def _span(rank, name, a, t0, t1) -> dict:
    return {
        "kind": Kind.SPAN,
        "rank": rank,
        "stage": rank,
        "name": name,
        "microbatch": a.microbatch,
        "chunk": a.chunk,
        "t_start": t0,
        "t_end": t1,
    }


# ---- timelines: ideal and measured ---------------------------------------------------
def simulate(
    schedule: Schedule,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_w: float | None = None,
    t_comm: float = 0.0,
) -> list[dict]:
    """The ideal timeline of a valid schedule: one span per compute action and per
    wait, in the fields of :mod:`dtlab.telemetry` spans (``rank``, ``stage``,
    ``name`` F/B/W/idle, ``microbatch``, ``chunk``, ``t_start``, ``t_end``).

    ``t_f``, ``t_b``: forward and whole-backward time of one microbatch through one
    rank's layers (a chunk takes ``1/v`` of it). With a split backward, ``W`` takes
    ``t_w`` (default ``t_b/2``) and ``B`` the rest. ``t_comm``: latency of a message.
    """
    s = validate(schedule)
    t_w = t_b / 2 if t_w is None else t_w
    cost = {"F": t_f, "B": t_b - t_w if s.split_backward else t_b, "W": t_w}
    return _pad_idle(_play(s, cost, t_comm))


def measured_timeline(events, *, replica: int = 0, step: int | None = None) -> list:
    """Telemetry spans of one pipeline step (the last one unless ``step``), of one
    data-parallel replica, in :func:`simulate`'s format: times relative to each
    rank's step start (ranks align on the barrier that opens every step)."""
    spans = [
        e
        for e in events
        if e.get("kind") == Kind.SPAN and e.get("replica", 0) == replica
    ]
    steps = [e for e in spans if e["name"] == Span.STEP]
    if not steps:
        raise ValueError("no pipeline 'step' span in these events: record a step")
    n = max(e["step"] for e in steps) if step is None else step
    out = []
    for st in (e for e in steps if e["step"] == n):
        for e in spans:
            if e["rank"] != st["rank"] or e["name"] not in (*COMPUTE, Span.IDLE):
                continue
            if e["t_start"] < st["t_start"] or e["t_end"] > st["t_end"] + 1e-9:
                continue
            out.append(
                {
                    **e,
                    "t_start": e["t_start"] - st["t_start"],
                    "t_end": e["t_end"] - st["t_start"],
                }
            )
    return _pad_idle(out)


def _pad_idle(spans: list[dict]) -> list[dict]:
    """Add an ``idle`` span from each stage's last span to the end of the step: a
    stage that finished early waits for the others (the bubble's cool-down part)."""
    if not spans:
        return spans
    t_end = max(e["t_end"] for e in spans)
    out = list(spans)
    for stage in sorted({e["stage"] for e in spans}):
        mine = [e for e in spans if e["stage"] == stage]
        last = max(e["t_end"] for e in mine)
        if t_end - last > 1e-12:
            ref = next(e for e in mine if e["t_end"] == last)
            out.append(
                {
                    **ref,
                    "name": Span.IDLE,
                    "microbatch": None,
                    "chunk": None,
                    "t_start": last,
                    "t_end": t_end,
                }
            )
    return out


def bubble(spans, *, per_rank: bool = False):
    """Idle share of the step: ``1 - busy / step time`` for each rank (the step runs
    from the earliest start to the latest end over all ranks), averaged over ranks
    unless ``per_rank``. Works on simulated and measured spans alike."""
    work = [e for e in spans if e.get("name") in COMPUTE]
    if not work:
        raise ValueError("no F/B/W spans to measure a bubble from")
    t0 = min(e["t_start"] for e in work)
    t1 = max(e["t_end"] for e in work)
    ranks = sorted({e["stage"] for e in work})
    fractions = []
    for r in ranks:
        busy = sum(e["t_end"] - e["t_start"] for e in work if e["stage"] == r)
        fractions.append(1.0 - busy / (t1 - t0))
    return fractions if per_rank else sum(fractions) / len(fractions)

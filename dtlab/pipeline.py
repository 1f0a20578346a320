"""Pipeline parallelism: schedules as data, checked, simulated and executed.

Taught in chapter 05 (pipeline parallelism); chapter 07 composes it with tensor and
data parallelism (:mod:`dtlab.parallelize` hands :class:`Pipeline` tensor-parallel
stages, or stages wrapped by ZeRO).

The model's layers are cut into ``p`` *stages*, one per rank of the ``pp`` axis; a
batch is cut into ``m`` *microbatches* that flow through the stages, activations
forwards and gradients backwards. Which stage does what, and when, is a *schedule*,
and here a schedule is plain data: for every rank an ordered list of
:class:`Action` s (``F``/``B``/``W`` compute, ``send_act``/``recv_act``/
``send_grad``/``recv_grad`` messages, each with its microbatch and chunk). A list
can be printed, checked without any process group (:func:`validate`), turned into
the ideal timeline (:func:`simulate`), executed for real (:class:`Pipeline`) and
compared with the measured timeline (:func:`measured_timeline`).

The schedules:

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

Bubble: with ``t_f``, ``t_b`` per microbatch and stage, GPipe and 1F1B take
``(m + p - 1)(t_f + t_b)`` for ``m(t_f + t_b)`` of work, so a fraction
``(p - 1)/(m + p - 1)`` of every stage's step is idle
(:func:`dtlab.estimate.pipeline_bubble_fraction`).

Communication model (what :func:`validate` proves and the executor relies on): a
send is posted without waiting (``isend``), a receive waits for its data. Messages
between two ranks travel on two channels, activations and gradients (two process
groups), and each channel delivers in order: the n-th ``recv_act`` from rank ``j``
gets the n-th ``send_act`` rank ``j`` posted to it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dtlab import comm, telemetry
from dtlab.model import INIT_STD, Block, GPTConfig, param_generator
from dtlab.topology import Axis, Layout

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "SCHEDULES",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "make_schedule",
    "from_compute_orders",
    "validate",
    "in_flight",
    "simulate",
    "bubble",
    "partition",
    "StageModule",
    "build_stages",
    "Pipeline",
    "measured_timeline",
    "train_pipeline",
]

COMPUTE = ("F", "B", "W")
COMM = ("send_act", "recv_act", "send_grad", "recv_grad")


# ---- schedules as data ---------------------------------------------------------------
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

    ``p`` stages (ranks), ``m`` microbatches, ``v`` chunks per rank; chunk ``c`` of
    rank ``r`` is virtual stage ``c·p + r`` (Megatron's interleaved assignment), so
    ``p·v`` virtual stages in all. ``split_backward``: backward is ``B`` + ``W``.
    """

    name: str
    p: int
    m: int
    v: int
    actions: tuple
    split_backward: bool = False

    @property
    def n_virtual(self) -> int:
        return self.p * self.v

    def vstage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def place(self, vstage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that holds virtual stage ``vstage``."""
        return vstage % self.p, vstage // self.p

    def compute_order(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.op in COMPUTE]

    def __str__(self) -> str:
        lines = [f"{self.name}: p={self.p} m={self.m} v={self.v}"]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: " + " ".join(str(a) for a in acts))
        return "\n".join(lines)


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order, or would deadlock."""


def _check_pm(p, m, v=1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def from_compute_orders(
    name: str, p: int, m: int, orders, *, v: int = 1, split_backward: bool = False
) -> Schedule:
    """A full schedule from each rank's *compute* order (``F``/``B``/``W`` actions,
    or ``("F", mb)`` / ``("F", mb, chunk)`` tuples): the receive goes right before
    the compute that needs it, the send right after the compute that produced it."""
    _check_pm(p, m, v)
    if len(orders) != p:
        raise ValueError(f"need one compute order per rank: got {len(orders)}, p={p}")
    S = p * v
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
            s = a.chunk * p + r  # virtual stage
            if a.op == "F" and s > 0:
                acts.append(Action("recv_act", a.microbatch, a.chunk, (s - 1) % p))
            if a.op == "B" and s < S - 1:
                acts.append(Action("recv_grad", a.microbatch, a.chunk, (s + 1) % p))
            acts.append(Action(a.op, a.microbatch, a.chunk))
            if a.op == "F" and s < S - 1:
                acts.append(Action("send_act", a.microbatch, a.chunk, (s + 1) % p))
            if a.op == "B" and s > 0:
                acts.append(Action("send_grad", a.microbatch, a.chunk, (s - 1) % p))
        out.append(tuple(acts))
    return Schedule(name, p, m, v, tuple(out), split_backward)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs ``F0 … F(m-1)`` then ``B0 … B(m-1)``."""
    _check_pm(p, m)
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
    _check_pm(p, m)
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
    _check_pm(p, m, v)
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
        for k in range(total - warmup):
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
    _check_pm(p, m)
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
    return from_compute_orders("zb-h1", p, m, orders, split_backward=True)


SCHEDULES = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """``name`` in :data:`SCHEDULES`; ``v`` only for ``"interleaved"``."""
    key = str(name).lower().replace("_", "-")
    key = {"zbh1": "zb-h1", "interleaved-1f1b": "interleaved"}.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(
            f"unknown schedule {name!r}: expected one of {list(SCHEDULES)}"
        )
    if key == "interleaved":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ValueError(
            f"schedule {name!r} runs one chunk per rank; chunks={v} needs 'interleaved'"
        )
    return SCHEDULES[key](p, m)


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
                need[Action("recv_act", i, c, (vs - 1) % s.p)] = 1
                need[Action("send_grad", i, c, (vs - 1) % s.p)] = 1
            if vs < S - 1:
                need[Action("send_act", i, c, (vs + 1) % s.p)] = 1
                need[Action("recv_grad", i, c, (vs + 1) % s.p)] = 1
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
    _run_channels(s)
    return s


def _run_channels(s: Schedule) -> None:
    """Execute every rank's list against in-order channels; raise on a mismatched
    message or a deadlock."""
    ptr = [0] * s.p
    channels: dict[tuple, deque] = {}
    while True:
        progress = False
        for r in range(s.p):
            acts = s.actions[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.op.startswith("send"):
                    kind = a.op[5:]
                    dst_v = s.vstage(r, a.chunk) + (1 if kind == "act" else -1)
                    channels.setdefault((r, a.peer, kind), deque()).append(
                        (a.microbatch, dst_v)
                    )
                elif a.op.startswith("recv"):
                    kind = a.op[5:]
                    q = channels.get((a.peer, r, kind))
                    if not q:
                        break  # blocked until the peer sends
                    got = q.popleft()
                    want = (a.microbatch, s.vstage(r, a.chunk))
                    if got != want:
                        raise ScheduleError(
                            f"{s.name}: rank {r} waits for {kind} of microbatch "
                            f"{want[0]} (virtual stage {want[1]}) from rank {a.peer}, "
                            f"but the next {kind} on that link is microbatch {got[0]} "
                            f"(virtual stage {got[1]}): messages on a link arrive in "
                            "the order they were sent"
                        )
                ptr[r] += 1
                progress = True
        if all(ptr[r] == len(s.actions[r]) for r in range(s.p)):
            return
        if not progress:
            waits = [
                f"rank {r} at step {ptr[r]} waits for {s.actions[r][ptr[r]]}"
                for r in range(s.p)
                if ptr[r] < len(s.actions[r])
            ]
            raise ScheduleError(f"{s.name} deadlocks: " + "; ".join(waits))


def in_flight(schedule: Schedule) -> list[list[int]]:
    """For each rank, the number of microbatch-chunks whose activations are held
    after each of its compute actions (forward done, last backward pass not yet).
    ``max(in_flight(s)[r])`` is rank ``r``'s peak."""
    last = "W" if schedule.split_backward else "B"
    out = []
    for r in range(schedule.p):
        n, trace = 0, []
        for a in schedule.compute_order(r):
            n += (a.op == "F") - (a.op == last)
            trace.append(n)
        out.append(trace)
    return out


# ---- the simulator -------------------------------------------------------------------
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
    validate(schedule)
    s = schedule
    t_w = t_b / 2 if t_w is None else t_w
    cost = {"F": t_f, "B": t_b - t_w if s.split_backward else t_b, "W": t_w}
    clock = [0.0] * s.p
    ptr = [0] * s.p
    posted: dict[tuple, deque] = {}
    spans = []
    while any(ptr[r] < len(s.actions[r]) for r in range(s.p)):
        for r in range(s.p):
            acts = s.actions[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                if a.op.startswith("send"):
                    key = (r, a.peer, a.op[5:])
                    posted.setdefault(key, deque()).append(clock[r] + t_comm)
                elif a.op.startswith("recv"):
                    q = posted.get((a.peer, r, a.op[5:]))
                    if not q:
                        break
                    arrive = q.popleft()
                    if arrive > clock[r]:
                        spans.append(_span(r, "idle", a, clock[r], arrive))
                        clock[r] = arrive
                else:
                    end = clock[r] + cost[a.op] / s.v
                    spans.append(_span(r, a.op, a, clock[r], end))
                    clock[r] = end
                ptr[r] += 1
    return _pad_idle(spans)


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
                    "name": "idle",
                    "microbatch": None,
                    "chunk": None,
                    "t_start": last,
                    "t_end": t_end,
                }
            )
    return out


def _span(rank, name, a, t0, t1) -> dict:
    return {
        "kind": "span",
        "rank": rank,
        "stage": rank,
        "name": name,
        "microbatch": a.microbatch,
        "chunk": a.chunk,
        "t_start": t0,
        "t_end": t1,
    }


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


# ---- stages of dtlab's GPT -----------------------------------------------------------
def partition(config: GPTConfig, p: int, v: int = 1) -> list[list[range]]:
    """Layers of each rank's chunks: ``partition(cfg, p, v)[r][c]`` is the range of
    block indices of virtual stage ``c·p + r``. The embedding goes with virtual
    stage 0, the final LayerNorm, head and loss with the last one."""
    Layout(pp=p).validate(n_layers=config.n_layers, chunks=v)
    per = config.n_layers // (p * v)
    return [
        [range((c * p + r) * per, (c * p + r + 1) * per) for c in range(v)]
        for r in range(p)
    ]


class StageModule(nn.Module):
    """One virtual stage of :class:`dtlab.model.GPT`: the embedding if it is the
    first, ``blocks`` ``layers``, the head if it is the last.

    Parameters have the full model's names (``blocks.5.attn.q.weight``) and values:
    each is drawn from its own generator seeded by ``(seed, name)``, so this stage
    builds only its own slice and still matches ``GPT(config, seed)`` exactly. A
    tied head on a last stage that is not also the first is a *copy* of ``wte``
    whose gradient :class:`Pipeline` sums with the first stage's (Megatron's
    embedding group).
    """

    def __init__(
        self, config: GPTConfig, layers: range, *, first: bool, last: bool, seed=0
    ):
        super().__init__()
        from dtlab.model import init_gpt_weights  # the full model's init, by name

        self.config, self.first, self.last = config, first, last
        with torch.random.fork_rng(devices=[]):  # torch's default init draws
            if first:
                self.wte = nn.Embedding(config.vocab_size, config.d_model)
                self.wpe = nn.Embedding(config.seq_len, config.d_model)
                self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleDict({str(i): Block(config) for i in layers})
            if last:
                self.ln_f = nn.LayerNorm(config.d_model)
                self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if first and last and config.tied_head:
            self.head.weight = self.wte.weight
        init_gpt_weights(self, seed, config.n_layers)
        if last and config.tied_head and not first:
            with torch.no_grad():  # the copy gets wte's values: wte's generator
                gen = param_generator(seed, "wte.weight")
                self.head.weight.normal_(0.0, INIT_STD, generator=gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` ids (first stage) or ``(B, T, C)`` -> ``(B, T, C)``, or logits
        ``(B, T, V)`` on the last stage (same ops as ``GPT.embed``/``GPT.output``)."""
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)  # (T,)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C)
        if self.last:
            x = self.head(self.ln_f(x))  # (B, T, V)
        return x

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, exactly as ``GPT.output`` computes it."""
        V = logits.shape[-1]
        return F.cross_entropy(logits.view(-1, V), targets.reshape(-1))

    def global_named_parameters(self):
        """``(name in GPT, parameter)``: a tied head copy is reported as
        ``wte.weight``, the name it has in the full model."""
        for name, param in self.named_parameters():
            if name == "head.weight" and self.config.tied_head:
                name = "wte.weight"
            yield name, param


def build_stages(config: GPTConfig, p: int, rank: int, v: int = 1, seed: int = 0):
    """The ``v`` :class:`StageModule` chunks of pp rank ``rank``."""
    parts = partition(config, p, v)[rank]
    S = p * v
    return [
        StageModule(
            config,
            layers,
            first=c * p + rank == 0,
            last=c * p + rank == S - 1,
            seed=seed,
        )
        for c, layers in enumerate(parts)
    ]


# ---- the executor --------------------------------------------------------------------
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pipeline_axes(topo) -> dict[str, Axis | None]:
    """Process groups of this rank's pipeline: ``act`` (the topology's pp axis),
    ``grad`` (a second group over the same ranks, so gradients never queue behind
    activations on one link) and ``tied`` (first and last stage, for a tied
    embedding). Created once per topology, on every rank in the same order."""
    import torch.distributed as dist

    topo.group("pp")  # raises if this topology's groups were torn down
    if topo in _GROUPS:
        return _GROUPS[topo]
    pp = topo.axis("pp")
    axes = {"act": pp, "grad": pp, "tied": None}
    if dist.is_available() and dist.is_initialized() and pp.size > 1:
        for ranks in topo.layout.groups("pp"):  # collective: every group, every rank
            g = dist.new_group(ranks)
            if topo.rank in ranks:
                axes["grad"] = Axis("pp", pp.ranks, pp.index, g)
        for ranks in topo.layout.groups("pp"):
            ends = [ranks[0], ranks[-1]]
            g = dist.new_group(ends)
            if topo.rank in ends:
                axes["tied"] = Axis("pp", tuple(ends), ends.index(topo.rank), g)
    _GROUPS[topo] = axes
    return axes


class Pipeline:
    """Runs any valid schedule for real on this rank's stages.

    ``Pipeline(config, topo, "1f1b", microbatches=8)``; ``chunks=v`` with
    ``"interleaved"``; a :class:`Schedule` object works too. Every rank of the world
    constructs it together (it may create process groups). ``step(x, y)`` runs
    forward and backward of every microbatch of this data-parallel rank's batch and
    leaves the summed gradient of ``mean(loss_i)`` in ``.grad``; an optimizer then
    steps :meth:`parameters`.

    - Loss: microbatch ``i``'s mean cross-entropy ``L_i`` is back-propagated as
      ``L_i / m``, so the gradients are those of ``mean_i L_i``, which equals the
      mean over the whole batch because microbatches are equal in size.
    - Megatron's trick: once a stage output's send completes, its storage is freed
      unless backward saved it; ``backward(out, grad)`` needs only its shape.
    - Gradient sync only after the last microbatch: the tied embedding copy over
      the first and last stage, then data-parallel averaging over ``dp``.

    With ``dropout > 0`` each stage draws masks from its own process's RNG, so the
    numbers are no longer those of one process (the parity tests use dropout 0).

    Composition (:mod:`dtlab.parallelize`, chapter 07): ``stages`` hands in this
    rank's chunks ready-made (tensor-parallel stages, or stages wrapped by ZeRO), with
    ``loss_fn(out, targets)`` for the last one (default :meth:`StageModule.loss`),
    ``act_dtype`` for the activations on the wire (default: the first stage's
    parameter dtype) and ``seq_split`` (tp under sequence parallelism: each rank
    sends its ``T/t`` slice of the sequence).
    """

    def __init__(
        self,
        config: GPTConfig,
        topo,
        schedule: str | Schedule = "1f1b",
        *,
        microbatches: int | None = None,
        chunks: int = 1,
        seed: int = 0,
        stages: list[nn.Module] | None = None,
        loss_fn=None,
        act_dtype: torch.dtype | None = None,
        seq_split: int = 1,
    ):
        p = topo.size("pp")
        if isinstance(schedule, Schedule):
            if schedule.p != p:
                raise ValueError(f"schedule is for p={schedule.p}, the topology pp={p}")
            if microbatches not in (None, schedule.m) or chunks not in (1, schedule.v):
                raise ValueError("microbatches/chunks come from the Schedule object")
        else:
            if microbatches is None:
                raise ValueError("microbatches is required with a schedule name")
            topo.layout.validate(
                n_layers=config.n_layers,
                microbatches=microbatches,
                schedule=None if str(schedule).lower() == "gpipe" else str(schedule),
                chunks=chunks,
            )
            schedule = make_schedule(schedule, p, microbatches, chunks)
        self.schedule = validate(schedule)
        self.config, self.topo = config, topo
        self.rank = topo.coords["pp"]
        if stages is None:
            stages = build_stages(config, p, self.rank, schedule.v, seed)
        elif len(stages) != schedule.v:
            raise ValueError(f"need {schedule.v} stage chunks, got {len(stages)}")
        self.stages = list(stages)
        self.loss_fn = loss_fn or StageModule.loss
        self.act_dtype = act_dtype
        self.seq_split = seq_split
        self.axes = _pipeline_axes(topo)
        self.last_stats: dict = {}

    def parameters(self):
        for stage in self.stages:
            yield from stage.parameters()

    def named_parameters(self):
        """``(name in GPT, parameter)`` for this rank's chunks."""
        for stage in self.stages:
            yield from stage.global_named_parameters()

    def zero_grad(self) -> None:
        for param in self.parameters():
            param.grad = None

    # ---- one step ------------------------------------------------------------------
    def step(
        self, x: torch.Tensor, y: torch.Tensor, loss_scale: float = 1.0, sync=True
    ) -> dict:
        """Forward and backward of every microbatch of ``(x, y)``, this dp rank's
        ``(B, T)`` batch (every stage passes it; only the first reads ``x``, only
        the last ``y``). ``loss_scale`` multiplies the loss before backward (fp16's
        dynamic loss scaling, :mod:`dtlab.amp`); activations and gradients travel
        in the stages' own dtype. Returns ``{"loss"}`` (``mean_i L_i`` on the rank
        holding the head, ``None`` elsewhere) and what it measured on this rank: peak
        microbatch-chunks in flight, peak activation bytes saved for backward, bytes
        freed after sends. ``sync=False`` leaves the gradients unsynchronized
        (several flushes per optimizer step: call :meth:`sync_gradients` after the
        last)."""
        s, r = self.schedule, self.rank
        if x.shape[0] % s.m:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split into m={s.m} equal "
                "microbatches: make the batch size a multiple of m"
            )
        xs, ys = x.tensor_split(s.m), y.tensor_split(s.m)  # m x (b, T)
        b, T = xs[0].shape
        act_shape = (b, T // self.seq_split, self.config.d_model)
        # bf16/fp16 stages send 16 bits
        dtype = self.act_dtype or next(self.stages[0].parameters()).dtype
        rec = telemetry.current()
        replica = self.topo.coords["dp"]
        # the weights the stages compute with (inside a ZeRO wrapper too)
        params = [
            q
            for stage in self.stages
            for q in getattr(stage, "module", stage).parameters()
        ]
        st = _StepState(rec, r, replica)
        last_v = s.n_virtual - 1

        if self.axes["act"].size > 1:
            comm.barrier(self.axes["act"], tag="pp-step")  # a common time origin
        with rec.span("step", stage=r, replica=replica, schedule=s.name):
            for a in s.actions[r]:
                key, vs = (a.chunk, a.microbatch), s.vstage(r, a.chunk)
                if a.op in ("recv_act", "recv_grad"):
                    # (b, T, C), on the batch's device (nccl moves device tensors only)
                    buf = torch.empty(act_shape, dtype=dtype, device=x.device)
                    axis = self.axes[a.op[5:]]
                    work = comm.irecv(buf, a.peer, axis, tag=a.op[5:])
                    with st.span("idle", a):  # waiting is the bubble
                        work.wait()
                    if a.op == "recv_act":
                        st.inputs[key] = buf.requires_grad_()
                    else:
                        st.grads[key] = buf
                elif a.op == "send_act":
                    out = st.outputs[key]
                    work = comm.isend(out.detach(), a.peer, self.axes["act"], tag="act")
                    # Megatron's trick, only for a tensor no backward node saved
                    free = out.untyped_storage().data_ptr() not in st.saved_ptrs[key]
                    st.sends.append((work, out, free))
                elif a.op == "send_grad":
                    g = st.inputs.pop(key).grad  # (b, T, C)
                    work = comm.isend(g, a.peer, self.axes["grad"], tag="grad")
                    st.sends.append((work, g, False))
                elif a.op == "F":
                    inp = xs[a.microbatch] if vs == 0 else st.inputs[key]
                    with st.span("F", a), st.recording(key, params):
                        out = self.stages[a.chunk](inp)  # (b, T, C) or (b, T, V)
                        if vs == last_v:
                            loss = self.loss_fn(out, ys[a.microbatch])
                            st.losses.append(loss.detach())
                            if loss_scale != 1.0:
                                loss = loss * loss_scale
                            out = loss / s.m  # d(mean_i L_i) = sum_i d(L_i / m)
                    st.outputs[key] = out
                    st.note_memory(a)
                else:  # B or W
                    with st.span(a.op, a):
                        self._backward(a.op, key, st)
                    if a.op == ("W" if s.split_backward else "B"):
                        st.release(key)
                        st.note_memory(a)
                st.reap()
            st.reap(wait_all=True)
        if sync:
            self.sync_gradients()
        loss = torch.stack(st.losses).mean().item() if st.losses else None
        self.last_stats = {
            "loss": loss,
            "peak_in_flight": st.peak_n,
            "peak_activation_bytes": st.peak_bytes,
            "freed_bytes": st.freed,
        }
        return dict(self.last_stats)

    def _backward(self, op: str, key, st: _StepState) -> None:
        """``B`` without a split: the whole backward of this chunk. With a split
        (ZB-H1), ``B`` computes only the input's gradient, keeping the graph, and
        ``W`` the weights' gradients. (This ``W`` walks the chunk's graph again
        instead of reusing ``B``'s intermediate gradients as a production split
        does, so it costs about as much as ``B``: same numbers, less saving.)"""
        out, inp = st.outputs[key], st.inputs.get(key)
        grad = st.grads.get(key)  # None on the last virtual stage: out is the loss
        if not self.schedule.split_backward:
            torch.autograd.backward(out, grad)
        elif op == "B":
            if inp is not None:  # the first stage has no input gradient to send
                torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
        else:
            weights = [q for q in self.stages[key[0]].parameters() if q.requires_grad]
            torch.autograd.backward(out, grad, inputs=weights)

    def sync_gradients(self, data_parallel: bool = True) -> None:
        """After the last microbatch only: sum the tied embedding's two copies, then
        average over data-parallel replicas (one flat all-reduce;
        ``data_parallel=False`` leaves that to a data-parallel wrapper)."""
        tied = self.axes["tied"]
        if self.config.tied_head and tied is not None:
            for stage in self.stages:
                for name, q in stage.named_parameters():
                    if name in ("wte.weight", "head.weight") and q.grad is not None:
                        comm.all_reduce(q.grad, group=tied, tag="tied-embedding")
        dp = self.topo.axis("dp")
        if data_parallel and dp.size > 1:
            grads = [q.grad for q in self.parameters() if q.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group=dp, tag="dp-grads")
            flat /= dp.size
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))


class _StepState:
    """What one :meth:`Pipeline.step` holds between actions, and what it measures."""

    def __init__(self, rec, stage: int, replica: int):
        self.rec, self.stage, self.replica = rec, stage, replica
        self.inputs, self.outputs, self.grads = {}, {}, {}
        self.saved: dict[tuple, int] = {}  # (chunk, mb) -> activation bytes held
        self.saved_ptrs: dict[tuple, set] = {}
        self.sends: list = []  # (work, tensor, free when done)
        self.losses: list = []
        self.peak_n = self.peak_bytes = self.freed = 0

    def span(self, name, a):
        return self.rec.span(
            name,
            stage=self.stage,
            microbatch=a.microbatch,
            chunk=a.chunk,
            replica=self.replica,
        )

    @contextlib.contextmanager
    def recording(self, key, params):
        """Count the bytes autograd saves for backward (parameters excluded), each
        storage once: the activation memory this microbatch-chunk holds. Where
        the weights are is looked up again for an unknown storage (ZeRO-3 gathers
        a stage's weights into fresh memory before its forward)."""
        held: dict[int, int] = {}

        def pack(t):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in held and ptr not in {
                q.untyped_storage().data_ptr() for q in params
            }:
                held[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.saved[key] = sum(held.values())
        self.saved_ptrs[key] = set(held)

    def release(self, key) -> None:
        """The last backward pass of ``key`` ran: drop its graph and buffers."""
        del self.outputs[key]
        self.grads.pop(key, None)
        self.saved.pop(key)
        self.saved_ptrs.pop(key)

    def note_memory(self, a) -> None:
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
        """Finish completed sends (all of them if ``wait_all``) and free the stage
        outputs they carried: the next stage has its copy, and backward needs only
        the output's shape and graph."""
        for item in list(self.sends):
            work, tensor, free = item
            if wait_all:
                with self.rec.span(
                    "idle",
                    stage=self.stage,
                    microbatch=None,
                    chunk=None,
                    replica=self.replica,
                ):
                    work.wait()
            elif work.is_completed():
                work.wait()  # returns at once; closes the telemetry record
            else:
                continue
            self.sends.remove(item)
            if free:
                self.freed += tensor.untyped_storage().nbytes()
                tensor.untyped_storage().resize_(0)


# ---- measured timelines --------------------------------------------------------------
def measured_timeline(events, *, replica: int = 0, step: int | None = None) -> list:
    """Telemetry spans of one pipeline step (the last one unless ``step``), of one
    data-parallel replica, in :func:`simulate`'s format: times relative to each
    rank's step start (ranks align on the barrier that opens every step)."""
    spans = [
        e for e in events if e.get("kind") == "span" and e.get("replica", 0) == replica
    ]
    steps = [e for e in spans if e["name"] == "step"]
    if not steps:
        raise ValueError("no pipeline 'step' span in these events: record a step")
    n = max(e["step"] for e in steps) if step is None else step
    out = []
    for st in (e for e in steps if e["step"] == n):
        for e in spans:
            if e["rank"] != st["rank"] or e["name"] not in (*COMPUTE, "idle"):
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


# ---- training loop -------------------------------------------------------------------
def train_pipeline(
    config: GPTConfig,
    topo,
    *,
    steps: int,
    global_batch_size: int,
    schedule: str | Schedule = "1f1b",
    microbatches: int | None = None,
    chunks: int = 1,
    lr: float = 1e-3,
    seed: int = 0,
    data_seed: int = 0,
) -> list[dict]:
    """Train like :func:`dtlab.reference.train_reference`, pipelined: each dp
    replica takes its slice of ``SyntheticTokens(...).batch(step, B)``. Returns one
    record per step on every rank: ``{"step", "loss", ...}``, the loss sent from
    the last stage and averaged over replicas, and this rank's
    :meth:`Pipeline.step` measurements."""
    from dtlab.model import SyntheticTokens, shard_batch
    from dtlab.reference import make_optimizer

    pipe = Pipeline(
        config, topo, schedule, microbatches=microbatches, chunks=chunks, seed=seed
    )
    opt = make_optimizer(pipe.parameters(), lr)
    data = SyntheticTokens(config.vocab_size, config.seq_len, seed=data_seed)
    dp, pp = topo.axis("dp"), topo.axis("pp")
    records = []
    for n in range(steps):
        telemetry.current().step = n
        x, y = shard_batch(*data.batch(n, global_batch_size), dp.index, dp.size)
        opt.zero_grad(set_to_none=True)
        out = pipe.step(x, y)
        opt.step()
        loss = torch.tensor([out["loss"] if out["loss"] is not None else 0.0])
        if pp.size > 1:
            comm.broadcast(loss, src=pp.size - 1, group=pp, tag="loss")
        if dp.size > 1:
            comm.all_reduce(loss, group=dp, tag="loss")
            loss /= dp.size
        records.append({"step": n, **pipe.last_stats, "loss": loss.item()})
    return records

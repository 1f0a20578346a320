"""The one vocabulary: the names every part of dtlab agrees on.

What a run can be configured with (strategies, precisions, schedules, activation
checkpointing), what it records (event kinds and their fields, span names, memory
categories), written once. The library, the estimates, the widgets and the figures
import these instead of spelling the strings again, so a name cannot mean two things
in two modules.

Events are flat dicts with a ``kind`` (telemetry's JSONL files and ipyparallel's
data publication carry them as they are); :class:`Kind` is a ``str`` enum, so
``event["kind"] == Kind.COMM`` holds for an event read back from JSON, and the
``TypedDict`` classes below say which fields each kind carries.
"""

from __future__ import annotations

from enum import Enum
from typing import TypedDict

__all__ = [
    "Kind",
    "Span",
    "CommEvent",
    "SpanEvent",
    "MemoryEvent",
    "StepEvent",
    "MoEEvent",
    "STRATEGIES",
    "zero_stage",
    "PRECISIONS",
    "STATE_PRECISIONS",
    "state_precision",
    "SCHEDULES",
    "schedule_name",
    "V_SCHEDULES",
    "SPLIT_BACKWARD",
    "CHECKPOINTING",
    "CP_VARIANTS",
    "MEMORY_CATEGORIES",
    "HOST_CATEGORIES",
    "STATE_CATEGORIES",
    "COLLECTIVES",
    "check_collective",
    "wire_bytes",
]


# ---- what a run is configured with ---------------------------------------------------
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
"""What runs over the data-parallel axis: DDP (chapter 02) or a ZeRO stage (03)."""


def zero_stage(strategy: str) -> int | None:
    """The ZeRO stage of a strategy name (``"zero2"`` -> 2), ``None`` for DDP."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: expected one of {STRATEGIES}")
    return int(strategy[-1]) if strategy.startswith("zero") else None


PRECISIONS = ("fp32", "bf16", "fp16")
"""What a run computes in (chapter 06). bf16 and fp16 keep fp32 master weights;
fp16 adds the dynamic loss scaler."""

STATE_PRECISIONS = ("fp32", "mixed", "pure_bf16")
"""How model states are stored, for the estimates (ZeRO §3): everything fp32;
``mixed``, 16-bit weights and gradients with an fp32 master copy (what a bf16 or
fp16 run keeps); ``pure_bf16``, everything bf16 and no master copy."""

_STATE_ALIASES = {
    "bf16": "mixed",
    "fp16": "mixed",
    "amp": "mixed",
    "bf16-mixed": "mixed",
    "fp16-mixed": "mixed",
    "pure-bf16": "pure_bf16",
}


def state_precision(precision: str) -> str:
    """The storage regime of a precision name: a run's precision (``bf16`` ->
    ``mixed``) or a regime already (``mixed``, ``pure_bf16``, ``fp32``)."""
    key = str(precision).lower()
    key = _STATE_ALIASES.get(key, key)
    if key not in STATE_PRECISIONS:
        raise ValueError(
            f"unknown precision {precision!r}: expected one of "
            f"{PRECISIONS + STATE_PRECISIONS[1:]}"
        )
    return key


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zb_v", "dualpipe_v")
"""Pipeline schedules (chapter 05), spelled as configs and :mod:`dtlab.pipeline`
spell them."""

_SCHEDULE_ALIASES = {
    "zb-h1": "zb_h1",
    "zbh1": "zb_h1",
    "interleaved-1f1b": "interleaved",
    "interleaved_1f1b": "interleaved",
    "zb-v": "zb_v",
    "zbv": "zb_v",
    "dualpipev": "dualpipe_v",
    "dualpipe-v": "dualpipe_v",
}


V_SCHEDULES = ("zb_v", "dualpipe_v")
"""Schedules that hold two chunks per rank in a V: rank r runs stages r and
2p-1-r, so the first and the last stage (and the loss) sit on rank 0."""

SPLIT_BACKWARD = ("zb_h1", "zb_v", "dualpipe_v")
"""Schedules whose backward splits into B (input gradient) and W (weights)."""


def schedule_name(schedule: str) -> str:
    """The canonical name of a schedule (``"ZB-H1"`` -> ``"zb_h1"``)."""
    key = str(schedule).lower()
    key = _SCHEDULE_ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {SCHEDULES}")
    return key


CP_VARIANTS = ("ring", "ulysses")
"""Context parallelism's attention (chapter 11): K/V blocks round a ring, or two
all-to-alls from sequence shards to head shards and back."""

CHECKPOINTING = ("none", "selective", "full")
"""Activation checkpointing (chapter 08): none, the attention core, whole blocks."""


# ---- what a run records --------------------------------------------------------------
class _Name(str, Enum):
    """A name that is its string: equal to it, printed as it, written to JSON as it."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Kind(_Name):
    """The ``kind`` of a telemetry event."""

    COMM = "comm"  # one collective or p2p call (dtlab.comm)
    SPAN = "span"  # a stretch of compute or waiting (Span names it)
    MEMORY = "memory"  # bytes held by category (dtlab.memory)
    STEP = "step"  # one optimizer step's record (dtlab.train)
    DDP_BUCKET = "ddp_bucket"  # one DDP bucket's launch and completion
    AMP = "amp"  # the loss scale after a step, and whether it was skipped
    CONTROL = "control"  # the lab's Run/Stop handshake
    MOE = "moe"  # one MoE layer's routing: tokens per expert, drops (dtlab.moe)


class Span(_Name):
    """Names of compute spans: the pipeline's F, B and W (ZB-H1 splits B into the
    input gradient B and the weight gradient W), the optimizer step, waiting, and a
    whole pipeline step."""

    F = "F"
    B = "B"
    W = "W"
    OPT = "opt"
    IDLE = "idle"
    STEP = "step"


MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")
"""What a rank holds on its device (dtlab.memory counts each storage once)."""

HOST_CATEGORIES = ("host_params", "host_grads", "host_optimizer")
"""What ZeRO-Offload keeps on the host instead."""

STATE_CATEGORIES = ("params", "grads", "optimizer", "buffers", *HOST_CATEGORIES)
"""The categories of model state (everything but activations)."""


# ---- what crosses ranks --------------------------------------------------------------
COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "all_to_all",
    "send",
    "recv",
    "barrier",
)
"""The operations :mod:`dtlab.comm` records (the ``op`` of a :class:`CommEvent`)."""


def check_collective(op: str, payload_bytes: float, n: int) -> None:
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: expected one of {COLLECTIVES}")
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"n (ranks in the group) must be a positive integer, got {n!r}"
        )


def wire_bytes(op: str, payload_bytes: float, n: int) -> float:
    """Bytes that *this* rank sends for one collective over ``n`` ranks, under the ring
    algorithm. ``payload_bytes`` S is the full tensor: the all-reduce buffer, the
    reduce-scatter *input*, the all-gather *output*.

    - all_reduce: ``2(N-1)/N · S`` (a reduce-scatter, then an all-gather)
    - reduce_scatter, all_gather, all_to_all: ``(N-1)/N · S``
    - broadcast, reduce: ``S`` (pipelined along a chain; the last rank sends nothing,
      this is the busiest rank's count)
    - send: ``S``; recv: ``0`` (the sender counts it); barrier: ``0``

    Within one group (``n == 1``) nothing crosses ranks, so every op gives 0 except a
    point-to-point send.
    """
    check_collective(op, payload_bytes, n)
    S = payload_bytes
    if op == "send":
        return float(S)
    if op in ("recv", "barrier") or n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * S
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n * S
    return float(S)  # broadcast, reduce


class CommEvent(TypedDict):
    kind: str  # Kind.COMM
    rank: int
    step: int
    op: str  # all_reduce, reduce_scatter, all_gather, all_to_all, send, recv, ...
    axis: str | None  # dp, tp, pp, ... or None for the world
    dtype: str
    numel: int
    payload_bytes: int
    wire_bytes: float  # what this rank sends under the ring algorithm: wire_bytes()
    t_start: float
    t_end: float
    tag: str | None
    # an all_to_all also carries ``send_bytes``: its row of the all-to-all matrix


class SpanEvent(TypedDict, total=False):
    kind: str  # Kind.SPAN
    rank: int
    step: int
    name: str  # a Span
    stage: int
    microbatch: int | None
    t_start: float
    t_end: float


class MemoryEvent(TypedDict, total=False):
    kind: str  # Kind.MEMORY
    rank: int
    step: int
    phase: str  # forward, backward, step, ...
    t: float
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    peak: int


class StepEvent(TypedDict, total=False):
    kind: str  # Kind.STEP
    rank: int
    step: int
    strategy: str
    loss: float  # mean over the global batch: what the reference computes
    local_loss: float
    grad_norm: float
    lr: float
    tokens: int
    time_s: float
    tokens_per_s: float
    coords: dict


class MoEEvent(TypedDict, total=False):
    kind: str  # Kind.MOE
    rank: int
    step: int
    layer: str  # the MoE module's name (blocks.0.mlp)
    routed: list[int]  # this rank's token assignments per expert, before capacity
    tokens_per_expert: list[int]  # ... those kept (at most ``capacity`` each)
    dropped: int  # assignments over capacity: the token skips that expert
    capacity: int
    send_bytes: list[int]  # expert parallelism: bytes dispatched to each ep rank

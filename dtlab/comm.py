"""Every byte that crosses ranks goes through here, and is recorded.

Taught in chapter 01 (collectives and the ring all-reduce).

Each function wraps one ``torch.distributed`` call and, when a telemetry recorder is
active (:func:`dtlab.telemetry.current`), records::

    {rank, op, axis, dtype, numel, payload_bytes, wire_bytes, t_start, t_end, step, tag}

``payload_bytes`` is the size of the logical tensor the op is about (for all-gather
and reduce-scatter: the *full*, unsharded tensor). ``wire_bytes`` is what this rank
sends under the ring algorithm (:func:`dtlab.events.wire_bytes`): all-reduce
``2(N-1)/N·S``, reduce-scatter and all-gather ``(N-1)/N·S``, broadcast and send ``S``,
receive 0; all-to-all: every piece but the one a rank keeps, ``(N-1)/N·S`` for
equal pieces. Dividing wire bytes by time gives the *bus bandwidth* the way nccl-tests
reports it, a number that does not depend on N and can be compared with the link.

``group`` may be an :class:`dtlab.topology.Axis` (its name is recorded as the axis),
a raw process group (axis ``"group"``), or ``None`` (the default group, axis
``"world"``). ``async_op=True`` returns a handle whose ``wait()`` closes the record.

:func:`ring_all_reduce` builds an all-reduce from send/recv alone — reduce-scatter
phase, then all-gather phase, ``2(N-1)`` steps — so its traffic is real traffic.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist

from dtlab import opwatch, telemetry
from dtlab.events import Kind
from dtlab.events import wire_bytes as _wire_bytes
from dtlab.opwatch import (  # what each rank is doing, read through comm too
    current_op,
    describe_op,
    forget_ops,
    unwatch,
    watch,
)

__all__ = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "barrier",
    "all_to_all_single",
    "all_to_all",
    "send",
    "recv",
    "isend",
    "irecv",
    "ring_all_reduce",
    "group_size",
    "group_rank",
    "global_rank",
    "current_op",
    "describe_op",
    "forget_ops",
    "watch",
    "unwatch",
]

ReduceOp = dist.ReduceOp


# ---- plumbing ---------------------------------------------------------------------
def _resolve(group):
    """(process group, axis name) for an Axis, a process group or None."""
    if group is None:
        return None, "world"
    if hasattr(group, "ranks") and hasattr(group, "name"):  # a topology Axis
        return group.group, group.name
    return group, "group"


def group_size(group=None) -> int:
    if hasattr(group, "ranks") and hasattr(group, "size"):  # an Axis knows (even
        return group.size  # one of a single rank, whose group is None)
    pg, _ = _resolve(group)
    return dist.get_world_size(pg)


def group_rank(group=None) -> int:
    if hasattr(group, "ranks") and hasattr(group, "index"):
        return group.index
    pg, _ = _resolve(group)
    return dist.get_rank(pg)


def global_rank(group, group_rank_: int) -> int:
    """The global rank of the ``group_rank_``-th member of ``group``."""
    pg, _ = _resolve(group)
    if pg is None:
        return group_rank_
    return dist.get_global_rank(pg, group_rank_)


class _Once:
    """Calls ``fn`` the first time it is called, never again (thread-safe)."""

    def __init__(self, fn):
        self._fn = fn
        self._lock = threading.Lock()

    def __call__(self, *_):
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _Recorded:
    """An async work handle whose event is recorded when the operation completes
    (through the work's future, so ``t_end`` is the completion time, not the time
    someone waited), or at ``wait()`` where the backend gives no future."""

    def __init__(self, work, finish, entry=None):
        self._work = work
        self._entry = entry
        self._record = _Once(finish)
        try:
            # the callback holds only the recording, never the work: a future whose
            # callback reaches its own Work is a reference cycle through C++ that
            # Python cannot collect, and a leaked gloo Work keeps its sockets open
            work.get_future().add_done_callback(self._record)
        except (AttributeError, RuntimeError):  # e.g. p2p work without a future
            pass

    def wait(self, timeout=None):
        if self._entry is not None:
            opwatch.enter(self._entry)  # blocked here, so this is the op to report
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)
        if self._entry is not None:
            opwatch.leave(self._entry)
        self._record()
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self):
        return opwatch.watched_future(self._work.get_future(), self._entry)


class _Waiting:
    """An async work handle that only marks its ``wait()`` as the current op (no
    recorder is active); anything else goes to the torch work itself."""

    __slots__ = ("_work", "_entry")

    def __init__(self, work, entry):
        self._work = work
        self._entry = entry

    def wait(self, timeout=None):
        opwatch.enter(self._entry)
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        opwatch.leave(self._entry)
        return done

    def get_future(self):
        return opwatch.watched_future(self._work.get_future(), self._entry)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _call(
    op, tensor_for_bytes, n, group_axis, async_op, tag, run, peer=None, extra=None
):
    """Run ``run()`` (the torch call) and record one comm event around it;
    ``tensor_for_bytes`` is the tensor whose size is the op's payload. A
    point-to-point event also carries ``peer``, the other side's global rank;
    ``extra``, fields of one op's own (an all-to-all's row and exact wire bytes)."""
    rec = telemetry.current()
    entry = opwatch.entry(op, tensor_for_bytes, group_axis, tag)
    t_start = rec.now() if rec.enabled else 0.0
    opwatch.enter(entry)
    work = run()  # an exception leaves ``entry`` as the current op, on purpose
    opwatch.leave(entry)
    if not rec.enabled:
        return _Waiting(work, entry) if async_op else work
    numel = tensor_for_bytes.numel()
    nbytes = numel * tensor_for_bytes.element_size()
    fields = {"wire_bytes": _wire_bytes(op, nbytes, n), **(extra or {})}
    if peer is not None:
        fields["peer"] = peer

    def finish():
        rec.emit(
            Kind.COMM,
            op=op,
            axis=group_axis,
            dtype=str(tensor_for_bytes.dtype).replace("torch.", ""),
            numel=numel,
            payload_bytes=nbytes,
            t_start=t_start,
            t_end=rec.now(),
            tag=tag,
            **fields,
        )

    if async_op:
        return _Recorded(work, finish, entry)
    finish()
    return work


# ---- collectives ------------------------------------------------------------------
def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, async_op=False, tag=None):
    """In place: every rank ends with the reduction (default sum) of all ranks'
    ``tensor``."""
    pg, axis = _resolve(group)
    n = dist.get_world_size(pg)
    return _call(
        "all_reduce",
        tensor,
        n,
        axis,
        async_op,
        tag,
        lambda: dist.all_reduce(tensor, op=op, group=pg, async_op=async_op),
    )


# torch 2.13 renamed reduce_scatter_tensor and all_gather_into_tensor (both now
# deprecated, with a warning per call) to *_single; older torch has only the old
# names. Looked up at each call, so a test that patches torch.distributed sees it.
def _reduce_scatter_single(*args, **kwargs):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


def _all_gather_single(*args, **kwargs):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def reduce_scatter(
    output, input, op=ReduceOp.SUM, group=None, *, async_op=False, tag=None
):
    """``input`` (the full tensor, N equal slices along dim 0) is reduced across ranks;
    rank i receives slice i in ``output``."""
    pg, axis = _resolve(group)
    n = dist.get_world_size(pg)
    if input.numel() != output.numel() * n:
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected "
            f"{n} x output ({output.numel()})"
        )
    return _call(
        "reduce_scatter",
        input,
        n,
        axis,
        async_op,
        tag,
        lambda: _reduce_scatter_single(
            output, input, op=op, group=pg, async_op=async_op
        ),
    )


def all_gather(
    output, input, group=None, *, async_op=False, tag=None, check_sizes=None
):
    """Every rank's ``input`` concatenated along dim 0 into ``output`` on every rank.
    ``check_sizes``: first check (one small all-gather) that every rank gives as many
    elements, where gloo would hang or abort; ``None``: for blocking calls from
    outside dtlab's library (the library's own agree by construction)."""
    pg, axis = _resolve(group)
    n = dist.get_world_size(pg)
    if output.numel() != input.numel() * n:
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected "
            f"{n} x input ({input.numel()})"
        )
    if check_sizes is None:  # a notebook, an exercise, a test: not dtlab's library
        caller = sys._getframe(1).f_globals.get("__name__", "")
        library = caller.startswith("dtlab.") and not caller.startswith("dtlab.exer")
        check_sizes = not async_op and not library

    def run():  # inside the op's record: a rank stuck in the check shows this op
        if check_sizes and n > 1:
            _same_size_everywhere("all_gather", input, pg)
        return _all_gather_single(output, input, group=pg, async_op=async_op)

    return _call("all_gather", output, n, axis, async_op, tag, run)


def _same_size_everywhere(op: str, input, pg) -> None:
    """Raise on every rank alike if the ranks' ``input`` sizes differ (gloo does not
    check: a rank sent less than expected waits forever, one sent more aborts)."""
    mine = torch.tensor([input.numel()], dtype=torch.int64, device=input.device)
    every = mine.new_empty(dist.get_world_size(pg))
    _all_gather_single(every, mine, group=pg)
    sizes = every.tolist()
    if len(set(sizes)) > 1:
        told = ", ".join(f"rank {r}: {k}" for r, k in enumerate(sizes))
        raise ValueError(
            f"{op}: the ranks give inputs of different sizes ({told} elements); "
            "every rank must give the same number (a sharded parameter's local "
            "pieces differ in size from rank to rank: pad them, or gather the "
            "whole slices they are cut from)"
        )


def broadcast(tensor, src: int = 0, group=None, *, async_op=False, tag=None):
    """``tensor`` of group rank ``src`` is copied to every rank of the group."""
    pg, axis = _resolve(group)
    n = dist.get_world_size(pg)
    src_global = global_rank(group, src)
    return _call(
        "broadcast",
        tensor,
        n,
        axis,
        async_op,
        tag,
        lambda: dist.broadcast(tensor, src=src_global, group=pg, async_op=async_op),
    )


def barrier(group=None, *, tag=None):
    pg, axis = _resolve(group)
    rec = telemetry.current()
    t_start = rec.now() if rec.enabled else 0.0
    entry = opwatch.entry("barrier", None, axis, tag)
    opwatch.enter(entry)
    dist.barrier(group=pg)
    opwatch.leave(entry)
    if rec.enabled:
        rec.emit(
            Kind.COMM,
            op="barrier",
            axis=axis,
            dtype=None,
            numel=0,
            payload_bytes=0,
            wire_bytes=0,
            t_start=t_start,
            t_end=rec.now(),
            tag=tag,
        )


# ---- all-to-all -------------------------------------------------------------------
def _a2a_fields(send_bytes, me):
    """An all-to-all's row of the all-to-all matrix (bytes to each group rank, itself
    included) and its wire bytes: all but the piece it keeps (equal: (N-1)/N·S)."""
    wire = float(sum(send_bytes) - send_bytes[me])
    return {"send_bytes": send_bytes, "wire_bytes": wire}


def all_to_all_single(
    output,
    input,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    *,
    async_op=False,
    tag=None,
):
    """Rank i cuts ``input`` along dim 0 into N pieces (equal, or
    ``input_split_sizes[j]`` rows for rank j) and sends piece j to rank j; piece i of
    rank j's ``output`` is what rank i sent it. The transpose of a matrix of pieces:
    Ulysses' sequence-to-heads exchange and expert parallelism's dispatch (chapter
    11). The event's ``send_bytes`` is this rank's row of the all-to-all matrix."""
    pg, axis = _resolve(group)
    n, me = dist.get_world_size(pg), dist.get_rank(pg)
    rows = input.shape[0] if input.dim() else 0
    splits = input_split_sizes or ([rows // n] * n if rows % n == 0 else None)
    if splits is None or len(splits) != n or sum(splits) != rows:
        how = "equally" if input_split_sizes is None else f"as {input_split_sizes}"
        raise ValueError(
            f"all_to_all_single: cannot cut {rows} input rows into {n} pieces {how}:"
            f" give {n} input_split_sizes that add up to {rows}"
        )
    row_bytes = input[0].numel() * input.element_size() if rows else 0
    sizes = (output_split_sizes, input_split_sizes)

    def run():
        return dist.all_to_all_single(output, input, *sizes, pg, async_op)

    fields = _a2a_fields([int(r) * row_bytes for r in splits], me)
    return _call("all_to_all", input, n, axis, async_op, tag, run, extra=fields)


def all_to_all(output_list, input_list, group=None, *, async_op=False, tag=None):
    """``input_list[j]`` of rank i lands in ``output_list[i]`` of rank j: the list
    form of :func:`all_to_all_single` (gloo wants every piece the same size)."""
    pg, axis = _resolve(group)
    n, me = dist.get_world_size(pg), dist.get_rank(pg)
    if len(input_list) != n or len(output_list) != n:
        raise ValueError(f"all_to_all: give one input and one output per rank ({n})")
    # a stand-in for the whole payload: the event's numel, dtype and bytes
    numel = sum(t.numel() for t in input_list)
    payload = torch.empty(numel, dtype=input_list[0].dtype, device="meta")
    fields = _a2a_fields([t.numel() * t.element_size() for t in input_list], me)
    run = lambda: dist.all_to_all(output_list, input_list, pg, async_op)  # noqa: E731
    return _call("all_to_all", payload, n, axis, async_op, tag, run, extra=fields)


# ---- point to point ---------------------------------------------------------------
def _p2p(op, torch_fn, tensor, peer, group, async_op, tag):
    """``torch_fn(tensor, global peer, group)`` recorded as ``op`` (a send counts its
    bytes on the wire; a receive counts none: the sender did)."""
    pg, axis = _resolve(group)
    to = global_rank(group, peer)
    run = lambda: torch_fn(tensor, to, pg)  # noqa: E731
    return _call(op, tensor, 2, axis, async_op, tag, run, peer=to)


def send(tensor, dst: int, group=None, *, tag=None):
    """Blocking send to group rank ``dst``."""
    return _p2p("send", lambda t, r, g: dist.send(t, dst=r, group=g), tensor, dst,
                group, False, tag)  # fmt: skip


def recv(tensor, src: int, group=None, *, tag=None):
    """Blocking receive into ``tensor`` from group rank ``src``."""
    return _p2p("recv", lambda t, r, g: dist.recv(t, src=r, group=g), tensor, src,
                group, False, tag)  # fmt: skip


def isend(tensor, dst: int, group=None, *, tag=None):
    """Non-blocking send; call ``.wait()`` on the handle."""
    return _p2p("send", lambda t, r, g: dist.isend(t, dst=r, group=g), tensor, dst,
                group, True, tag)  # fmt: skip


def irecv(tensor, src: int, group=None, *, tag=None):
    """Non-blocking receive; call ``.wait()`` on the handle."""
    return _p2p("recv", lambda t, r, g: dist.irecv(t, src=r, group=g), tensor, src,
                group, True, tag)  # fmt: skip


# ---- the ring all-reduce, from send/recv ------------------------------------------
def ring_all_reduce(tensor, group=None, *, tag="ring"):
    """Sum ``tensor`` over the group in place with the ring algorithm (chapter 01).

    The tensor is cut into N chunks. Ranks form a ring, each sending to ``r+1`` and
    receiving from ``r-1``.

    - *Reduce-scatter phase* (N-1 steps): at step s rank r sends chunk ``r-s`` and
      adds the chunk it receives into chunk ``r-s-1``. Afterwards rank r holds the
      full sum of chunk ``r+1``.
    - *All-gather phase* (N-1 steps): the finished chunks travel once more round the
      ring, each rank overwriting its copy.

    Every rank sends ``2(N-1)`` chunks of ``S/N`` bytes: ``2(N-1)/N·S``, independent
    of N for large N — why the ring is bandwidth-optimal.
    """
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor")
    n = group_size(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    r = group_rank(group)
    right, left = (r + 1) % n, (r - 1) % n
    flat = tensor.view(-1)  # shares storage: chunks below are views into tensor
    chunks = list(torch.tensor_split(flat, n))
    incoming = torch.empty_like(chunks[0])  # tensor_split puts the largest first

    def exchange(send_idx, recv_idx):
        out = chunks[send_idx]
        buf = incoming[: chunks[recv_idx].numel()]
        # post the receive and the send together: blocking send then recv on every
        # rank at once would be fine for small tensors but may deadlock for large
        # ones on some transports
        reqs = [
            isend(out.contiguous(), right, group, tag=tag),
            irecv(buf, left, group, tag=tag),
        ]
        for q in reqs:
            q.wait()
        return buf

    for s in range(n - 1):  # reduce-scatter phase
        buf = exchange((r - s) % n, (r - s - 1) % n)
        chunks[(r - s - 1) % n].add_(buf)
    for s in range(n - 1):  # all-gather phase
        buf = exchange((r + 1 - s) % n, (r - s) % n)
        chunks[(r - s) % n].copy_(buf)
    return tensor

"""The bytes a framework sends, counted where every framework's bytes pass: the
``c10d`` operators of torch.distributed.

Taught in chapters 02 and 03 ("from dtlab to the real thing"). dtlab's own
collectives are recorded by :mod:`dtlab.comm`; torch's DDP reducer, FSDP2 and
DeepSpeed call torch.distributed directly, so dtlab's recorder never sees them.
They all end in the same dispatcher operators (``c10d.allreduce_``,
``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``c10d.broadcast_``,
...), and a ``TorchDispatchMode`` (torch keeps the class in
``torch.utils._python_dispatch``; its own ``CommDebugMode`` is one) sees each one
on its way to gloo, with its tensors and its process group.
:class:`CollectiveCounter` records them in :mod:`dtlab.comm`'s units: the payload
S is the all-reduce buffer, the reduce-scatter *input* and the all-gather
*output*; the wire bytes are what this rank sends under the ring algorithm
(:func:`dtlab.estimate.wire_bytes`). Run dtlab's trainer under the same counter
and the two frameworks are measured with one yardstick.

Dispatch modes are thread-local: a collective issued from another thread is not
seen. On CPU, autograd runs backward (and DDP's hooks, which all-reduce from
inside it) on the thread that called ``backward()``, so nothing is missed here.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dtlab.estimate import wire_bytes

__all__ = ["C10D_OPS", "CollectiveCounter"]

# c10d operator -> (dtlab.comm's name, which tensor argument is the payload S)
C10D_OPS = {
    "allreduce_": ("all_reduce", "all"),
    "allreduce_coalesced_": ("all_reduce", "all"),
    "_allgather_base_": ("all_gather", 0),  # (output, input, ...): S = output
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),  # (output, input, ...): S = input
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", "all"),
    "reduce_": ("reduce", "all"),
    "barrier": ("barrier", "all"),
    "send": ("send", "all"),
    "recv_": ("recv", "all"),
}


def _tensors(arg) -> list[torch.Tensor]:
    """The tensors in one operator argument (a tensor or a nested list of them)."""
    if torch.is_tensor(arg):
        return [arg]
    if isinstance(arg, list | tuple):
        return [t for a in arg for t in _tensors(a)]
    return []


def _group_size(args) -> int:
    """The size of the process group among an operator's arguments. The dispatcher
    hands it over boxed (a ``torch.ScriptObject``, like the ``ReduceOp`` beside it);
    ``ProcessGroup.unbox`` takes back the one that is a group."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).size()
            except RuntimeError:  # another boxed argument (a ReduceOp)
                continue
    raise ValueError("a c10d collective without a process group argument")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CollectiveCounter(TorchDispatchMode):
    """Record every torch.distributed collective issued inside ``with counter:``.

    Each record is ``{"op", "c10d", "dtype", "payload_bytes", "wire_bytes",
    "group_size", "step"}``; ``step`` is whatever :attr:`step` was when the
    collective ran (a training loop sets it), so :meth:`per_step` can leave out
    what only the first step sends (DDP's bucket rebuild, DeepSpeed's broadcasts).
    """

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []
        self.step = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = str(func.overloadpacket).partition(".")
        if namespace == "c10d" and name in C10D_OPS:
            self._record(name, args)
        return func(*args, **kwargs)

    def _record(self, name: str, args) -> None:
        op, payload = C10D_OPS[name]
        n = _group_size(args)
        if payload == "all":
            tensors = [t for a in args for t in _tensors(a)]
        else:
            tensors = _tensors(args[payload])
        S = _nbytes(tensors)
        self.records.append(
            {
                "op": op,
                "c10d": name,
                "dtype": str(tensors[0].dtype).removeprefix("torch.")
                if tensors
                else None,
                "payload_bytes": S,
                "wire_bytes": wire_bytes(op, S, n),
                "group_size": n,
                "step": self.step,
            }
        )

    def per_step(self, step: int | None = None) -> dict[str, dict[str, float]]:
        """``{op: {"calls", "payload_bytes", "wire_bytes"}}`` of one ``step`` (all
        steps when ``None``)."""
        out: dict[str, dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "payload_bytes": 0, "wire_bytes": 0.0}
        )
        for r in self.records:
            if step is None or r["step"] == step:
                row = out[r["op"]]
                row["calls"] += 1
                row["payload_bytes"] += r["payload_bytes"]
                row["wire_bytes"] += r["wire_bytes"]
        return dict(out)

    def wire_bytes(self, step: int | None = None) -> float:
        """What this rank sent in ``step`` (all steps when ``None``)."""
        return sum(row["wire_bytes"] for row in self.per_step(step).values())

"""Python objects between ranks, as bytes through :mod:`dtlab.comm`, so that every
byte is recorded like any tensor's (torch's ``send_object_list`` and
``all_gather_object`` would bypass the records).

A replica that lost its state gets it from one that holds it: chapter 08's
replaced engine (:mod:`dtlab.lab.engine.replica`) and chapter 13's healed replica
(:mod:`dtlab.ft.quorum`). An object travels as its ``torch.save`` bytes (tensors
inside it included), the size first. Headless runs gather every rank's event log
(:mod:`dtlab.run`) and resharding checkpoints every rank's index
(:mod:`dtlab.reshard.save`) through the same :func:`all_gather_bytes`.
"""

from __future__ import annotations

import io

import torch

from dtlab import comm

__all__ = [
    "to_bytes",
    "from_bytes",
    "send_object",
    "recv_object",
    "all_gather_bytes",
    "all_gather_objects",
]


def to_bytes(obj) -> torch.Tensor:
    """``obj``'s ``torch.save`` bytes, as a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(payload: torch.Tensor):
    """The object :func:`to_bytes` turned into ``payload``."""
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=False)


def send_object(obj, dst: int, group=None, *, device=None, tag=None) -> int:
    """Send ``obj`` to group rank ``dst`` (its size, then its bytes; ``device``:
    where the backend wants tensors, the CPU for gloo). Returns the payload bytes."""
    payload = to_bytes(obj)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    comm.send(size, dst, group, tag=tag)
    comm.send(payload.to(device), dst, group, tag=tag)
    return payload.numel()


def recv_object(src: int, group=None, *, device=None, tag=None):
    """The object group rank ``src`` sent with :func:`send_object`, and its payload
    bytes: ``(obj, nbytes)``."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    comm.recv(size, src, group, tag=tag)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    comm.recv(payload, src, group, tag=tag)
    return from_bytes(payload), payload.numel()


def all_gather_bytes(data: bytes, group=None, *, device=None, tag=None) -> list:
    """Every rank's ``data``, in group-rank order: the lengths first, then the bytes
    padded to the longest (two all-gathers of uint8 through :mod:`dtlab.comm`)."""
    n = comm.group_size(group)
    sizes = torch.empty(n, dtype=torch.int64, device=device)
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.all_gather(sizes, mine, group, tag=tag)
    sizes = sizes.tolist()
    width = max(max(sizes), 1)
    padded = torch.zeros(width, dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(n * width, dtype=torch.uint8, device=device)
    comm.all_gather(out, padded.to(device), group, tag=tag)
    rows = out.cpu().view(n, width)
    return [rows[r, : sizes[r]].numpy().tobytes() for r in range(n)]


def all_gather_objects(obj, group=None, *, device=None, tag=None) -> list:
    """Every rank's ``obj``, in group-rank order, as :func:`all_gather_bytes` of
    their ``torch.save`` bytes (meant for small objects: a random state, a record)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return [
        torch.load(io.BytesIO(data), weights_only=False)
        for data in all_gather_bytes(buffer.getvalue(), group, device=device, tag=tag)
    ]

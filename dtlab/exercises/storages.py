"""What memory a learner's code really keeps alive: storages, followed by weak
reference.

Used by the checkers that judge memory (chapter 03's ZeRO stages, chapter 05's
pipeline executor). A tensor is a window on a *storage*; a slice or a view of a
larger buffer keeps the whole buffer allocated, however few elements it shows, and
a tensor object may die while its storage lives on in a view, a detached copy of
it, or an autograd graph. So a checker does not count tensor objects, nor the
``.grad`` fields it can see: it follows the storages themselves. PyTorch keeps a
storage's Python object alive exactly as long as the storage, so a weak reference
to it says whether the memory is still held, by anyone::

    held = Storages(exclude=model.parameters())  # weights are not what is judged
    held.track(param.grad, "gradient", index)    # whenever the learner's code sees one
    ...
    held.bytes()                                  # what is still allocated now
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["Storage", "Storages", "storage_elements"]


@dataclass
class Storage:
    """One storage followed: its weak reference, its bytes when first seen
    (``size``), what it was seen as (``kinds``, in the order first seen) and who it
    belongs to (``owner``: a parameter's index, a microbatch; ``None`` until
    known)."""

    ref: weakref.ref
    size: int  # bytes when first seen
    kinds: list[str] = field(default_factory=list)
    owner: object = None

    @property
    def alive(self) -> bool:
        return self.ref() is not None

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (0 once freed, or resized to nothing)."""
        s = self.ref()
        return 0 if s is None else s.nbytes()


def storage_elements(t: torch.Tensor) -> int:
    """How many elements of ``t``'s dtype its whole storage holds (a view counts
    the buffer it is a view of)."""
    return t.untyped_storage().nbytes() // t.element_size()


class Storages:
    """The storages of every tensor :meth:`track` was given, each counted once
    however many tensors (views, slices, detached copies) share it.

    ``exclude``: tensors whose storages are never counted (the weights, buffers
    the checker itself owns)."""

    def __init__(self, exclude=()):
        self._excluded = [weakref.ref(t.untyped_storage()) for t in exclude]
        self._by_ptr: dict[int, Storage] = {}
        self.seen: list[Storage] = []  # every storage ever tracked, in order

    def _is_excluded(self, s) -> bool:
        return any(ref() is s for ref in self._excluded)

    def track(self, t, kind: str, owner=None) -> Storage | None:
        """Follow ``t``'s storage, seen as ``kind`` (of ``owner``); returns its
        record (``None`` for no tensor, an excluded or an empty storage)."""
        if not torch.is_tensor(t):
            return None
        s = t.untyped_storage()
        if s.nbytes() == 0 or self._is_excluded(s):
            return None
        rec = self._by_ptr.get(s.data_ptr())
        if rec is None or rec.ref() is not s:  # new, or the address was reused
            rec = Storage(weakref.ref(s), s.nbytes())
            self._by_ptr[s.data_ptr()] = rec
            self.seen.append(rec)
        if kind not in rec.kinds:
            rec.kinds.append(kind)
        if rec.owner is None:
            rec.owner = owner
        return rec

    def find(self, t) -> Storage | None:
        """The record of ``t``'s storage, if it is followed."""
        if not torch.is_tensor(t):
            return None
        s = t.untyped_storage()
        rec = self._by_ptr.get(s.data_ptr())
        return rec if rec is not None and rec.ref() is s else None

    def alive(self) -> list[Storage]:
        """The storages followed that are still allocated."""
        return [rec for rec in self._by_ptr.values() if rec.nbytes]

    def bytes(self) -> int:
        """Bytes of every storage followed that is still allocated."""
        return sum(rec.nbytes for rec in self.alive())

"""``current()`` / ``use(x)``: the one recorder (telemetry) or tracker (memory) in
force in this process.

Library code never holds a recorder or a tracker; it asks for the one in force, so
nobody threads them through every call, and "nobody is listening" is an object that
does nothing (:data:`dtlab.telemetry.OFF`, :data:`dtlab.memory.OFF`).

The slot is process-wide, not thread-local: autograd runs backward hooks (where
gradient collectives start and gathered weights are freed) on its own threads on GPU,
and those must see the same recorder as the thread that called ``backward()``.
"""

from __future__ import annotations

import contextlib
from typing import Generic, TypeVar

__all__ = ["Current"]

T = TypeVar("T")


class Current(Generic[T]):
    """A process-wide slot holding the object in force (``default`` until set)."""

    def __init__(self, default: T):
        self._value = default

    def get(self) -> T:
        """The object in force now."""
        return self._value

    def set(self, value: T) -> T:
        """Put ``value`` in force until replaced (long-lived engine processes)."""
        self._value = value
        return value

    @contextlib.contextmanager
    def use(self, value: T):
        """Put ``value`` in force for the ``with`` body; restore the previous one."""
        previous, self._value = self._value, value
        try:
            yield value
        finally:
            self._value = previous

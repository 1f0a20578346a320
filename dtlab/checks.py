"""Argument checks shared by every module: a bad value is refused with a message
that names it, before any process starts or any collective is called.

``bool`` is an ``int`` in Python; none of these accept it as a count.
"""

from __future__ import annotations

__all__ = ["integer", "positive_int", "one_of", "divisors"]


def integer(name: str, value, low: int = 0) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``low``; else a
    ``ValueError`` that names ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        if low == 1:
            what = "a positive integer"
        elif low == 0:
            what = "a non-negative integer"
        else:
            what = f"an integer >= {low}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def positive_int(name: str, value) -> int:
    """``value`` if it is an ``int`` >= 1; else a ``ValueError`` naming ``name``."""
    return integer(name, value, 1)


def one_of(what: str, value, allowed, aliases=None) -> str:
    """The canonical spelling of ``value`` among ``allowed`` (case-insensitive,
    ``aliases`` mapping other spellings to it); else a ``ValueError`` listing the
    choices."""
    key = str(value).lower()
    key = (aliases or {}).get(key, key)
    if key not in allowed:
        raise ValueError(f"unknown {what} {value!r}: expected one of {tuple(allowed)}")
    return key


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending (the degrees an axis can take)."""
    positive_int("n", n)
    return [d for d in range(1, n + 1) if n % d == 0]

"""Visible checks: a claim the page makes, verified where the learner reads it.

Used by every chapter. ``confirm(ok, "all 4 ranks hold identical weights")`` prints
the claim with a tick when it holds and raises an ``AssertionError`` naming it when
it does not, so a chapter run under nbval still fails on a broken claim while the
learner sees what was checked instead of a silent ``assert``.
"""

from __future__ import annotations

__all__ = ["confirm"]


def confirm(ok, claim: str, detail: str = "") -> None:
    """Print ``✓ claim`` (and ``detail``) if ``ok`` is true; otherwise raise an
    ``AssertionError`` that says which claim failed and what was found."""
    if not ok:
        raise AssertionError(f"✗ {claim}" + (f": {detail}" if detail else ""))
    print(f"✓ {claim}" + (f" ({detail})" if detail else ""))

"""Every pipeline schedule by its name.

Taught in chapter 05 (pipeline parallelism). The names are
:data:`dtlab.events.SCHEDULES` (what a config, a widget or a test spells); the
builders live in :mod:`dtlab.pipeline.schedules` (GPipe, 1F1B, interleaved, ZB-H1)
and :mod:`dtlab.pipeline.zero_bubble` (ZB-V, DualPipeV).
"""

from __future__ import annotations

from dtlab.events import V_SCHEDULES, schedule_name
from dtlab.pipeline.schedules import (
    Schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
)
from dtlab.pipeline.zero_bubble import V_BUILDERS

__all__ = ["BUILDERS", "make_schedule"]

BUILDERS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb_h1": zb_h1,
    **V_BUILDERS,
}
"""The builder of each schedule, keyed by :data:`dtlab.events.SCHEDULES`' names."""


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (:data:`dtlab.events.SCHEDULES`, or an alias
    :func:`dtlab.events.schedule_name` knows: ``"zb-h1"``, ``"interleaved-1f1b"``,
    ``"zbv"``, ``"dualpipev"``). ``v`` chunks per rank is for ``"interleaved"``;
    the V schedules always hold 2 (``v`` left at 1, or 2), the others 1."""
    key = schedule_name(name)
    if key == "interleaved":
        return interleaved_1f1b(p, m, v)
    own = 2 if key in V_SCHEDULES else 1  # chunks per rank
    if v not in (1, own):
        raise ValueError(
            f"schedule {name!r} runs {own} chunk{'s' * (own > 1)} per rank; "
            f"chunks={v} needs 'interleaved'"
        )
    return BUILDERS[key](p, m)

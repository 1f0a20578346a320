"""Pipeline parallelism: bubble, step time, and activations in flight.

The bubble and step time of the GPipe, 1F1B, interleaved and ZB-H1 schedules (and
of the V schedules ZB-V and DualPipeV where F, B and W take equal times), and how
many microbatches' activations a stage holds at its peak.

Taught in chapter 05 (pipeline parallel); chapters 07 and 09 reuse it, chapter 12
the V schedules.
"""

from __future__ import annotations

from dtlab.checks import positive_int
from dtlab.events import SCHEDULES, V_SCHEDULES, schedule_name

# ---- pipeline parallelism: bubble, step time, activations in flight (chapter 05) ----


def _check_pipeline(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        positive_int(name, value)


def pipeline_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of each stage's step under GPipe or 1F1B: ``(p-1)/(m+p-1)``
    (Huang et al. 2019, GPipe §2.2; Narayanan et al. 2021, §2.2.1).

    ``p`` stages, ``m`` microbatches, each taking ``t_f + t_b`` per stage: the step
    lasts ``(m + p - 1)(t_f + t_b)`` and each stage works ``m(t_f + t_b)`` of it.
    Interleaving ``v`` chunks per rank divides the bubble *time* by ``v``
    (§2.2.2): ``(p-1)/(v·m + p - 1)`` of the step.
    """
    _check_pipeline(p, m, v)
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time, the Megatron paper's form:
    ``(1/v)·(p-1)/m``. More microbatches shrink it, and so do more chunks."""
    _check_pipeline(p, m, v)
    return (p - 1) / (v * m)


def pipeline_step_time(
    p: int,
    m: int,
    t_f: float,
    t_b: float,
    *,
    v: int = 1,
    schedule: str = "1f1b",
    t_w: float = 0.0,
) -> float:
    """Step time of a balanced pipeline with free communication.

    ``t_f``, ``t_b``: forward and backward of one microbatch through one stage.
    GPipe, 1F1B: ``(m + p - 1)(t_f + t_b)``; interleaved: ``(m + (p-1)/v)(t_f +
    t_b)``; ZB-H1 (Qi et al. 2023, §3.1), backward split into ``t_b - t_w`` (input
    gradient) and ``t_w`` (weight gradient): ``m(t_f + t_b) + (p-1)(t_f + t_b -
    2·t_w)``. ZB-V and DualPipeV (two chunks per rank in a V; without DualPipe's
    overlap of one microbatch's F with another's B), when a chunk's F, B and W
    take equal times (``t_b = 2·t_f``, ``t_w = t_b/2``) and ``m >= 2p``:
    ``m(t_f + t_b) + (p-1)·t_f/2``, the start-up bound (rank r waits for
    microbatch 0 to come down r chunks of ``t_f/2`` each) and no bubble after it.
    With fewer microbatches, or other times, the V's step is longer and only
    :func:`dtlab.pipeline.simulate` knows it (checked against it for p <= 8).
    """
    _check_pipeline(p, m, v)
    key = schedule_name(schedule)
    if key != "interleaved" and v != 1:
        raise ValueError(f"v={v} chunks needs schedule='interleaved'")
    work = m * (t_f + t_b)
    if key in V_SCHEDULES:
        if not (_equal(t_b, 2 * t_f) and _equal(t_w, t_b / 2)) or m < 2 * p:
            raise ValueError(
                f"the closed form of {key}'s step holds when F, B and W take equal "
                f"times (t_b = 2·t_f, t_w = t_b/2) and m >= 2p, got t_f={t_f}, "
                f"t_b={t_b}, t_w={t_w}, m={m}, p={p}: simulate the schedule "
                "(dtlab.pipeline.simulate)"
            )
        return work + (p - 1) * t_f / 2
    if key == "zb_h1":
        if not 0 <= t_w <= t_b:
            raise ValueError(f"t_w must lie in [0, t_b={t_b}], got {t_w}")
        return work + (p - 1) * (t_f + t_b - 2 * t_w)
    return work + (p - 1) * (t_f + t_b) / v


def _equal(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def pipeline_in_flight(
    p: int, stage: int, m: int, schedule: str = "1f1b", v: int = 1
) -> int:
    """Peak number of microbatches whose activations stage ``stage`` holds at once.

    - GPipe: ``m`` (every forward runs before any backward);
    - 1F1B: ``min(p - stage, m)`` (warm-up of ``p - stage - 1`` plus one);
    - interleaved (counted in microbatch-*chunks*, each ``1/v`` of the stage):
      ``min(2(p - stage - 1) + (v - 1)·p + 1, v·m)``;
    - ZB-H1: ``min(p, m)`` (each weight pass trails its backward by ``stage``);
    - ZB-V (counted in chunks, each half of the rank's layers): ``min(m + stage +
      1, 2p, 2m)``; DualPipeV: ``min(2p + 1, 2m)``, one chunk more than ZB-V's
      steady state (the README of DeepSeek's DualPipe: "PP + 1"). Both measured
      on :func:`dtlab.pipeline.in_flight` for p up to 8.
    """
    _check_pipeline(p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is outside 0..{p - 1}")
    key = schedule_name(schedule)
    if key == "gpipe":
        return m
    if key == "1f1b":
        return min(p - stage, m)
    if key == "interleaved":
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m)
    if key == "zb_h1":
        return min(p, m)
    if key == "zb_v":
        return min(m + stage + 1, 2 * p, 2 * m)
    if key == "dualpipe_v":
        return min(2 * p + 1, 2 * m)
    raise ValueError(f"unknown schedule {schedule!r}: expected {SCHEDULES}")

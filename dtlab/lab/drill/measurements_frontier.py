"""The numbers behind the drill's three cards on chapter 12's frontier: FP8 scaling
cast for real in this process, the V schedules played by the simulator, and sharded
Muon's bytes and Newton–Schulz work from :mod:`dtlab.muon.estimate`. Each is a
function of the drill's context returning the fields of a
:class:`~dtlab.lab.drill.measurements.Measurement` (a dict, so that this module
needs nothing from the one that lists it);
:data:`dtlab.lab.drill.measurements.MEASUREMENTS` wraps and lists them with the
others.
"""

from __future__ import annotations

import torch

from dtlab import estimate, pipeline
from dtlab.fp8 import CurrentScaling, DelayedScaling, saturated_fraction
from dtlab.muon import muon_flops, muon_traffic

__all__ = ["fp8_delayed_jump", "zero_bubble_v", "muon_designs", "FRONTIER"]


def _fields(value, unit, kind, text, **more) -> dict:
    return dict(value=value, unit=unit, kind=kind, text=text, **more)


def fp8_delayed_jump(ctx):
    """Sixteen tensors of amax 1, then one of amax 8, cast to e4m3 under delayed
    scaling (a history of 16) and under current scaling: what each clipped."""
    gen = torch.Generator().manual_seed(0)
    delayed, current = DelayedScaling("e4m3", 16), CurrentScaling("e4m3")
    clipped = {}
    for a in [1.0] * 16 + [8.0]:
        x = torch.randn(4096, generator=gen)
        x = x / x.abs().max() * a  # amax exactly a
        for name, scaler in (("delayed", delayed), ("current", current)):
            _, scale = scaler.quantize(x)
            clipped[name] = saturated_fraction(x, "e4m3", scale)
    return _fields(
        clipped["delayed"],
        "fraction",
        "local",
        f"Cast in this process: after 16 tensors of amax 1, a tensor of amax 8. "
        f"Delayed scaling cast it with the history's scale (448/1) and clipped "
        f"{clipped['delayed']:.0%} of its elements to ±448; current scaling read "
        f"its amax first and clipped {clipped['current']:.0%}.",
        extra={"current": clipped["current"]},
    )


def zero_bubble_v(ctx):
    """ZB-V's bubble and peak activations at p = 4, m = 8, simulated with equal
    chunk times, beside 1F1B's and ZB-H1's and the formula."""
    p, m = 4, 8
    bubbles, peaks = {}, {}
    for name in ("1f1b", "zb_h1", "zb_v"):
        s = pipeline.make_schedule(name, p, m)
        spans = pipeline.simulate(s, 1.0, 2.0, 1.0 if s.split_backward else None)
        bubbles[name] = pipeline.bubble(spans)
        peaks[name] = max(max(t) for t in pipeline.in_flight(s)) / s.v
    step = estimate.pipeline_step_time(p, m, 1.0, 2.0, schedule="zb_v", t_w=1.0)
    return _fields(
        bubbles["zb_v"],
        "fraction",
        "simulate",
        f"Simulated at p=4, m=8 with a chunk's F, B and W equal: the bubble is "
        f"{bubbles['1f1b']:.0%} under 1F1B, {bubbles['zb_h1']:.0%} under ZB-H1 and "
        f"{bubbles['zb_v']:.1%} under ZB-V. The busiest rank holds "
        f"{peaks['1f1b']:g}, {peaks['zb_h1']:g} and {peaks['zb_v']:g} microbatches "
        f"of its layers: the V spreads 1F1B's first-stage memory to every rank.",
        predicted=1 - m * 3.0 / step,
    )


def muon_designs(ctx):
    """Sharded Muon for LLaMA-2 7B's hidden matrices on 8 ranks: bytes per rank
    and the busiest rank's Newton–Schulz FLOPs, naive against owner-compute."""
    m, n = estimate.MODELS["7B"], 8
    shapes = ([(m.d_model, m.d_model)] * 4 + [(m.d_ff, m.d_model)] * 3) * m.n_layers
    sent = {d: muon_traffic(shapes, n, d).total_wire_bytes for d in ("naive", "owner")}
    work = {d: max(muon_flops(shapes, n, d)) for d in ("naive", "owner")}
    return _fields(
        work["owner"] / work["naive"],
        "fraction",
        "estimate",
        f"LLaMA-2 7B's {len(shapes)} hidden matrices on {n} ranks "
        f"(dtlab.muon.estimate): gathering each matrix on every rank sends "
        f"{sent['naive'] / estimate.GB:.1f} GB a step and runs "
        f"{work['naive'] / 1e12:.0f} TFLOP of Newton–Schulz on every rank; one "
        f"owner per matrix sends {sent['owner'] / estimate.GB:.1f} GB and its "
        f"busiest rank runs {work['owner'] / 1e12:.0f} TFLOP.",
        predicted=1 / n,
    )


FRONTIER = {fn.__name__: fn for fn in (fp8_delayed_jump, zero_bubble_v, muon_designs)}
"""These measurements by name, for :data:`dtlab.lab.drill.measurements.MEASUREMENTS`."""

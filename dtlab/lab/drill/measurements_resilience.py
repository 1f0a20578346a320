"""The numbers behind the drill's three cards on chapter 13's resilience: the best
checkpoint interval found by simulating failures, LocalSGD/DiLoCo's bytes beside
DDP's, and a resharding load's plan computed with :func:`dtlab.reshard.overlaps`.
Each is a function of the drill's context returning the fields of a
:class:`~dtlab.lab.drill.measurements.Measurement` (a dict, so that this module
needs nothing from the one that lists it);
:data:`dtlab.lab.drill.measurements.MEASUREMENTS` wraps and lists them with the
others.
"""

from __future__ import annotations

from dtlab import estimate, ft
from dtlab.drill import parts_resilience as scenario
from dtlab.lab.lessons.ch13 import simulate_waste
from dtlab.reshard import Piece, overlaps

__all__ = ["young_daly_simulated", "diloco_bytes", "reshard_plan", "RESILIENCE"]


def _fields(value, unit, kind, text, **more) -> dict:
    return dict(value=value, unit=unit, kind=kind, text=text, **more)


def young_daly_simulated(ctx):
    """The card's job (128 servers of a 264-day MTBF, a 2-minute checkpoint):
    100,000 failure-free stretches drawn at random, the waste of each interval on
    a grid around Young–Daly's, and the interval that wasted least."""
    c, m = scenario.CHECKPOINT_S, ft.cluster_mtbf(scenario.NODE_MTBF, scenario.SERVERS)
    tau = ft.young_daly_interval(c, m)
    grid = [tau * 2 ** (k / 16) for k in range(-48, 49)]
    waste = simulate_waste(c, m, grid)
    i = min(range(len(grid)), key=waste.__getitem__)
    return _fields(
        grid[i] / 3600,
        "h",
        "simulate",
        f"Simulated failures every {m / 3600:.1f} h on average (128 servers of a "
        f"264-day MTBF), a 2-minute checkpoint: the least waste, {waste[i]:.1%}, "
        f"came at {grid[i] / 3600:.2f} h between checkpoints; √(2CM) says "
        f"{tau / 3600:.2f} h and {ft.expected_waste(tau, c, m):.1%}.",
        # no `predicted`: a simulation's flat minimum lands within a few per cent of
        # √(2CM), not to the 0.1 % chapter 10 holds a formula's prediction to
        extra={"young_daly_h": tau / 3600},
    )


def diloco_bytes(ctx):
    """LLaMA-2 7B on 8 replicas: DDP's bytes per step and DiLoCo's at H = 500."""
    psi = estimate.MODELS["7B"].n_params
    ddp = estimate.ddp_bytes_per_step(psi, 8)
    local = ft.local_sgd_bytes_per_step(psi, 8, 500)
    return _fields(
        ddp / local,
        "x",
        "estimate",
        f"LLaMA-2 7B on 8 replicas in fp32: DDP sends {ddp / estimate.GB:.1f} GB per "
        f"step per rank; DiLoCo meeting every 500 steps sends "
        f"{local / 1e6:.1f} MB per step, one all-reduce of the "
        f"pseudo-gradients every 500. Chapter 13 measured the same one H-th on its "
        f"engines, to the byte.",
        predicted=500.0,
    )


def reshard_plan(ctx):
    """A 4096 × 4096 weight saved as 64 flat ZeRO-3 ranges and loaded as 32: the
    saved pieces each new rank overlaps and the elements it reads, from
    :func:`dtlab.reshard.overlaps` on the pieces' full-tensor coordinates."""
    shape, old, new = (4096, 4096), 64, 32
    numel = shape[0] * shape[1]

    def piece(i, n):
        return Piece(shape, 0, 0, shape[0], i * numel // n, (i + 1) * numel // n)

    saved = [piece(i, old) for i in range(old)]
    touched, read = [], []
    for r in range(new):
        mine = piece(r, new)
        hits = [overlaps(mine, s) for s in saved]
        touched.append(sum(1 for h in hits if h))
        read.append(sum(n for h in hits for _, _, n in h))
    return _fields(
        max(read) / numel,
        "fraction",
        "local",
        f"A 4096 × 4096 weight saved by 64 ZeRO-3 ranks, loaded by 32, planned "
        f"here from the pieces' offsets: each new rank overlaps {max(touched)} saved "
        f"pieces and reads {max(read):,} elements, 1/{numel // max(read)} of the "
        f"tensor; together the 32 read it exactly once.",
        predicted=1 / new,
        extra={"total_read": sum(read), "numel": numel},
    )


RESILIENCE = {
    fn.__name__: fn for fn in (young_daly_simulated, diloco_bytes, reshard_plan)
}
"""These measurements by name, for :data:`dtlab.lab.drill.measurements.MEASUREMENTS`."""

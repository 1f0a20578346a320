"""The V schedules through the whole stack: ``TrainConfig(schedule="zb_v" |
"dualpipe_v")`` is checked before any rank starts, :func:`dtlab.parallelize`
builds the V's stages, the trainer reads the loss on rank 0 (where a V keeps the
last stage), and the run equals the single-process reference; the estimate's closed
forms for the V equal the simulator's.

Tolerance: as in tests/test_parallelize.py (losses within 2e-6 relative: the
pipeline sums its microbatches' weight gradients one by one, a few ulp away from
the reference's one batch; a missing tied-embedding sum or a loss read from the
wrong rank misses by 1e-3 or more).
"""

import pytest

from dtlab import estimate
from dtlab.model import GPTConfig
from dtlab.pipeline import in_flight, make_schedule, simulate
from dtlab.reference import train_reference
from dtlab.topology import Layout
from dtlab.train import TrainConfig

CFG = GPTConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
B, STEPS = 8, 3


def _config(schedule, **changes):
    base = TrainConfig(
        model=CFG, layout=Layout(pp=2), strategy="ddp", steps=STEPS,
        global_batch_size=B, schedule=schedule, microbatches=4,
    )  # fmt: skip
    return base.replace(**changes)


def test_config_checks_the_v_before_any_rank_starts():
    assert _config("zb_v").check(2) == Layout(pp=2)
    three = GPTConfig(n_layers=6, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
    with pytest.raises(ValueError, match="pp=2 x chunks=2 does not divide n_lay"):
        _config("zb_v", model=three).check(2)  # two stages a rank: 4 | n_layers
    with pytest.raises(ValueError, match="needs microbatches >= 2·pp = 4, got 2"):
        _config("dualpipe_v", microbatches=2).check(2)
    with pytest.raises(ValueError, match="'zb_v' does not compose with ZeRO"):
        _config("zb_v", strategy="zero1").check(2)
    with pytest.raises(ValueError, match="chunks=2 needs schedule='interleaved'"):
        _config("dualpipe_v", chunks=2).check(2)


def _train(configs):
    from dtlab.train import Trainer

    return [[r["loss"] for r in Trainer(c).fit()] for c in configs]


@pytest.mark.cluster
def test_v_schedules_train_to_the_reference(lab_cluster):
    configs = [_config("zb_v"), _config("dualpipe_v"), _config("zb_v", grad_clip=0.5)]
    results = lab_cluster(2).run(_train, configs, timeout=240)
    ref = train_reference(CFG, steps=STEPS, global_batch_size=B)
    clipped = train_reference(CFG, steps=STEPS, global_batch_size=B, grad_clip=0.5)
    for rank_losses in results:
        assert rank_losses == results[0]  # the loss reached both ranks
        for losses, want in zip(rank_losses, (ref, ref, clipped)):
            assert losses == pytest.approx(want.losses, rel=2e-6)


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_estimate_in_flight_and_step_time_equal_the_simulator(name):
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 4 * p + 2):
            try:
                schedule = make_schedule(name, p, m)
            except ValueError:
                continue  # dualpipe_v needs m >= 2p
            peaks = [max(t) for t in in_flight(schedule)]
            assert peaks == [
                estimate.pipeline_in_flight(p, r, m, name) for r in range(p)
            ], (p, m)
            if m >= 2 * p:
                span = max(e["t_end"] for e in simulate(schedule, 1.0, 2.0, 1.0))
                step = estimate.pipeline_step_time(p, m, 1.0, 2.0, schedule=name, t_w=1)
                assert step == pytest.approx(span), (p, m)
    with pytest.raises(ValueError, match="equal times"):
        estimate.pipeline_step_time(4, 8, 1.0, 2.0, schedule=name, t_w=0.5)

"""The random state is training state (issue 29), checked in one process: a
trainer's generators are seeded from its config, saved by ``state_dict`` and put
back by ``load_state_dict``; tensor parallelism's streams (TPRandom) come and go
through ``get_states``/``set_states``. The same on 4 ranks, at every layout, with
checkpoints and lost replicas: tests/test_resume.py and tests/test_replicas.py.
"""

from types import SimpleNamespace

import torch

from dtlab.model import GPTConfig
from dtlab.tensor_parallel import ParallelDropout, TPRandom
from dtlab.train import TrainConfig, Trainer, rank_seed

MODEL = GPTConfig(
    vocab_size=32, seq_len=8, n_layers=2, n_heads=2, d_model=16, dropout=0.1
)
CONFIG = TrainConfig(model=MODEL, global_batch_size=4, lr=1e-2, steps=4)


def _losses(trainer):
    return [r["loss"] for r in trainer.records]


def test_a_run_is_seeded_from_its_config_not_from_what_ran_before():
    first = Trainer(CONFIG)
    first.fit()
    torch.randn(1000)  # anything drawn in between changes nothing
    second = Trainer(CONFIG)
    second.fit()
    assert _losses(first) == _losses(second)
    other = Trainer(CONFIG.replace(seed=1))  # another seed: other weights, masks
    other.fit()
    assert _losses(other) != _losses(first)


def test_a_resumed_trainer_draws_the_masks_of_the_run_that_never_stopped():
    whole = Trainer(CONFIG)
    whole.fit()
    first = Trainer(CONFIG)
    first.fit(2)
    state = first.state_dict()
    torch.randn(1000)
    again = Trainer(CONFIG)
    again.load_state_dict(state)
    again.fit(2)
    assert _losses(again) == _losses(whole)[2:]
    # without the random state the masks are others: the test has teeth
    blind = Trainer(CONFIG)
    blind.load_state_dict({**state, "rng": torch.get_rng_state()})
    blind.fit(2)
    assert _losses(blind) != _losses(whole)[2:]


def test_each_rank_has_its_own_seed_and_each_run_the_same():
    coords = [dict(pp=0, dp=d, cp=0, tp=t) for d in range(2) for t in range(2)]
    seeds = [rank_seed(0, c) for c in coords]
    assert len(set(seeds)) == 4
    assert seeds == [rank_seed(0, c) for c in coords]
    assert rank_seed(1, coords[0]) != seeds[0]


def test_tp_streams_come_back_where_they_were():
    rng = TPRandom(3, SimpleNamespace(index=1))
    drop = ParallelDropout(0.5, rng, sharded=True)
    x = torch.ones(64)
    drop(x)  # the sharded stream has drawn; the replicated one not yet
    saved = rng.get_states()
    assert list(saved) == [(True, "cpu")]
    after = [drop(x) for _ in range(3)]
    torch.rand(1, generator=rng.generator(False, "cpu"))  # first drawn after the save
    rng.set_states(saved)
    assert all(torch.equal(a, drop(x)) for a in after)
    assert list(rng.get_states()) == [(True, "cpu")]  # the later one: at its seed
    fresh = TPRandom(3, SimpleNamespace(index=1))
    assert torch.equal(
        rng.generator(False, "cpu").get_state(),
        fresh.generator(False, "cpu").get_state(),
    )
    rng.manual_seed(4)  # both streams from another seed
    assert rng.get_states() == {}
    seed3 = ParallelDropout(0.5, TPRandom(3, SimpleNamespace(index=1)), sharded=True)
    assert not torch.equal(drop(x), seed3(x))

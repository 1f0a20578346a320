"""Which runs ``cluster.train(config, survive=True)`` takes on, and which it
refuses before any engine is touched (issue 29).

A lost rank's state can be restored only from a rank that holds the same shards
(:func:`dtlab.lab.engine.replica.holders`): under DDP its dp group (dp·cp with
context parallelism), narrowed to the ranks holding the same experts for a
mixture of experts; under HSDP its replicate group. Where some rank has no such
twin the run is refused by name. The table below is every 4-rank layout of
:func:`dtlab.topology.factorisations` that the config accepts, for DDP, ZeRO and
HSDP; the runs that are survived are killed and compared bit for bit in
tests/test_replicas.py.
"""

import pytest

from dtlab.lab.engine.replica import holders
from dtlab.lab.kernel.training import train_on_cluster
from dtlab.model import GPTConfig
from dtlab.topology import Layout, factorisations
from dtlab.train import TrainConfig

DENSE = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, n_heads=4, d_model=32)
MOE = GPTConfig(**{**DENSE.__dict__, "n_experts": 4})

# (strategy, zero_shard_size) -> {layout name: None (survived) or the refusal}
REFUSED_DP = "needs dp >= 2"
SHARDED = "shards it"
EXPERTS = "each expert on two ranks or more"
ONE_SHARD_GROUP = "zero_shard_size=4"
TABLE = {
    ("ddp", None): {
        "dp4·tp1·pp1": None,
        "dp4·tp1·pp1·ep2": None,
        "dp4·tp1·pp1·ep4": EXPERTS,
        "dp2·tp1·pp1·cp2": None,
        "dp2·tp1·pp1·cp2·ep2": None,
        "dp2·tp1·pp1·cp2·ep4": EXPERTS,
        "dp1·tp1·pp1·cp4": None,
        "dp1·tp1·pp1·cp4·ep2": None,
        "dp1·tp1·pp1·cp4·ep4": EXPERTS,
        "dp1·tp2·pp1·cp2": None,  # the cp pair holds the same tp slice
        "dp1·tp1·pp2·cp2": None,
        "dp2·tp1·pp2": None,
        "dp2·tp2·pp1": None,
        "dp1·tp2·pp2": REFUSED_DP,
        "dp1·tp4·pp1": REFUSED_DP,
    },
    ("zero2", None): {
        "dp4·tp1·pp1": SHARDED,
        "dp2·tp1·pp1·cp2": SHARDED,
        "dp1·tp1·pp1·cp4": SHARDED,
        "dp1·tp2·pp1·cp2": SHARDED,
        "dp1·tp1·pp2·cp2": SHARDED,
        "dp2·tp1·pp2": SHARDED,
        "dp2·tp2·pp1": SHARDED,
        "dp1·tp2·pp2": REFUSED_DP,
        "dp1·tp4·pp1": REFUSED_DP,
    },
    ("zero3", 2): {  # HSDP: shard groups of 2, replicated across them
        "dp4·tp1·pp1": None,
        "dp2·tp1·pp1·cp2": None,
        "dp1·tp1·pp1·cp4": None,
        # dp = 2 (or dp·cp = 2) is one shard group of 2: nothing replicated
        "dp1·tp2·pp1·cp2": "zero_shard_size=2",
        "dp1·tp1·pp2·cp2": "zero_shard_size=2",
        "dp2·tp1·pp2": "zero_shard_size=2",
        "dp2·tp2·pp1": "zero_shard_size=2",
    },
    ("zero3", 4): {  # one shard group: ZeRO over every replica
        "dp4·tp1·pp1": ONE_SHARD_GROUP,
        "dp2·tp1·pp1·cp2": ONE_SHARD_GROUP,
        "dp1·tp1·pp1·cp4": ONE_SHARD_GROUP,
    },
}


class Untouchable:
    """A cluster of 4 that fails the test if anything but its size is asked."""

    world_size = 4

    def __getattr__(self, name):
        raise AssertionError(f"the cluster was touched ({name}) before the refusal")


def _configs(strategy, shard_size):
    """Every 4-rank layout this strategy composes with, as configs."""
    out = {}
    for layout in factorisations(4, beyond_3d=True):
        config = TrainConfig(
            model=MOE if layout.ep > 1 else DENSE,
            layout=layout,
            strategy=strategy,
            zero_shard_size=shard_size,
            cp_variant="ulysses",
            steps=2,
        )
        try:
            config.check(4)
        except ValueError:
            continue  # not composed in dtlab at all: nothing to survive
        out[str(layout)] = config
    return out


@pytest.mark.parametrize("key", list(TABLE), ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_layout_is_survived_or_refused_by_name_before_any_engine(key):
    configs = _configs(*key)
    assert sorted(configs) == sorted(TABLE[key])  # the table is the whole list
    for name, config in configs.items():
        refusal = TABLE[key][name]
        if refusal is None:
            for rank in range(4):  # every rank's state has a twin
                assert len(holders(config, config.layout, rank)) >= 2, (name, rank)
            continue
        with pytest.raises(ValueError, match=refusal):
            train_on_cluster(Untouchable(), config, live=False, survive=True)


def test_the_holders_of_a_rank_hold_the_same_shards():
    """dp group for dense weights; the expert-data-parallel group for experts (not
    the dp group: rank 1 of dp4·ep2 holds experts 2-3, rank 2 experts 0-1); HSDP's
    replicate group; ZeRO over every replica: nobody else."""
    config = TrainConfig(model=DENSE, layout=Layout(dp=2, tp=2))
    assert holders(config, config.layout, 1) == [1, 3]
    moe = TrainConfig(model=MOE, layout=Layout(dp=4, ep=2))
    assert holders(moe, moe.layout, 1) == [1, 3]
    assert holders(moe, moe.layout, 2) == [0, 2]
    pipe = TrainConfig(model=DENSE, layout=Layout(dp=2, pp=2))
    assert holders(pipe, pipe.layout, 3) == [2, 3]  # the second stage's dp group
    hsdp = TrainConfig(model=DENSE, strategy="zero3", zero_shard_size=2)
    assert holders(hsdp, Layout(dp=4), 2) == [0, 2]
    zero = TrainConfig(model=DENSE, strategy="zero1")
    assert holders(zero, Layout(dp=4), 2) == [2]

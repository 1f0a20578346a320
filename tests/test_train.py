"""dtlab.train and dtlab.lab.kernel.training: configs that fail early and clearly, the
loop against the reference, and records streamed from the live cluster."""

import pytest
import torch

from dtlab import estimate
from dtlab.model import GPTConfig
from dtlab.reference import train_reference
from dtlab.topology import Layout
from dtlab.train import STRATEGIES, TrainConfig, Trainer, train

CFG = GPTConfig()


# ---- configs -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(steps=-1), "steps"),
        (dict(steps=0), "steps"),  # would occupy the engines for nothing
        (dict(global_batch_size=0), "global_batch_size"),
        (dict(grad_accum_steps=0), "grad_accum_steps"),
        (dict(lr=0.0), "lr"),
        (dict(grad_clip=-1.0), "grad_clip"),
        (dict(bucket_cap_mb=0), "bucket_cap_mb"),
        (dict(layout=(2, 1, 1)), "layout"),
        (dict(model={"n_layers": 2}), "GPTConfig"),
    ],
)
def test_bad_config_values_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**changes)


def test_configs_that_cannot_run_on_this_world_fail_before_anything_runs():
    with pytest.raises(ValueError, match="multiple of 8"):
        TrainConfig(global_batch_size=12, grad_accum_steps=2).check(4)
    with pytest.raises(ValueError, match="microbatches=3"):
        TrainConfig(layout=Layout(dp=2, pp=2), microbatches=3).check(4)
    with pytest.raises(ValueError, match="has pp=1"):
        TrainConfig(layout=Layout(dp=2, tp=2), chunks=2).check(4)
    with pytest.raises(ValueError, match="tp=1"):
        TrainConfig(sequence_parallel=True).check(4)
    with pytest.raises(ValueError, match="offload"):
        TrainConfig(offload=True).check(4)
    with pytest.raises(ValueError, match="world has 4"):
        TrainConfig(layout=Layout(dp=2)).check(4)
    with pytest.raises(ValueError, match="unknown strategy 'dpp'"):
        TrainConfig(strategy="dpp").check(4)
    # tensor and pipeline parallelism are axes of the layout, not strategies
    with pytest.raises(ValueError, match="come from the layout"):
        TrainConfig(strategy="pp").check(4)
    assert TrainConfig(global_batch_size=16, grad_accum_steps=2).check(4) == Layout(4)
    assert "ddp" in STRATEGIES


# ---- one process --------------------------------------------------------------------
def test_one_rank_trains_exactly_like_the_reference():
    """Without torch.distributed the DDP strategy is a one-rank world: the same
    operations as dtlab.reference in the same order, so the same bits."""
    for clip in (None, 0.5):
        config = TrainConfig(steps=4, global_batch_size=4, grad_clip=clip)
        trainer = Trainer(config)
        records = trainer.fit()
        ref = train_reference(CFG, steps=4, global_batch_size=4, grad_clip=clip)
        assert [r["loss"] for r in records] == ref.losses
        assert [r["grad_norm"] for r in records] == [
            r["grad_norm"] for r in ref.records
        ]
        for (name, p), q in zip(
            trainer.full_parameters().items(), ref.model.parameters()
        ):
            assert torch.equal(p, q), name
        assert [r["step"] for r in records] == [0, 1, 2, 3]
        assert records[-1]["tokens"] == ref.records[-1]["tokens"]
    # fit() continues where it stopped
    assert [r["step"] for r in trainer.fit(2)] == [0, 1, 2, 3, 4, 5]


def test_accumulation_on_one_rank_matches_the_large_batch():
    ref = train_reference(CFG, steps=3, global_batch_size=8)
    records = train(TrainConfig(steps=3, global_batch_size=8, grad_accum_steps=4))
    # 4 microbatch backward passes add their gradients in another order than one
    # backward over the batch: equal to float32 rounding, not bit for bit
    for r, want in zip(records, ref.losses):
        assert r["loss"] == pytest.approx(want, rel=1e-5)


# ---- on the live cluster ------------------------------------------------------------
def _layouts_and_records():
    import torch.distributed as dist

    from dtlab.topology import Topology

    topo = Topology(Layout(dp=dist.get_world_size()))
    trainer = Trainer(TrainConfig(steps=2, global_batch_size=8), topo)
    trainer.fit()
    try:
        Trainer(TrainConfig(layout=Layout(dp=2), steps=1), topo)
    except ValueError as exc:
        mismatch = str(exc)
    return trainer.topo is topo, mismatch, trainer.full_parameters()


@pytest.mark.cluster
def test_lab_train_streams_records_that_match_the_reference(lab_cluster):
    from dtlab.lab.kernel.training import train_on_cluster

    cluster = lab_cluster(4)
    config = TrainConfig(steps=6, global_batch_size=8, bucket_cap_mb=0.1)
    batches = []
    run = train_on_cluster(
        cluster, config, live=True, on_records=batches.append, timeout=120
    )

    streamed = [r for b in batches for r in b]
    assert len(streamed) == 4 * 6 and all(r["kind"] == "step" for r in streamed)
    assert run.live is not None and run.live.received == 4 * 6
    assert [len(recs) for recs in run.records] == [6] * 4
    # every rank reports the same global-batch loss, and holds the same weights ...
    assert len({tuple(v) for v in run.by_rank("loss").values()}) == 1
    assert len({tuple(v) for v in run.by_rank("replica_digest").values()}) == 1
    # ... while its own microbatches give it its own local loss
    assert len({v[0] for v in run.by_rank("local_loss").values()}) == 4
    ref = train_reference(CFG, steps=6, global_batch_size=8)
    # per-rank means averaged vs one mean over the batch: float32 rounding apart
    assert run.losses() == pytest.approx(ref.losses, rel=1e-5)
    psi = CFG.n_params()
    for recs in run.records:
        for r in recs:
            assert r["buckets"] == 4
            assert r["wire_bytes"] == pytest.approx(estimate.ddp_bytes_per_step(psi, 4))
    kinds = {e["kind"] for e in run.events}
    assert {"step", "span", "comm", "ddp_bucket", "memory"} <= kinds
    memory = [e for e in run.events if e["kind"] == "memory"][-1]
    assert memory["params"] == memory["grads"] == psi * 4
    assert memory["optimizer"] >= 2 * psi * 4
    # the gradients are views of DDP's buckets: the buckets cost nothing more
    assert memory["buffers"] == 0

    same_topo, mismatch, params = cluster.run(_layouts_and_records, timeout=120)[0]
    assert same_topo and "world has 4" in mismatch
    ref2 = train_reference(CFG, steps=2, global_batch_size=8).model
    for name, p in ref2.named_parameters():
        # 2 AdamW steps of lr=1e-3: rounding-level gradient differences stay far
        # below a tenth of one step
        torch.testing.assert_close(params[name], p.detach(), rtol=0, atol=1e-4)


@pytest.mark.cluster
def test_lab_train_rejects_a_config_before_starting(lab_cluster):
    from dtlab.lab.kernel.training import train_on_cluster

    with pytest.raises(ValueError, match="multiple of 12"):
        train_on_cluster(
            lab_cluster(4), TrainConfig(global_batch_size=6, grad_accum_steps=3)
        )
    with pytest.raises(ValueError, match="TrainConfig"):
        train_on_cluster(lab_cluster(4), {"steps": 3})


def _strategies_on_engine(names, steps):
    from dtlab.train import TrainConfig, Trainer

    out = {}
    for name in names:
        cfg = TrainConfig(strategy=name, steps=steps, global_batch_size=8, lr=1e-2)
        trainer = Trainer(cfg)
        records = trainer.fit()
        full = trainer.full_parameters()
        out[name] = ([r["loss"] for r in records], full["blocks.0.mlp.fc.weight"])
    return out


@pytest.mark.cluster
def test_zero_stages_train_like_ddp_through_the_config(lab_cluster):
    from dtlab.reference import train_reference

    names = ["ddp", "zero1", "zero2", "zero3"]
    results = lab_cluster(4).run(_strategies_on_engine, names, 3, timeout=300)
    ref = train_reference(steps=3, global_batch_size=8, lr=1e-2)
    ref_w = dict(ref.model.named_parameters())["blocks.0.mlp.fc.weight"].detach()
    for rank_out in results:
        # the stages shard the same sums: bit-identical to one another
        for name in ("zero2", "zero3"):
            assert rank_out[name][0] == rank_out["zero1"][0]
            assert torch.equal(rank_out[name][1], rank_out["zero1"][1])
        # against DDP and the single process: the same numbers up to the order of
        # the gradient sums (reduce-scatter vs bucketed all-reduce vs one batch);
        # AdamW can turn rounding-level gradient differences into steps of ~lr
        for name in names:
            losses, weight = rank_out[name]
            assert losses == pytest.approx(ref.losses, rel=1e-5)
            torch.testing.assert_close(weight, ref_w, rtol=0, atol=2e-3)


@pytest.mark.parametrize(
    "field, value",
    [
        ("precision", "fp8"),
        ("schedule", "pipedream"),
        ("activation_checkpointing", "some"),
        ("chunks", 0),
        ("microbatches", 0),
        ("sequence_parallel", "yes"),
    ],
)
def test_choice_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


def test_config_round_trips_through_json():
    import json

    config = TrainConfig(
        model=GPTConfig(n_layers=4, d_model=32),
        layout=Layout(dp=2, tp=2, pp=2),
        strategy="zero1",
        schedule="interleaved",
        microbatches=4,
        chunks=2,
        precision="bf16",
        activation_checkpointing="selective",
        grad_clip=1.0,
    )
    again = TrainConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({"compute_dtype": "bf16"})

"""Stop a run, resume it, and get the loss curve of the run that never stopped.

A checkpoint saved mid-run (:func:`dtlab.checkpoint.save_training`, each rank's
:meth:`dtlab.train.Trainer.state_dict`) and loaded into a freshly built trainer
(:func:`dtlab.checkpoint.load_training`) must continue *bit for bit*: same weights,
same optimizer moments and step counts, same loss scaler, same random state, same
data (a pure function of the step), so the resumed losses are ``==`` the
uninterrupted ones. Covered on 4 ranks: DDP, ZeRO 1-3, TP (with sequence
parallelism) under ZeRO-3, PP (1F1B) in bf16, TP x PP in fp16, and each precision
policy. (A layout with all three axes > 1 needs 8 ranks: tests/test_parallelize.py
resumes dp2·tp2·pp2 with ZeRO-1 in fp16 on its 8-engine cluster.) A checkpoint
written at one world size loads at another where the state allows: ZeRO slices are
re-cut (the flat layout of a unit does not depend on the number of ranks) and a DDP
replica fits any world; a tensor- or pipeline-parallel state is refused elsewhere
with a clear message.
"""

import os

import pytest
import torch

from dtlab.model import GPTConfig
from dtlab.train import TrainConfig

pytestmark = pytest.mark.cluster

MODEL = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, d_model=16)
CONFIG = TrainConfig(model=MODEL, global_batch_size=8, lr=1e-2, steps=4)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
STEPS, STOP_AT = 4, 2


def _losses(records):
    return [r["loss"] for r in records]


# name -> (strategy, (dp, tp, pp), precision, other config fields); on 4 ranks
CASES = {
    "ddp": ("ddp", None, "fp32", {}),  # None: dp over the whole world
    "zero1": ("zero1", None, "fp32", {}),
    "zero2": ("zero2", None, "fp32", {}),
    "zero3": ("zero3", None, "fp32", {}),
    "ddp-fp16": ("ddp", None, "fp16", {}),  # the loss scaler is state too
    "zero2-bf16": ("zero2", None, "bf16", {}),
    "tp-zero3": ("zero3", (2, 2, 1), "fp32", dict(sequence_parallel=True)),
    "pp-1f1b-bf16": ("ddp", (2, 1, 2), "bf16", dict(microbatches=2)),
    "tp-pp-fp16": ("zero1", (1, 2, 2), "fp16", dict(schedule="gpipe")),
}


def _config(name):
    from dtlab.topology import Layout

    strategy, sizes, precision, more = CASES[name]
    layout = Layout(*sizes) if sizes else None
    return CONFIG.replace(strategy=strategy, layout=layout, precision=precision, **more)


def _stop_and_resume(names, root):
    """On every rank: for each case, the uninterrupted run; then a run stopped
    after STOP_AT steps and saved; then a new trainer that loads it and finishes."""
    import torch.distributed as dist

    from dtlab.checkpoint import load_training, save_training
    from dtlab.topology import Topology
    from dtlab.train import Trainer

    topos = {}
    out = {}
    for name in names:
        config = _config(name)
        layout = config.resolve_layout(dist.get_world_size())
        if layout not in topos:  # one set of groups per layout
            topos[layout] = Topology(layout)
        topo = topos[layout]
        whole = Trainer(config, topo)
        whole.fit(STEPS)
        first = Trainer(config, topo)
        first.fit(STOP_AT)
        save_training(f"{root}/{name}", first)
        saved = {k: v.clone() for k, v in first.full_parameters().items()}
        del first
        again = Trainer(config, topo)
        at = load_training(f"{root}/{name}", again)
        loaded = {k: v.clone() for k, v in again.full_parameters().items()}
        again.fit(STEPS - at)
        out[name] = dict(
            at=at,
            whole=_losses(whole.records),
            resumed=_losses(again.records),
            params_restored=all(torch.equal(saved[k], loaded[k]) for k in saved),
            params_end=all(
                torch.equal(a, b)
                for a, b in zip(
                    whole.full_parameters().values(), again.full_parameters().values()
                )
            ),
            saved=saved if dist.get_rank() == 0 else None,
        )
    return out


def _load_elsewhere(strategies, root):
    """On a world of another size: load each checkpoint, report the weights and
    optimizer state it restored, and train to the end."""
    import torch.distributed as dist

    from dtlab.checkpoint import gather_full_optimizer_state, load_training
    from dtlab.topology import Layout, Topology
    from dtlab.train import Trainer

    topo = Topology(Layout(dp=dist.get_world_size()))
    out = {}
    for s in strategies:
        trainer = Trainer(CONFIG.replace(strategy=s), topo)
        at = load_training(f"{root}/{s}", trainer)  # saved at dp=4
        params = {k: v.clone() for k, v in trainer.full_parameters().items()}
        moments = None
        if s.startswith("zero"):
            moments = gather_full_optimizer_state(
                trainer.model, trainer.optimizer.optimizer
            )
        trainer.fit(STEPS - at)
        out[s] = dict(
            at=at,
            params=params,
            moments=moments,
            losses=_losses(trainer.records),
        )
    return out


def _full_moments(strategies, root):
    """The optimizer state each ZeRO checkpoint holds, gathered whole, at the size
    it was saved at (the reference for the resharded one)."""
    import torch.distributed as dist

    from dtlab.checkpoint import gather_full_optimizer_state, load_training
    from dtlab.topology import Layout, Topology
    from dtlab.train import Trainer

    topo = Topology(Layout(dp=dist.get_world_size()))
    out = {}
    for s in strategies:
        trainer = Trainer(CONFIG.replace(strategy=s), topo)
        load_training(f"{root}/{s}", trainer)
        out[s] = gather_full_optimizer_state(trainer.model, trainer.optimizer.optimizer)
    return out


def _wrong_loads(root):
    """Loading into the wrong trainer is a clear error, before any step."""
    from dtlab.checkpoint import load_training
    from dtlab.train import Trainer

    errors = []
    cases = [
        (CONFIG.replace(strategy="zero3"), f"{root}/ddp"),
        (CONFIG.replace(strategy="ddp"), f"{root}/zero1"),
        (CONFIG.replace(model=GPTConfig(**{**MODEL.__dict__, "d_model": 32})),
         f"{root}/ddp"),
    ]  # fmt: skip
    if os.path.exists(f"{root}/tp-zero3"):
        # a tensor-parallel state is cut by its layout: it loads only there
        cases.append((CONFIG.replace(strategy="zero3"), f"{root}/tp-zero3"))
    for config, path in cases:
        try:
            load_training(path, Trainer(config))
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.slow  # 9 strategies x 3 short runs on 4 engines
def test_every_strategy_resumes_to_the_same_loss_curve(lab_cluster, tmp_path):
    """DDP, ZeRO 1-3, TP (with sequence parallelism), PP, TP x PP, and each
    precision policy: the resumed run's losses are the uninterrupted run's."""
    results = lab_cluster(4).run(_stop_and_resume, list(CASES), str(tmp_path))
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            assert r["at"] == STOP_AT
            assert r["params_restored"], (rank, name)
            # same world, same layout, same reduction order: exactly equal, in
            # 16 bits too (the same casts happen in the same order)
            assert r["resumed"] == r["whole"], (rank, name, r["resumed"], r["whole"])
            assert r["params_end"], (rank, name)
    # the runs learn (so equal curves are not equal because nothing moved)
    for name, r in results[0].items():
        assert r["whole"][-1] < r["whole"][0], name
    # a layout-bound checkpoint refuses another layout, with a clear message
    errors = lab_cluster(2).run(_wrong_loads, str(tmp_path))[0]
    assert "loads only at the layout it was saved at" in errors[-1]


def test_a_checkpoint_loads_at_another_world_size(lab_cluster, tmp_path):
    root = str(tmp_path)
    saved = lab_cluster(4).run(_stop_and_resume, STRATEGIES, root)[0]
    moments4 = lab_cluster(4).run(_full_moments, STRATEGIES[1:], root)[0]
    two = lab_cluster(2).run(_load_elsewhere, STRATEGIES, root)
    for s in STRATEGIES:
        for rank, got in enumerate(two):
            assert got[s]["at"] == STOP_AT
            # the weights are restored exactly: re-cutting slices moves bytes only
            for name, tensor in saved[s]["saved"].items():
                assert torch.equal(got[s]["params"][name], tensor), (s, rank, name)
            if s.startswith("zero"):
                # and so are Adam's moments and step counts, element for element
                for name, state in moments4[s].items():
                    for key, value in state.items():
                        assert torch.equal(got[s]["moments"][name][key], value), (
                            s,
                            name,
                            key,
                        )
        # Continuing on 2 ranks: the same global batch, but each gradient is the
        # mean of 2 partial sums instead of 4, a different fp32 summation order, so
        # the curve matches to rounding (~1e-7 relative per step), not bit for bit.
        resumed = two[0][s]["losses"]
        whole = saved[s]["whole"]
        # the old ranks' records stay with the old world: only the new steps here
        assert len(resumed) == STEPS - STOP_AT
        assert resumed == pytest.approx(whole[STOP_AT:], rel=1e-5), s


def test_loading_into_the_wrong_trainer_is_refused(lab_cluster, tmp_path):
    root = str(tmp_path)
    lab_cluster(2).run(_stop_and_resume, ("ddp", "zero1"), root)
    for errors in lab_cluster(2).run(_wrong_loads, root):
        assert len(errors) == 3
        assert "saved from a DDP run" in errors[0]
        assert "saved from a ZeRO run" in errors[1]
        assert "another model" in errors[2]


# ---- dropout on: the random state is part of the training state (issue 29) ----------
# Every layout of 4 ranks this model allows (2 heads, 2 layers: tp and pp at most 2)
# that draws dropout masks from a different place: torch's
# generator under DDP, ZeRO, a pipeline (each stage its own), context parallelism
# (Ulysses: ring attention has no attention dropout) and a mixture of experts; the
# tensor-parallel streams (TPRandom), with and without recomputation replaying them.
DROPOUT = 0.1
DROPOUT_CASES = {
    "dp4": (None, {}),
    "zero3": (None, dict(strategy="zero3")),
    "dp2-tp2": ((2, 2, 1), {}),
    "dp2-tp2-sp-full": (
        (2, 2, 1),
        dict(sequence_parallel=True, activation_checkpointing="full"),
    ),
    "dp2-pp2": ((2, 1, 2), dict(microbatches=2)),
    "tp2-pp2": ((1, 2, 2), dict(microbatches=2)),
    "dp2-cp2": ((2, 1, 1, 2), dict(cp_variant="ulysses")),
    "dp4-ep2": ((4, 1, 1, 1, 2), dict(model=dict(n_experts=4))),
}


def _dropout_config(name, dropout=DROPOUT):
    from dtlab.topology import Layout

    sizes, more = DROPOUT_CASES[name]
    more = dict(more)
    model = GPTConfig(**{**MODEL.__dict__, "dropout": dropout, **more.pop("model", {})})
    layout = Layout(*sizes) if sizes else None
    return CONFIG.replace(model=model, layout=layout, **more)


def _runs_with_dropout(names, root):
    """On every rank, per case: two runs of one config, the same without dropout,
    and a run stopped after STOP_AT steps, saved and resumed in a new trainer."""
    import torch.distributed as dist

    from dtlab.checkpoint import load_training, save_training
    from dtlab.topology import Topology
    from dtlab.train import Trainer

    topos, out = {}, {}
    for name in names:
        config = _dropout_config(name)
        layout = config.resolve_layout(dist.get_world_size())
        topo = topos.setdefault(layout, Topology(layout))

        def run(config=config, topo=topo):
            trainer = Trainer(config, topo)
            trainer.fit(STEPS)
            return _numbers(trainer.records)

        whole, again = run(), run()
        without = run(_dropout_config(name, 0.0))
        first = Trainer(config, topo)
        first.fit(STOP_AT)
        save_training(f"{root}/{name}", first)
        del first
        resumed = Trainer(config, topo)
        load_training(f"{root}/{name}", resumed)
        resumed.fit(STEPS - STOP_AT)  # its records: the saved ones, then the new
        out[name] = dict(
            whole=whole, again=again, without=without, resumed=_numbers(resumed.records)
        )
    return out


def _numbers(records):
    """What must not change: this rank's loss, local loss and gradient norm."""
    return [(r["loss"], r["local_loss"], r["grad_norm"]) for r in records]


def test_with_dropout_a_run_repeats_and_resumes_bit_for_bit(lab_cluster, tmp_path):
    """Dropout 0.1 at every kind of 4-rank layout: two runs of one config are
    identical (every rank's generators are seeded from the config and its
    coordinates), and a run resumed from a checkpoint equals the run that never
    stopped, step by step on every rank (the checkpoint holds torch's generators
    and the tensor-parallel streams). Tolerance: none, as above."""
    results = lab_cluster(4).run(_runs_with_dropout, list(DROPOUT_CASES), str(tmp_path))
    for rank, per_case in enumerate(results):
        for name, r in per_case.items():
            assert r["again"] == r["whole"], (rank, name)
            assert r["resumed"] == r["whole"], (rank, name)
            # the masks are drawn: without dropout the run is another one
            assert r["without"] != r["whole"], (rank, name)

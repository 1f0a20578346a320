"""3D parallelism through ``TrainConfig``: every layout of a 4-rank world and the
2×2×2 layout of an 8-rank world, with DDP and each ZeRO stage over dp, train to the
single-process reference's loss curve; dp2·tp2 with ZeRO-3 also matches PyTorch's own
composition (FSDP2 over DTensor tensor parallelism); activation checkpointing changes
no gradient and saves the memory it should; 16-bit runs track the same-casts
reference.

Tolerances (fp32 on gloo). The composed runs compute the same sums as the reference
in other orders: each dp rank averages its own slice of the batch before the
all-reduce averages the ranks; a row-parallel matmul adds ``t`` partial products
after the matmuls; the vocab-parallel cross-entropy sums its exponentials shard by
shard; a pipeline sums its microbatches' weight gradients one by one; ZeRO sums in
reduce-scatter chunks. Each reordering moves a float32 sum by a few ulp (~1e-7
relative). Over 3 AdamW steps at lr 1e-3 such gradient differences change the
update by far less than the update (Adam normalises it), so the losses agree to
a few 1e-7 relative: measured at most 2.3e-7 over every case here, allowed 2e-6.
The loss falls by ~1 % per step, so a step computed with wrong gradients (a missing
tied-embedding sum, a replica left out of the average) misses by 1e-3 or more. The
gradient norms (float64 sums of squares across ranks against torch's float32 norm
of norms) agree to ~5e-8, allowed 1e-5; an element counted twice (a tp replica, the
tied head copy) or missed would move the norm by percents.
"""

import pytest
import torch

from dtlab.model import GPTConfig
from dtlab.reference import train_reference
from dtlab.topology import Layout
from dtlab.train import TrainConfig

CFG = GPTConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
B = 8  # global batch
STEPS = 3
LAYOUTS_4 = [
    Layout(dp=4),
    Layout(dp=2, tp=2),
    Layout(dp=2, pp=2),
    Layout(tp=4),
    Layout(pp=4),
    Layout(tp=2, pp=2),
]
DP_FLAVOURS = ["ddp", "zero1", "zero2", "zero3"]


def _config(layout, strategy, **changes):
    return TrainConfig(
        model=CFG, layout=layout, strategy=strategy, steps=STEPS,
        global_batch_size=B, **changes,
    )  # fmt: skip


def _train_many(configs):
    """On every rank: train each config (one topology per layout, reused); return
    ``{index: {"losses", "norms", "skipped", "coords"}}``."""
    from dtlab.topology import Topology
    from dtlab.train import Trainer

    topos, out = {}, {}
    for i, config in enumerate(configs):
        if config.layout not in topos:
            topos[config.layout] = Topology(config.layout)
        records = Trainer(config, topos[config.layout]).fit()
        out[i] = {
            "losses": [r["loss"] for r in records],
            "norms": [r["grad_norm"] for r in records],
            "skipped": [r.get("skipped", False) for r in records],
            "coords": records[0]["coords"],
            "tokens_per_s": records[0]["tokens_per_s"],
        }
    return out


def _check_against_reference(results, configs, ref, rel=2e-6):
    for i, config in enumerate(configs):
        what = f"{config.layout} {config.strategy}"
        runs = [r[i] for r in results]
        # every rank reports the same global-batch loss
        assert all(run["losses"] == runs[0]["losses"] for run in runs), what
        assert runs[0]["losses"] == pytest.approx(ref.losses, rel=rel), what
        # the norm counts every element once (a tp replica or the tied head copy
        # counted twice would move it by percents)
        ref_norms = [r["grad_norm"] for r in ref.records]
        assert runs[0]["norms"] == pytest.approx(ref_norms, rel=1e-5), what
        coords = [tuple(run["coords"][a] for a in ("pp", "dp", "tp")) for run in runs]
        assert len(set(coords)) == len(runs), what  # one rank per coordinate


@pytest.mark.cluster
@pytest.mark.slow  # 24 trainings / 4 engines: ~15-30 s, more under load
def test_every_world4_layout_with_every_dp_flavour_matches_the_reference(lab_cluster):
    configs = [_config(lay, s) for lay in LAYOUTS_4 for s in DP_FLAVOURS]
    results = lab_cluster(4).run(_train_many, configs, timeout=300)
    ref = train_reference(CFG, steps=STEPS, global_batch_size=B)
    _check_against_reference(results, configs, ref)


# ---- pipeline schedules, accumulation, sequence parallelism, clipping ----------------
OPTION_CASES = [
    (Layout(dp=2, pp=2), "ddp", dict(schedule="gpipe")),
    (Layout(dp=2, pp=2), "zero1", dict(schedule="interleaved", chunks=2)),
    (Layout(tp=2, pp=2), "ddp", dict(schedule="zb_h1", microbatches=4)),
    (Layout(dp=2, pp=2), "ddp", dict(grad_accum_steps=2)),
    (Layout(tp=2, pp=2), "zero2", dict(grad_accum_steps=2)),
    (Layout(dp=2, tp=2), "zero3", dict(grad_accum_steps=2)),
    # ZeRO-1 accumulates full gradients and reduces once per step (no_sync)
    (Layout(dp=2, tp=2), "zero1", dict(grad_accum_steps=2)),
    (Layout(dp=2, pp=2), "zero1", dict(grad_accum_steps=2, microbatches=2)),
    (Layout(dp=2, tp=2), "ddp", dict(sequence_parallel=True)),
    (Layout(tp=2, pp=2), "zero1", dict(sequence_parallel=True)),
    (Layout(dp=2, tp=2), "zero2", dict(grad_clip=0.05)),
    (Layout(tp=2, pp=2), "ddp", dict(grad_clip=0.05)),
    (Layout(dp=2, pp=2), "zero2", dict(offload=True)),
]


@pytest.mark.cluster
def test_schedules_accumulation_sequence_parallel_and_clipping_compose(lab_cluster):
    configs = [_config(lay, s, **opts) for lay, s, opts in OPTION_CASES]
    results = lab_cluster(4).run(_train_many, configs, timeout=300)
    refs = {
        clip: train_reference(CFG, steps=STEPS, global_batch_size=B, grad_clip=clip)
        for clip in (None, 0.05)
    }
    for i, config in enumerate(configs):
        ref = refs[config.grad_clip]
        # the reference's norm is ~1.3: clipping at 0.05 really scales every step
        assert ref.records[0]["grad_norm"] > 0.05
        _check_against_reference([{0: r[i]} for r in results], [config], ref)


# ---- the 3D layout on eight ranks ----------------------------------------------------
@pytest.mark.cluster
@pytest.mark.slow  # 24 trainings / 8 engines: ~15-30 s, more under load
def test_3d_layout_2x2x2_matches_the_reference_with_every_dp_flavour(lab_cluster):
    layout = Layout(dp=2, tp=2, pp=2)
    configs = [_config(layout, s) for s in DP_FLAVOURS]
    results = lab_cluster(8).run(_train_many, configs, timeout=300)
    ref = train_reference(CFG, steps=STEPS, global_batch_size=B)
    _check_against_reference(results, configs, ref)


# ---- against PyTorch's own composition: FSDP2 over dp, DTensor TP over tp ------------
def _torch_2d(steps):
    """The same model, data and optimizer through PyTorch's 2D parallelism
    (:func:`dtlab.bench.composed.torch_2d`: DTensor TP over tp, FSDP2 over dp).
    Returns the global-batch loss of each step."""
    import torch.distributed as dist

    from dtlab.bench.composed import torch_2d
    from dtlab.model import SyntheticTokens
    from dtlab.reference import make_optimizer

    model, dp_mesh = torch_2d(CFG, 2, 2)
    # a column-parallel weight is sharded on both axes: its output rows over tp,
    # and those rows again over dp (FSDP2's _StridedShard of the tp shard)
    q = model.blocks[0].attn.q.weight
    assert q.device_mesh.mesh_dim_names == ("dp", "tp"), q.device_mesh
    kinds = [type(p).__name__ for p in q.placements]
    assert all("Shard" in k for k in kinds), q.placements
    opt = make_optimizer(model.parameters())
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    dp_rank, losses = dp_mesh.get_local_rank(), []
    for step in range(steps):
        x, y = data.shard(step, B, dp_rank, 2)  # (B/2, T): this dp rank's slice
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_mesh.get_group())
        losses.append(total.item() / 2)
    return losses


@pytest.mark.cluster
def test_dp_tp_zero3_matches_pytorch_fsdp2_with_dtensor_tp(lab_cluster):
    """dtlab's dp2·tp2 with ZeRO-3 against PyTorch's FSDP2 + DTensor TP on the same
    global batch: both follow the reference (same tolerance as above, both reorder
    the same float32 sums), and each other."""
    config = _config(Layout(dp=2, tp=2), "zero3")
    cluster = lab_cluster(4)
    theirs = cluster.run(_torch_2d, STEPS, timeout=300)
    ours = cluster.run(_train_many, [config], timeout=300)
    ref = train_reference(CFG, steps=STEPS, global_batch_size=B)
    assert all(t == theirs[0] for t in theirs)  # every rank, the same global loss
    assert theirs[0] == pytest.approx(ref.losses, rel=2e-6)
    _check_against_reference(ours, [config], ref)
    assert ours[0][0]["losses"] == pytest.approx(theirs[0], rel=2e-6)
    assert ref.losses[-1] < ref.losses[0]  # it trains


# ---- activation checkpointing (chapter 08) -------------------------------------------
def _checkpointing_runs(cases):
    """Each (layout, strategy) under none/selective/full: losses, this stage's
    parameters after training, and the activation bytes of the last memory event."""
    from dtlab import telemetry
    from dtlab.topology import Topology
    from dtlab.train import Trainer

    out = {}
    for layout, strategy in cases:
        topo = Topology(layout)
        for mode in ("none", "selective", "full"):
            rec = telemetry.Recorder(topo.rank)
            with telemetry.use(rec):
                config = _config(layout, strategy, activation_checkpointing=mode)
                trainer = Trainer(config, topo)
                records = trainer.fit(2)
            memory = [e for e in rec.events if e["kind"] == "memory"][-1]
            out[str(layout), strategy, mode] = {
                "losses": [r["loss"] for r in records],
                "params": trainer.full_parameters(),
                "activations": memory["activations"],
            }
    return out


def test_checkpointing_changes_no_bit_and_saves_what_korthikanti_counts():
    """One process: the same gradients (so the same weights, bit for bit) with and
    without recomputation, and the measured saved bytes decomposed exactly.

    Korthikanti et al. count ``sbh(34 + 5as/h)`` bytes per layer for fp16 with
    dropout. Here activations are fp32 (4 bytes) and there is no dropout (its masks,
    sbh + as²b, and the attention dropout's output, 2as²b in fp16, are not saved),
    which leaves ``2·(32·sbh + 2·as²b)`` bytes per layer, plus what the paper leaves
    out: the LayerNorms' mean and 1/std (4·sb fp32 values) and the causal mask
    (s² bools). Selective recomputation drops exactly the softmax output (4·as²b in
    fp32) and the mask; full recomputation keeps each layer's input (4·sbh)."""
    from dtlab import telemetry
    from dtlab.train import Trainer

    s, b, h, a, L = CFG.seq_len, B, CFG.d_model, CFG.n_heads, CFG.n_layers
    sbh = s * b * h
    measured, params = {}, {}
    for mode in ("none", "selective", "full"):
        rec = telemetry.Recorder(0)
        with telemetry.use(rec):
            config = TrainConfig(
                model=CFG, steps=2, global_batch_size=B, activation_checkpointing=mode
            )
            trainer = Trainer(config)
            trainer.fit()
        measured[mode] = [e for e in rec.events if e["kind"] == "memory"][-1][
            "activations"
        ]
        params[mode] = trainer.full_parameters()
    for mode in ("selective", "full"):
        for name, p in params["none"].items():
            assert torch.equal(params[mode][name], p), (mode, name)
    per_layer = 2 * (32 * sbh + 2 * a * s * s * b) + 4 * s * b * 4 + s * s
    # the embeddings, final LayerNorm, head and loss are the same in all modes
    outside = measured["full"] - L * 4 * sbh
    assert measured["none"] == outside + L * per_layer
    assert measured["none"] - measured["selective"] == L * (4 * a * s * s * b + s * s)


@pytest.mark.cluster
def test_checkpointing_on_composed_layouts_is_exact_and_saves_memory(lab_cluster):
    cases = [
        (Layout(dp=2, tp=2), "ddp"),
        (Layout(tp=2, pp=2), "zero1"),
        (Layout(dp=2, tp=2), "zero3"),  # blocks re-gathered for their recomputation
    ]
    results = lab_cluster(4).run(_checkpointing_runs, cases, timeout=300)
    for layout, strategy in cases:
        for rank, out in enumerate(results):
            base = out[str(layout), strategy, "none"]
            for mode in ("selective", "full"):
                run = out[str(layout), strategy, mode]
                where = f"{layout} {strategy} {mode} rank {rank}"
                # recomputation reruns the same operations on the same inputs (tp
                # collectives included): the same bits
                assert run["losses"] == base["losses"], where
                for name, p in base["params"].items():
                    assert torch.equal(run["params"][name], p), (where, name)
            sel = out[str(layout), strategy, "selective"]["activations"]
            full = out[str(layout), strategy, "full"]["activations"]
            assert full < sel < base["activations"], (layout, strategy, rank)


# ---- mixed precision on composed layouts (chapter 06 × 07) ---------------------------
PRECISION_CASES = [
    (Layout(dp=2, tp=2), "ddp", "fp16"),
    (Layout(dp=2, tp=2), "zero3", "bf16"),
    (Layout(tp=2, pp=2), "zero1", "bf16"),
    (Layout(dp=2, pp=2), "ddp", "bf16"),
    # not fp16 with a pipeline: whether a scaled fp16 backward overflows depends on
    # how the batch is cut into microbatches (see tests/test_amp_strategies.py)
]


@pytest.mark.cluster
def test_16bit_composed_layouts_track_the_same_casts_reference(lab_cluster):
    """Tolerance as in tests/test_amp_strategies.py: the composed run rounds other
    partial sums to 16 bits than the single process (a dp slice's mean, a tp shard
    of a matmul, a 16-bit all-reduce), each rounding worth up to 2^-8 (bf16) or
    2^-11 (fp16) relative; the loss is computed in fp32 from the 16-bit logits.
    Measured here at most 9.2e-5 (bf16) and 2.8e-6 (fp16), allowed 2e-3 and 3e-4.
    No step overflows (with the loss in fp32, 2^16 · loss is no longer inf in
    fp16's first backward), and every rank must take the reference's decisions."""
    configs = [_config(lay, s, precision=p) for lay, s, p in PRECISION_CASES]
    results = lab_cluster(4).run(_train_many, configs, timeout=300)
    for i, config in enumerate(configs):
        ref = train_reference(
            CFG, steps=STEPS, global_batch_size=B, precision=config.precision
        )
        runs = [r[i] for r in results]
        what = f"{config.layout} {config.strategy} {config.precision}"
        assert all(run["losses"] == runs[0]["losses"] for run in runs), what
        assert all(run["skipped"] == runs[0]["skipped"] for run in runs), what
        assert runs[0]["skipped"] == [r["skipped"] for r in ref.records], what
        rel = 2e-3 if config.precision == "bf16" else 3e-4
        assert runs[0]["losses"] == pytest.approx(ref.losses, rel=rel), what


# ---- resume: Trainer.state_dict / load_state_dict --------------------------------
RESUME_CASES = [
    (Layout(dp=2, tp=2), "ddp", "fp16"),  # fp16: the loss scaler's state matters
    (Layout(tp=2, pp=2), "zero1", "fp32"),
    (Layout(dp=2, pp=2), "zero3", "bf16"),
]


def _stop_and_resume(cases, steps=4, stop_at=2):
    """On every rank: the uninterrupted run, and a run stopped after ``stop_at``
    steps whose per-rank state is loaded into a fresh trainer that finishes."""
    from dtlab.topology import Topology
    from dtlab.train import Trainer

    out = {}
    for layout, strategy, precision in cases:
        topo = Topology(layout)
        config = _config(layout, strategy, precision=precision)
        whole = Trainer(config, topo)
        whole.fit(steps)
        first = Trainer(config, topo)
        first.fit(stop_at)
        state = first.state_dict()
        first.fit(1)  # training on must not change the saved state
        again = Trainer(config, topo)
        again.load_state_dict(state)
        again.fit(steps - stop_at)
        out[str(layout), strategy, precision] = (
            [r["loss"] for r in whole.records],
            [r["loss"] for r in again.records],
            [r["step"] for r in again.records],
        )
    return out


@pytest.mark.cluster
def test_a_resumed_composed_run_continues_bit_for_bit(lab_cluster):
    results = lab_cluster(4).run(_stop_and_resume, RESUME_CASES, timeout=300)
    for out in results:
        for key, (whole, resumed, steps) in out.items():
            assert steps == [2, 3], key
            assert resumed == whole[2:], key  # fp32 on gloo: the same bits


@pytest.mark.cluster
@pytest.mark.slow  # 9 steps on 8 engines
def test_a_resumed_3d_run_continues_bit_for_bit(lab_cluster):
    # all three axes > 1, ZeRO-1 slices over dp, the fp16 loss scaler's state
    case = [(Layout(dp=2, tp=2, pp=2), "zero1", "fp16")]
    results = lab_cluster(8).run(_stop_and_resume, case, timeout=300)
    for out in results:
        ((whole, resumed, steps),) = out.values()
        assert steps == [2, 3]
        assert resumed == whole[2:]


def test_a_state_from_another_config_or_rank_is_refused():
    from dtlab.train import Trainer

    config = TrainConfig(model=CFG, steps=1, global_batch_size=4)
    trainer = Trainer(config)
    trainer.fit(1)
    state = trainer.state_dict()
    other = Trainer(config.replace(lr=2e-3))
    with pytest.raises(ValueError, match="differs in \\['lr'\\]"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="belongs to the rank"):
        Trainer(config).load_state_dict({**state, "coords": {"pp": 1, "dp": 0}})
    again = Trainer(config)
    again.load_state_dict(state)
    assert again.fit(1)[-1]["loss"] == trainer.fit(1)[-1]["loss"]


# ---- what cannot run is refused before anything starts ----------------------------
@pytest.mark.parametrize(
    "layout, changes, match",
    [
        (Layout(dp=2, pp=2), dict(strategy="zero2", schedule="zb_h1"), "zb_h1"),
        (Layout(dp=2, pp=2), dict(chunks=2), "interleaved"),
        (Layout(dp=2, pp=2), dict(microbatches=3), "microbatches=3"),
        (Layout(dp=2, pp=2), dict(global_batch_size=4, microbatches=4), "multiple"),
        (Layout(pp=4), dict(schedule="interleaved", chunks=2), "n_layers"),
        (Layout(dp=2, tp=2), dict(microbatches=2), "pp=1"),
        (Layout(dp=2, tp=2), dict(strategy="ddp", offload=True), "offload"),
        (Layout(tp=4), dict(model=GPTConfig(n_heads=2, d_model=32)), "n_heads"),
    ],
)
def test_configs_that_do_not_compose_say_what_to_change(layout, changes, match):
    config = TrainConfig(
        **{"model": CFG, "layout": layout, "global_batch_size": B, **changes}
    )
    with pytest.raises(ValueError, match=match):
        config.check(4)

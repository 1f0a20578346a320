"""The planner's estimates (dtlab.estimate, chapter 09): memory and traffic of a
layout computed by hand for a tiny GPT, then measured on live ranks — DDP and ZeRO
through the trainer, tensor and pipeline parallelism through their modules.

Margins. Model states and wire bytes are exact (the formulas count the same tensors
and the same collectives). Activations are Korthikanti et al.'s count, which
includes dropout masks and dropout outputs that dtlab's GPT (dropout 0) never saves:
the estimate is an upper bound, and the tests check it stays within 25 % of the
measurement on these shapes (measured: 0.89-0.91 of the estimate for dp, tp and pp).

DDP and ZeRO are measured through the trainer on dp=4; tensor parallelism (with and
without sequence parallelism), ZeRO-3 over tp and the pipeline (1F1B and GPipe, each
stage against its own prediction) through the trainer on dp=2 x tp=2 / pp=2.
"""

import pytest

from dtlab import estimate as est
from dtlab.model import GPTConfig
from dtlab.topology import Layout

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layers=4, n_heads=2, d_model=16)
PSI = 13792  # 4 blocks x 3280 + wte 512 + wpe 128 + ln_f 32 (tied head)
BLOCK, ROOT = 3280, 672
ADAM_STEP_BYTES = 4  # AdamW's step counter: one fp32 scalar per tensor it steps
# a loss, a norm, an overflow flag: a few bytes each, not the model's traffic
IGNORED_TAGS = (
    "metrics",
    "zero/grad-norm",
    "grad_norm",
    "loss",
    "pp-step",
    "found_inf",
)


# ---- by hand -------------------------------------------------------------------------
def test_stage_params_by_hand():
    assert CFG.n_params() == PSI == est.model_spec(CFG).n_params
    # attention 4h² + 4h biases; MLP 8h² + 5h biases; two LayerNorms 4h
    h = 16
    assert BLOCK == 4 * h * h + 4 * h + 8 * h * h + 5 * h + 4 * h
    full = est.stage_params(CFG, Layout(dp=4))
    assert (full["blocks"], full["root"], full["total"]) == (BLOCK, ROOT, PSI)
    # tp=2: the matrices and the column biases (q, k, v: 3h; fc: 4h) halve, the
    # norms (4h) and the row-parallel biases (proj, fc2: 2h) stay whole
    tp = est.stage_params(CFG, Layout(tp=2))
    assert tp["blocks"] == (12 * h * h + 7 * h) / 2 + 4 * h + 2 * h
    assert tp["total"] == est.tp_params_per_rank(
        4, 16, 32, 2, seq_len=8, bias=True, layernorm=True
    )
    # pp=2: embeddings on stage 0, the final norm and a copy of the tied head on 1
    s0, s1 = (est.stage_params(CFG, Layout(pp=2), s) for s in (0, 1))
    assert s0["total"] == 2 * BLOCK + 32 * h + 8 * h
    assert s1["total"] == 2 * BLOCK + 2 * h + 32 * h
    with pytest.raises(ValueError, match="stage 2"):
        est.stage_params(CFG, Layout(pp=2), 2)


def test_layout_memory_by_hand_dp_and_zero():
    # fp32 Adam: 4 + 4 + 8 bytes per parameter
    ddp = est.layout_memory(CFG, Layout(dp=4))
    assert (ddp["params"], ddp["grads"], ddp["optimizer"]) == (
        4 * PSI,
        4 * PSI,
        8 * PSI,
    )
    # activations, microbatch 1, fp32: per layer sbh(34 + 5as/h) x 2, 4 layers,
    # plus the head's inputs 2sbh and the log-softmax sbV, 4 bytes each
    s, h, a, V = 8, 16, 2, 32
    layer = s * h * (34 + 5 * a * s / h) * 2
    assert ddp["activations"] == 4 * layer + s * (2 * h + V) * 4
    assert ddp["total"] == 16 * PSI + ddp["activations"]
    for stage, (p, g, o) in {1: (4, 4, 2), 2: (4, 1, 2), 3: (1, 1, 2)}.items():
        m = est.layout_memory(CFG, Layout(dp=4), zero_stage=stage)
        assert (m["params"], m["grads"], m["optimizer"]) == (
            p * PSI,
            g * PSI,
            o * PSI,
        ), stage
        assert m["activations"] == ddp["activations"]  # ZeRO does not shard them
    # bf16 with fp32 master weights: 2-byte weights, 2-byte grads + the fp32 slice
    # the optimizer reads (dtlab's accounting); the paper counts 2 + 2 + 12
    mixed = est.layout_memory(CFG, Layout(dp=4), zero_stage=2, precision="bf16")
    assert (mixed["params"], mixed["grads"], mixed["optimizer"]) == (
        2 * PSI,
        4 * PSI / 4,
        12 * PSI / 4,
    )
    paper = est.layout_memory(
        CFG, Layout(dp=4), zero_stage=2, precision="bf16", states="paper"
    )
    assert (paper["grads"], paper["optimizer"]) == (2 * PSI / 4, 12 * PSI / 4)
    # 2-byte activations; the loss's log-softmax stays fp32
    assert mixed["activations"] == 4 * layer / 2 + s * (2 * h * 2 + V * 4)
    # padding: dp=3 pads every unit (root, each block) to a multiple of 3
    z3 = est.layout_memory(CFG, Layout(dp=3), zero_stage=3)
    assert z3["params"] == 4 * (672 + 4 * 3282) / 3


def test_layout_memory_by_hand_tp_pp():
    h, s, V = 16, 8, 32
    tp = est.layout_memory(CFG, Layout(tp=2))
    assert tp["params"] == 4 * est.stage_params(CFG, Layout(tp=2))["total"]
    # Korthikanti with t=2: sbh(10 + 24/t + 5as/(ht)) x 2 bytes/2 x 4 (fp32)
    layer = s * h * (10 + 12 + 5 * 2 * s / (h * 2)) * 2
    assert tp["activations"] == 4 * layer + s * (2 * h * 4 + 4 * V / 2)
    sp = est.layout_memory(CFG, Layout(tp=2), sequence_parallel=True)
    assert sp["activations"] == pytest.approx(
        4 * s * h / 2 * (34 + 5 * 2 * s / h) * 2 + s * (2 * h * 4 + 4 * V / 2)
    )
    # pp=2, 1F1B, m=4: stage 0 holds min(p - 0, m) = 2 microbatches of 2 layers
    kw = dict(microbatches=4, schedule="1f1b")
    s0 = est.layout_memory(CFG, Layout(pp=2), stage=0, **kw)
    s1 = est.layout_memory(CFG, Layout(pp=2), stage=1, **kw)
    layer = s * h * (34 + 5 * 2 * s / h) * 2
    assert s0["activations"] == 2 * 2 * layer
    assert s1["activations"] == 1 * 2 * layer + s * (2 * h + V) * 4
    gpipe = est.layout_memory(
        CFG, Layout(pp=2), stage=0, microbatches=4, schedule="gpipe"
    )
    assert gpipe["activations"] == 4 * 2 * layer
    assert est.layout_memory(CFG, Layout(pp=2), **kw) == max(
        s0, s1, key=lambda m: m["total"]
    )
    # checkpointing: selective drops the scores, full keeps each layer's input
    sel = est.layout_memory(CFG, Layout(dp=1), checkpointing="selective")
    assert sel["activations"] == 4 * s * h * 34 * 2 + s * (2 * h + V) * 4
    full = est.layout_memory(CFG, Layout(dp=1), checkpointing="full")
    one_layer = s * h * (34 + 5 * 2 * s / h) * 2
    assert full["activations"] == 4 * 2 * s * h * 2 + one_layer + s * (2 * h + V) * 4


def test_layout_traffic_by_hand():
    # DDP: one all-reduce of Ψ fp32 gradients, 2(N-1)/N·Ψ·4
    assert est.layout_traffic(CFG, Layout(dp=4)) == {
        "dp": 2 * 3 / 4 * PSI * 4,
        "tp": 0,
        "pp": 0,
    }
    z3 = est.layout_traffic(CFG, Layout(dp=4), zero_stage=3, precision="bf16")
    assert z3["dp"] == 3 * 3 / 4 * PSI * 2  # 3Ψ in bf16
    # accumulation over 2 microbatches: ZeRO-2 reduce-scatters each, gathers once
    z2 = est.layout_traffic(CFG, Layout(dp=4), zero_stage=2, microbatches=2)
    assert z2["dp"] == (2 + 1) * 3 / 4 * PSI * 4
    ddp = est.layout_traffic(CFG, Layout(dp=4), microbatches=2)
    assert ddp["dp"] == 2 * 3 / 4 * PSI * 4  # no_sync: once per step
    # tp=2, b=1: per block 4 all-reduces of S = s·h·4 = 512 bytes, each (t-1)/t·2S;
    # embedding g and head f: one each; the loss: 3 all-reduces of s fp32 numbers
    S = 8 * 16 * 4
    t = est.layout_traffic(CFG, Layout(tp=2))
    assert t["tp"] == 4 * 4 * S + S + S + 3 * 8 * 4
    assert t["dp"] == 0 and t["pp"] == 0
    # pp=2, m=4: each stage sends one activation (or gradient) per microbatch, and
    # the tied embedding's two copies are summed (all-reduce of 2 ranks: S bytes)
    p = est.layout_traffic(CFG, Layout(pp=2), microbatches=4)
    assert p["pp"] == 4 * S + 32 * 16 * 4
    both = est.layout_traffic(CFG, Layout(dp=2, pp=2), microbatches=4)
    stage0 = est.stage_params(CFG, Layout(pp=2), 0)["total"]
    assert both["dp"] == 2 * 1 / 2 * stage0 * 4


def test_layout_functions_reject_bad_input():
    with pytest.raises(ValueError, match="ZeRO stage"):
        est.layout_memory(CFG, Layout(dp=2), zero_stage=4)
    with pytest.raises(ValueError, match="precision"):
        est.layout_memory(CFG, Layout(dp=2), precision="fp8")
    with pytest.raises(ValueError, match="checkpointing"):
        est.layout_memory(CFG, Layout(dp=2), checkpointing="some")
    with pytest.raises(ValueError, match="schedule"):
        est.layout_memory(CFG, Layout(pp=2), schedule="2f2b")
    with pytest.raises(ValueError, match="microbatches"):
        est.layout_traffic(CFG, Layout(pp=2), microbatches=0)
    with pytest.raises(ValueError, match="layout"):
        est.layout_memory(CFG, "dp4")
    with pytest.raises(ValueError, match="unknown model"):
        est.layout_memory("71B", Layout(dp=2))
    with pytest.raises(ValueError, match="ep=3"):
        est.Parallelism(dp=4, ep=3)


# ---- measured on live ranks ----------------------------------------------------------
def _train_dp(strategy, steps=2, batch=8):
    """Two steps of the trainer with a recorder; the last step's memory event and
    wire bytes by axis (metric all-reduces left out)."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.train import TrainConfig, Trainer

    rec = telemetry.Recorder(dist.get_rank())
    config = TrainConfig(
        model=CFG, strategy=strategy, steps=steps, global_batch_size=batch
    )
    with telemetry.use(rec):
        trainer = Trainer(config)
        trainer.fit()
        tensors = len(list(trainer.parameters()))
    last = steps - 1
    mem = [e for e in rec.events if e["kind"] == "memory" and e["step"] == last]
    return {"memory": mem[-1], "wire": _wire(rec.events, last), "tensors": tensors}


def _wire(events, step):
    out: dict = {}
    for e in events:
        if e["kind"] == "comm" and e["step"] == step and e["tag"] not in IGNORED_TAGS:
            out[e["axis"]] = out.get(e["axis"], 0) + e["wire_bytes"]
    return out


@pytest.fixture(scope="module")
def cluster(lab_cluster):
    return lab_cluster(4)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_dp_layouts_match_the_measured_accounting(cluster, strategy):
    stage = 0 if strategy == "ddp" else int(strategy[-1])
    runs = cluster.run(_train_dp, strategy, timeout=120)
    # global batch 8 over 4 ranks: microbatch 2
    want = est.layout_memory(CFG, Layout(dp=4), zero_stage=stage, micro_batch_size=2)
    traffic = est.layout_traffic(CFG, Layout(dp=4), zero_stage=stage)
    for run in runs:
        got = run["memory"]
        assert got["params"] == want["params"]
        assert got["grads"] == want["grads"]
        assert got["optimizer"] == want["optimizer"] + ADAM_STEP_BYTES * run["tensors"]
        # what dtlab's GPT saves, to the byte; the paper's count (dropout masks
        # included) is an upper bound within the margin of the module docstring
        exact = est.layout_memory(
            CFG, Layout(dp=4), zero_stage=stage, micro_batch_size=2,
            activations="dtlab",
        )  # fmt: skip
        acts = got["activations"]
        assert acts == exact["activations"]
        assert 0.75 * want["activations"] <= acts <= want["activations"]
        assert run["wire"] == {"dp": pytest.approx(traffic["dp"])}


def _train_3d(layout, strategy, extra, steps=2, batch=8):
    """Two steps of the trainer on a dp x tp x pp layout: the last step's model
    states, the peak activations, and wire bytes by axis."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.train import TrainConfig, Trainer

    rec = telemetry.Recorder(dist.get_rank())
    config = TrainConfig(
        model=CFG,
        strategy=strategy,
        steps=steps,
        layout=layout,
        global_batch_size=batch,
        **extra,
    )
    with telemetry.use(rec):
        trainer = Trainer(config)
        trainer.fit()
        tensors = len(list(trainer.parameters()))
    last = steps - 1
    mem = [e for e in rec.events if e["kind"] == "memory" and e["step"] == last]
    step = [e for e in mem if e["phase"] == "step"][-1]
    # the pipeline executor reports the activations it holds after every action:
    # their peak is the stage's; without a pipeline, the forward's saved bytes
    in_flight = [e["activations"] for e in mem if e["phase"] == "pp"]
    return {
        "stage": layout.coords(dist.get_rank())["pp"],
        "memory": step,
        "activations": max(in_flight) if in_flight else step["activations"],
        "wire": _wire(rec.events, last),
        "tensors": tensors,
    }


LAYOUTS_3D = {
    "dp2-tp2": (Layout(dp=2, tp=2), "ddp", {}),
    "dp2-tp2-sp": (Layout(dp=2, tp=2), "ddp", {"sequence_parallel": True}),
    "dp2-tp2-zero3": (Layout(dp=2, tp=2), "zero3", {}),
    "dp2-pp2-1f1b": (Layout(dp=2, pp=2), "ddp", {"microbatches": 2}),
    "dp2-pp2-gpipe": (Layout(dp=2, pp=2), "ddp", {"microbatches": 2,
                                                   "schedule": "gpipe"}),
    # ZeRO reduce-scatters after every (pipeline) microbatch's backward
    "dp2-pp2-zero2": (Layout(dp=2, pp=2), "zero2", {"microbatches": 2}),
    "dp4-zero3-accum2": (Layout(dp=4), "zero3", {"grad_accum_steps": 2}),
    # ZeRO-1 keeps full gradients: it accumulates them and reduces once per step
    "dp2-pp2-zero1": (Layout(dp=2, pp=2), "zero1", {"microbatches": 2}),
    "dp4-zero1-accum2": (Layout(dp=4), "zero1", {"grad_accum_steps": 2}),
    # 16-bit compute, fp32 master weights: DDP, ZeRO, tp and pp
    "dp4-bf16": (Layout(dp=4), "ddp", {"precision": "bf16"}),
    "dp4-zero2-bf16": (Layout(dp=4), "zero2", {"precision": "bf16"}),
    "dp2-tp2-bf16": (Layout(dp=2, tp=2), "ddp", {"precision": "bf16"}),
    "dp2-pp2-bf16": (Layout(dp=2, pp=2), "ddp", {"precision": "bf16",
                                                  "microbatches": 2}),
    # activation checkpointing (chapter 08)
    "dp4-selective": (Layout(dp=4), "ddp", {"activation_checkpointing": "selective"}),
    "dp4-full": (Layout(dp=4), "ddp", {"activation_checkpointing": "full"}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS_3D))
def test_3d_layouts_match_the_measurement(cluster, name):
    layout, strategy, extra = LAYOUTS_3D[name]
    runs = cluster.run(_train_3d, layout, strategy, extra, timeout=120)
    m = extra.get("microbatches", extra.get("grad_accum_steps", 1))
    kw = dict(
        zero_stage=0 if strategy == "ddp" else int(strategy[-1]),
        micro_batch_size=8 // (layout.dp * m),  # global batch 8
        microbatches=m,
        sequence_parallel=extra.get("sequence_parallel", False),
        precision=extra.get("precision", "fp32"),
    )
    ck = extra.get("activation_checkpointing", "none")
    for run in runs:
        want = est.layout_memory(
            CFG,
            layout,
            stage=run["stage"],
            schedule=extra.get("schedule", "1f1b"),
            checkpointing=ck,
            **kw,
        )
        traffic = est.layout_traffic(CFG, layout, stage=run["stage"], **kw)
        got = run["memory"]
        assert got["params"] == want["params"]
        assert got["grads"] == want["grads"]
        assert got["optimizer"] == want["optimizer"] + ADAM_STEP_BYTES * run["tensors"]
        acts = run["activations"]
        exact = est.layout_memory(
            CFG, layout, stage=run["stage"], schedule=extra.get("schedule", "1f1b"),
            checkpointing=ck, activations="dtlab", **kw,
        )["activations"]  # fmt: skip
        # to the byte, but for what sequence parallelism's embedding saves less
        # than counted (a few hundred bytes, dtlab_saved_bytes_outside_layers)
        slack = 512 if kw["sequence_parallel"] else 0
        assert abs(acts - exact) <= slack, (run["stage"], acts, exact)
        if ck == "full":
            # the trainer counts what the forward saves (each block's input, the
            # head's); the paper's estimate adds the block recomputed in backward
            b, s, h, a = kw["micro_batch_size"], CFG.seq_len, CFG.d_model, 2
            layer = est.activation_bytes_per_layer(s, b, h, a, bytes_per_value=4)
            assert want["activations"] - layer <= acts <= want["activations"]
        else:
            assert 0.75 * want["activations"] <= acts <= want["activations"], run
        expected = {k: pytest.approx(v) for k, v in traffic.items() if v}
        assert run["wire"] == expected, run["stage"]


# ---- the planner ---------------------------------------------------------------------
PSI_70B = est.MODELS["70B"].n_params


def test_70b_bytes_per_device_per_zero_stage():
    # ZeRO §5.1 with mixed-precision Adam: 2Ψ weights + 2Ψ gradients + 12Ψ
    # optimizer states, divided by N_d = 8 one kind more at each stage
    psi, n = PSI_70B, 8
    expected = {
        0: (2 * psi, 2 * psi, 12 * psi),
        1: (2 * psi, 2 * psi, 12 * psi / n),
        2: (2 * psi, 2 * psi / n, 12 * psi / n),
        3: (2 * psi / n, 2 * psi / n, 12 * psi / n),
    }
    for stage, (p, g, o) in expected.items():
        m = est.layout_memory(
            "70B",
            est.Parallelism(dp=8),
            zero_stage=stage,
            precision="bf16",
            states="paper",
        )
        assert (m["params"], m["grads"], m["optimizer"]) == pytest.approx((p, g, o))
    # ZeRO-3 over 8: 16Ψ/8 = 138 GB of model states alone, more than 80 GB
    assert 16 * psi / 8 / est.GB == pytest.approx(137.95, abs=0.01)
    plan = est.plan("70B", n_gpus=8, global_batch=64)
    assert plan.fits == [] and plan.best is None
    why = plan.rejected[0].why
    assert "needs" in why and "80GB" in why.replace(" ", "")
    # every rejected dp8 layout's states are the hand-computed ones
    row = next(r for r in plan.rejected if (r.layout.dp, r.zero_stage) == (8, 3))
    assert row.memory["optimizer"] == pytest.approx(12 * psi / 8)
    # ZeRO-Offload moves the fp32 master, its gradient and Adam's moments to the
    # host: then 8 x 80 GB is enough
    off = est.plan("70B", n_gpus=8, global_batch=64, offload=True)
    best = off.best
    assert best is not None and best.memory["total"] <= 72 * est.GB
    n_s = best.layout.dp if best.zero_stage else 1
    stage_psi = est.stage_params("70B", best.layout)["total"]
    assert best.memory["host"] == pytest.approx((12 + 4) * stage_psi / n_s)


def test_tp_stays_inside_a_node_when_the_network_is_slow():
    eth = est.ClusterSpec(16, gpus_per_node=8, inter=est.LINKS["ethernet"])
    kw = dict(
        gpu=est.GPUS["H100-80GB"],
        cluster=eth,
        microbatches=16,
        checkpointing="full",
        sequence_parallel=True,
    )
    inside = est.layout_step_time("70B", est.Parallelism(tp=8, pp=2), **kw)
    across = est.layout_step_time("70B", est.Parallelism(tp=16), **kw)
    assert across["comm_s"] > 10 * inside["comm_s"]
    assert inside["step_s"] < across["step_s"]
    # the planner's choice keeps tp within the 8 GPUs of a node
    plan = est.plan("70B", cluster=eth, global_batch=64)
    assert plan.best.layout.tp <= 8
    across_rows = [r for r in plan.fits if r.layout.tp > 8]
    assert across_rows and across_rows[0].step_s > 2 * plan.best.step_s
    # with NVLink everywhere (16 GPUs in one node) tp=16's collectives get cheap
    big_node = est.ClusterSpec(16, gpus_per_node=16)
    fast = est.layout_step_time(
        "70B", est.Parallelism(tp=16), **{**kw, "cluster": big_node}
    )
    assert fast["comm_s"] < across["comm_s"] / 10


def test_step_time_parts_follow_the_chapters_formulas():
    gpu, cluster = est.GPUS["H100-80GB"], est.ClusterSpec(64)
    kw = dict(gpu=gpu, cluster=cluster, checkpointing="selective")
    # pipeline bubble: (p-1)/(m+p-1) of the pipelined time, shrinking with m
    fractions = []
    for m in (4, 8, 32):
        t = est.layout_step_time(
            "13B", est.Parallelism(dp=8, pp=8), microbatches=m, **kw
        )
        pipelined = t["step_s"] - t["dp_exposed_s"]
        fractions.append(t["bubble_s"] / pipelined)
        assert fractions[-1] == pytest.approx(est.pipeline_bubble_fraction(8, m))
    assert fractions == sorted(fractions, reverse=True)
    one = est.layout_step_time("13B", est.Parallelism(dp=64), microbatches=2, **kw)
    assert one["bubble_s"] == 0
    # interleaving 2 chunks halves the bubble
    base = dict(microbatches=8, **kw)
    plain = est.layout_step_time("13B", est.Parallelism(dp=8, pp=8), **base)
    inter = est.layout_step_time(
        "13B", est.Parallelism(dp=8, pp=8), schedule="interleaved", chunks=2, **base
    )
    assert inter["bubble_s"] < plain["bubble_s"]
    # ZeRO-3 moves 1.5x the bytes of DDP: more data-parallel time
    z0 = est.layout_step_time("13B", est.Parallelism(dp=64), zero_stage=0, **kw)
    z3 = est.layout_step_time("13B", est.Parallelism(dp=64), zero_stage=3, **kw)
    assert z3["dp_comm_s"] == pytest.approx(1.5 * z0["dp_comm_s"], rel=0.01)
    # compute: 3 x 2 x params x tokens at MFU, as chapter 00's 6ND
    spec = est.MODELS["13B"]
    t = est.layout_step_time(
        "13B",
        est.Parallelism(),
        microbatches=1,
        mfu=0.5,
        gpu=gpu,
        cluster=est.ClusterSpec(1),
    )
    six_nd = est.training_flops(spec.n_params, spec.seq_len) / (989e12 * 0.5)
    assert t["compute_s"] == pytest.approx(six_nd, rel=0.15)  # + attention's s²


def test_context_parallelism_splits_activations_and_rings_kv():
    # a tiny custom model: L=2, h=16, a=4 (2 K/V heads), s=8, V=32
    tiny = dict(
        n_layers=2, d_model=16, n_heads=4, vocab_size=32, seq_len=8, n_kv_heads=2
    )
    one = est.layout_memory(tiny, est.Parallelism(dp=2))
    two = est.layout_memory(tiny, est.Parallelism(dp=1, cp=2), cp_variant="ulysses")
    assert two["activations"] == pytest.approx(one["activations"] / 2)
    # the ring keeps no score matrix: the selective count, the attention output
    # and its log-sum-exp (s·b·h + a·s·b values a layer), all / cp
    ring = est.layout_memory(tiny, est.Parallelism(dp=1, cp=2))
    sel = est.layout_memory(tiny, est.Parallelism(dp=2), checkpointing="selective")
    kept = 2 * (8 * 16 + 4 * 8) * 4  # 2 layers, fp32
    assert ring["activations"] == pytest.approx((sel["activations"] + kept) / 2)
    # weights are replicated over cp like over dp: ZeRO-3 shards over dp·cp = 2
    z = est.layout_memory(tiny, est.Parallelism(cp=2), zero_stage=3)
    assert z["params"] == pytest.approx(one["params"] / 2, rel=0.01)
    traffic = est.layout_traffic(tiny, est.Parallelism(cp=2), microbatches=3)
    # per layer and microbatch: K and V of the whole sequence, b·s·h_kv each,
    # (cp-1)/cp of it sent forward, twice that backward; h_kv = 16·2/4 = 8
    kv = 2 * 1 * 8 * 8 * 4  # 2 tensors x b x s x h_kv x 4 bytes
    assert traffic["cp"] == 3 * 2 * 3 * (1 / 2) * kv
    # gradients are all-reduced over the cp ranks, like data parallel replicas
    params = est.model_spec(tiny).n_params
    assert traffic["dp"] == pytest.approx(2 * (1 / 2) * params * 4)


def test_expert_parallelism_places_experts_and_all_to_alls_tokens():
    moe = dict(
        n_layers=2,
        d_model=16,
        n_heads=2,
        vocab_size=32,
        seq_len=8,
        n_experts=4,
        top_k=2,
    )
    spec = est.model_spec(moe)
    mlp = 2 * 16 * 64
    dense = est.model_spec({**moe, "n_experts": 1, "top_k": 1}).n_params
    assert spec.n_params == dense + 2 * (3 * mlp + 16 * 4)  # 3 more MLPs, router
    one = est.stage_params(moe, est.Parallelism(dp=4))
    four = est.stage_params(moe, est.Parallelism(dp=4, ep=4))
    assert one["experts"] == 4 * mlp and four["experts"] == mlp  # one each
    assert four["blocks"] == one["blocks"]  # attention stays replicated
    t = est.layout_traffic(moe, est.Parallelism(dp=4, ep=4), micro_batch_size=2)
    # dispatch + combine, forward and backward: 4 all-to-alls per MoE layer of
    # b·s·top_k tokens of h values, (ep-1)/ep of them leave the rank; and the
    # all-gather of each rank's (E,) row counts that tells every rank the splits
    counts = est.ep_bytes_per_layer(16, 16, 4, n_experts=4, top_k=2)["counts"]
    assert counts > 0
    assert t["ep"] == 2 * (4 * (3 / 4) * (2 * 8 * 2 * 16 * 4) + counts)
    # the experts' gradients are reduced only among the dp/ep ranks holding them
    dense_rank = one["root"] + 2 * one["blocks"]
    assert t["dp"] == pytest.approx(2 * 3 / 4 * dense_rank * 4)  # ep = dp: none
    # Mixtral 8x7B: 46.7B parameters, ~13B active per token
    assert est.MOE_MODELS["8x7B"].n_params == pytest.approx(46.7e9, rel=0.01)
    with pytest.raises(ValueError, match="top_k"):
        est.model_spec({**moe, "top_k": 5})


def test_serving_needs_weights_and_kv_cache_only():
    psi = PSI_70B
    serve = est.serving_memory("70B", tp=8, batch=16, context=4096)
    assert serve["weights"] == pytest.approx(2 * psi / 8)
    # K and V, per layer and token: 2 x 80 x 16 x 4096 x (8192·8/64) x 2 bytes / 8
    assert serve["kv_cache"] == 2 * 80 * 16 * 4096 * 1024 * 2 / 8
    train = est.layout_memory(
        "70B",
        est.Parallelism(tp=8),
        precision="bf16",
        checkpointing="full",
        states="paper",
    )
    assert train["total"] > 7 * serve["weights"]  # 16 bytes a parameter vs 2


def test_plan_rows_are_tables_and_inputs_are_checked():
    plan = est.plan("7B", n_gpus=8, global_batch=32, micro_batch_sizes=(1,))
    row = plan.table(1)[0]
    for key in (
        "dp",
        "tp",
        "pp",
        "zero",
        "params_GB",
        "activations_GB",
        "total_GB",
        "compute_s",
        "comm_s",
        "bubble_s",
        "step_s",
        "fits",
        "why",
    ):
        assert key in row
    steps = [r.step_s for r in plan.fits]
    assert steps == sorted(steps)
    assert all(r.memory["total"] <= 72 * est.GB for r in plan.fits)
    # the matmuls' efficiency is the input; each row's MFU is the step's output
    assert plan.assumptions["kernel_efficiency"] == 0.5
    best = plan.best
    assert 0 < best.mfu < 0.5 and best.achieved_flops_per_gpu == pytest.approx(
        best.mfu * 989e12
    )
    custom = dict(layers=4, hidden=256, heads=4, vocab=1000, sequence=128)
    untied = est.model_params(4, 256, 1000, tied_embeddings=False)
    assert est.model_spec(custom).n_params == untied  # a separate head by default
    assert est.plan(custom, n_gpus=2, global_batch=8).best.fits
    # a custom model's keys are checked by name: a typo, or a missing shape
    with pytest.raises(ValueError, match="hiden"):
        est.model_spec({**custom, "hiden": 256})
    with pytest.raises(ValueError, match="vocab_size"):
        est.model_spec({k: v for k, v in custom.items() if k != "vocab"})
    assert set(est.CUSTOM_DEFAULTS) >= {"d_ff", "tied_embeddings", "dropout"}
    with pytest.raises(ValueError, match="n_gpus"):
        est.plan("7B", global_batch=8)
    with pytest.raises(ValueError, match="gpu"):
        est.plan("7B", n_gpus=8, gpu="V100")
    with pytest.raises(ValueError, match="global_batch"):
        est.plan("7B", n_gpus=8, global_batch=0)
    with pytest.raises(ValueError, match="mfu"):
        est.layout_step_time(
            "7B",
            est.Parallelism(),
            gpu=est.GPUS["H100-80GB"],
            cluster=est.ClusterSpec(1),
            mfu=2,
        )

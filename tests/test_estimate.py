"""dtlab.estimate: formulas checked against numbers computed by hand from the papers."""

import math

import pytest

from dtlab import estimate as est
from dtlab.estimate import GB


@pytest.mark.parametrize(
    "precision, optimizer, expected",
    [
        ("fp32", "adam", (4, 4, 8)),
        ("mixed", "adam", (2, 2, 12)),  # ZeRO §3: K = 12
        ("mixed", "adamw", (2, 2, 12)),
        ("pure_bf16", "adam", (2, 2, 4)),
        # a run's precision names mean what such a run keeps (dtlab.events)
        ("bf16", "adam", (2, 2, 12)),
        ("fp16", "adam", (2, 2, 12)),
        ("fp32", "sgd", (4, 4, 0)),
        ("fp32", "sgd_momentum", (4, 4, 4)),
        ("mixed", "sgd", (2, 2, 4)),
    ],
)
def test_bytes_per_param(precision, optimizer, expected):
    b = est.bytes_per_param(precision, optimizer)
    assert (b.params, b.grads, b.optimizer) == expected
    assert b.total == sum(expected) and b.K == expected[2]


def test_zero_paper_figure_1():
    # Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    psi, n = 7.5e9, 64
    totals = [est.zero_memory_per_device(psi, n, s)["total"] / GB for s in range(4)]
    assert totals[0] == pytest.approx(120.0)
    assert totals[1] == pytest.approx(30 + 90 / 64)  # 31.40625
    assert totals[2] == pytest.approx(15 + 105 / 64)  # 16.640625
    assert totals[3] == pytest.approx(120 / 64)  # 1.875
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]


def test_zero_stage_breakdown_and_general_precision():
    m = est.zero_memory_per_device(1000, 4, 2, precision="fp32", optimizer="adam")
    assert m == {"params": 4000, "grads": 1000, "optimizer": 2000, "total": 7000}
    one = est.zero_memory_per_device(1000, 1, 3)
    assert one["total"] == 16000  # one rank: nothing to shard


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_params=-1, world_size=2, stage=1), "n_params"),
        (dict(n_params=1, world_size=0, stage=1), "world_size"),
        (dict(n_params=1, world_size=2, stage=4), "stage"),
        (dict(n_params=1, world_size=2, stage=1, precision="fp8"), "precision"),
        (dict(n_params=1, world_size=2, stage=1, optimizer="lion"), "optimizer"),
    ],
)
def test_zero_memory_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        est.zero_memory_per_device(**kwargs)


def test_activation_formula_by_hand():
    # GPT-3 175B layer, s=2048, b=1, h=12288, a=96 (Korthikanti Table 2, no parallelism)
    s, b, h, a = 2048, 1, 12288, 96
    by_hand = s * b * h * 34 + 5 * a * s * s * b
    assert est.activation_bytes_per_layer(s, b, h, a) == pytest.approx(by_hand)
    assert by_hand == 2048 * 12288 * (34 + 5 * 96 * 2048 / 12288)
    # t = 8 tensor parallel: sbh(10 + 24/t + 5as/(ht)); with SP: sbh/t (34 + 5as/h)
    tp = est.activation_bytes_per_layer(s, b, h, a, tp=8)
    assert tp == pytest.approx(s * b * h * (10 + 3 + 5 * a * s / (h * 8)))
    sp = est.activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True)
    assert sp == pytest.approx(by_hand / 8)
    sel = est.activation_bytes_per_layer(s, b, h, a, recompute="selective")
    assert sel == pytest.approx(34 * s * b * h)
    assert est.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    fp32 = est.activation_bytes_per_layer(s, b, h, a, bytes_per_value=4)
    assert fp32 == pytest.approx(2 * by_hand)
    assert est.activation_bytes(96, s, b, h, a) == pytest.approx(96 * by_hand)
    with pytest.raises(ValueError, match="recompute"):
        est.activation_bytes_per_layer(s, b, h, a, recompute="some")
    with pytest.raises(ValueError, match="seq_len"):
        est.activation_bytes_per_layer(-1, b, h, a)


def test_model_params_textbook_and_presets():
    assert est.model_params(2, 64, 100) == 12 * 2 * 64**2 + 100 * 64
    # published sizes: LLaMA-2 6.74B / 13.02B / 68.98B, GPT-3 ~175B, Llama 3.1 405B
    expected = {
        "7B": 6.738e9,
        "13B": 13.016e9,
        "70B": 68.977e9,
        "175B": 174.6e9,
        "405B": 405.8e9,
    }
    for key, n in expected.items():
        assert est.MODELS[key].n_params == pytest.approx(n, rel=2e-3), key


def test_memory_per_device_adds_activations():
    m = est.memory_per_device("7B", world_size=8, stage=3, micro_batch=1)
    states = est.zero_memory_per_device(est.MODELS["7B"].n_params, 8, 3)
    acts = 32 * est.activation_bytes_per_layer(4096, 1, 4096, 32)
    assert m["activations"] == pytest.approx(acts)
    assert m["total"] == pytest.approx(states["total"] + acts)


@pytest.mark.parametrize(
    "op, expected",
    [
        ("all_reduce", 2 * 3 / 4 * 1000),
        ("reduce_scatter", 3 / 4 * 1000),
        ("all_gather", 3 / 4 * 1000),
        ("broadcast", 1000),
        ("send", 1000),
        ("recv", 0),
        ("barrier", 0),
    ],
)
def test_wire_bytes_ring(op, expected):
    assert est.wire_bytes(op, 1000, 4) == pytest.approx(expected)


def test_wire_bytes_edge_cases():
    assert est.wire_bytes("all_reduce", 1000, 1) == 0
    assert est.wire_bytes("send", 1000, 1) == 1000
    # all-reduce = reduce-scatter + all-gather, for every N
    for n in (2, 3, 8, 64):
        ar = est.wire_bytes("all_reduce", 4096, n)
        assert ar == pytest.approx(
            est.wire_bytes("reduce_scatter", 4096, n)
            + est.wire_bytes("all_gather", 4096, n)
        )
    with pytest.raises(ValueError, match="unknown collective"):
        est.wire_bytes("allreduce", 10, 2)
    with pytest.raises(ValueError, match="payload"):
        est.wire_bytes("all_reduce", -1, 2)
    with pytest.raises(ValueError, match="positive integer"):
        est.wire_bytes("all_reduce", 10, 0)


def test_bus_bandwidth_like_nccl_tests():
    # 1 GB all-reduce over 8 ranks in 10 ms: algbw 100 GB/s, busbw 175 GB/s
    assert est.bus_bandwidth("all_reduce", 1e9, 8, 0.01) == pytest.approx(175e9)
    assert est.bus_bandwidth_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert est.bus_bandwidth_factor("broadcast", 8) == 1.0


def test_collective_time_alpha_beta():
    t = est.collective_time("all_reduce", 1e6, 4, alpha_s=1e-5, bandwidth_Bps=1e9)
    assert t == pytest.approx(6 * 1e-5 + 1.5e6 / 1e9)
    assert est.collective_time("send", 0, 2, 1e-5, 1e9) == pytest.approx(1e-5)


def test_fit_alpha_beta_recovers_known_line():
    alpha, bw = 25e-6, 12e9
    sizes = [2**k for k in range(10, 28, 2)]
    # a deterministic +-1 % wiggle stands in for measurement noise
    times = [(alpha + s / bw) * (1 + 0.01 * math.sin(i)) for i, s in enumerate(sizes)]
    fit = est.fit_alpha_beta(sizes, times)
    assert fit.bandwidth_Bps == pytest.approx(bw, rel=0.02)
    exact = est.fit_alpha_beta(sizes, [alpha + s / bw for s in sizes])
    assert exact.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert exact.predict(1e6) == pytest.approx(alpha + 1e6 / bw)
    with pytest.raises(ValueError):
        est.fit_alpha_beta([1, 1], [1, 2])


def test_time_to_train():
    # 70B on 2T tokens on 1024 H100 at 40 % MFU: 8.4e23 FLOPs, about 24 days
    assert est.training_flops(70e9, 2e12) == pytest.approx(8.4e23)
    h100 = est.GPUS["H100-80GB"]
    seconds = est.train_time(70e9, 2e12, 1024, h100.peak_bf16_flops, 0.4)
    assert seconds == pytest.approx(8.4e23 / (1024 * 989e12 * 0.4))
    assert 23 < seconds / 86400 < 25
    with pytest.raises(ValueError, match="mfu"):
        est.train_time(1, 1, 1, 1, 1.5)


def test_one_flop_count_with_attention():
    # a GPT block (tied head): 6N + 12·l·h·s a token is Narayanan's
    # 72·B·s·l·h²(1 + s/6h + V/12lh); recomputation's hardware FLOPs their 96·...
    L, h, a, V, s = 4, 64, 4, 100, 32
    gpt = dict(n_layers=L, d_model=h, n_heads=a, vocab_size=V, seq_len=s,
               tied_embeddings=True)  # fmt: skip
    per_token = 72 * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)) / s
    assert est.model_flops_per_token(gpt) == pytest.approx(per_token)
    assert est.training_flops(gpt, 10 * s) == pytest.approx(10 * s * per_token)
    full = 96 * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert est.hardware_flops(gpt, s, recompute="full") == pytest.approx(full)
    # a bare parameter count is Kaplan's 6·N·D, attention left out
    assert est.training_flops(1e9, 1e6) == 6e15
    # grouped-query attention's k and v are narrower; SwiGLU has three matrices
    spec = est.MODELS["405B"]
    kv = spec.d_model * spec.n_kv_heads // spec.n_heads
    block = 2 * spec.d_model**2 + 2 * spec.d_model * kv + 3 * spec.d_model * spec.d_ff
    assert est.matmul_params(spec)["block"] == block
    # a mixture of experts: top_k of its experts, and MFU over those
    mix = est.MOE_MODELS["8x7B"]
    assert mix.active_params == pytest.approx(12.9e9, rel=0.01)
    assert est.active_params("8x7B") == mix.active_params < mix.n_params
    plan = est.plan("8x7B", n_gpus=64, global_batch=256)
    assert all(0 < r.mfu <= 1 for r in plan.fits)


def test_step_outputs_mfu_and_the_gpus_own_link():
    kw = dict(gpu=est.GPUS["H100-80GB"], cluster=est.ClusterSpec(8), microbatches=8)
    t = est.layout_step_time("13B", est.Parallelism(tp=8), kernel_efficiency=0.4, **kw)
    # MFU is an output: below the kernels' efficiency by the communication
    assert 0 < t["mfu"] < 0.4 and t["kernel_efficiency"] == 0.4
    assert t["achieved_flops_per_gpu"] == pytest.approx(t["mfu"] * 989e12)
    tokens = 8 * est.MODELS["13B"].seq_len
    assert t["model_flops"] == pytest.approx(est.training_flops("13B", tokens))
    assert est.layout_step_time("13B", est.Parallelism(tp=8), mfu=0.4, **kw) == t
    with pytest.raises(ValueError, match="not both"):
        est.layout_step_time("13B", est.Parallelism(), mfu=0.4, kernel_efficiency=0.4,
                             **kw)  # fmt: skip
    # NVLink per direction from the GPU: an A100's NVLink 3 against an H100's 4
    assert est.gpu_link(est.GPUS["A100-80GB"]).bandwidth_Bps == 300e9
    assert est.gpu_link(est.GPUS["H100-80GB"]).bandwidth_Bps == 450e9
    a100 = est.plan("13B", gpu="A100-80GB", n_gpus=8, global_batch=32)
    assert a100.assumptions["intra_GBps"] == 300
    slow = est.layout_step_time(
        "13B", est.Parallelism(tp=8), **{**kw, "gpu": est.GPUS["A100-80GB"]}
    )
    named = est.ClusterSpec(8, intra=est.LINKS["nvlink"])
    fast = est.layout_step_time(
        "13B", est.Parallelism(tp=8),
        **{**kw, "gpu": est.GPUS["A100-80GB"], "cluster": named},
    )  # fmt: skip
    assert slow["comm_s"] == pytest.approx(fast["comm_s"] * 1.5, rel=0.05)


def test_recomputation_priced_in_time():
    # full: a forward again, 1/(1 + backward/forward) of a layer's step
    kw = dict(layer_flops=3e12, score_values=1e8, score_flops=1e10,
              peak_flops=1e15, hbm_Bps=2e12)  # fmt: skip
    full = est.recompute_time_overhead("full", **kw)
    assert full["overhead"] == pytest.approx(1 / (1 + 11.9 / 7.7))
    two = est.recompute_time_overhead("full", backward_ratio=2.0, **kw)
    assert two["overhead"] == pytest.approx(1 / 3)  # the FLOPs' own ratio
    # selective: the score matmuls, and softmax (4 B) + dropout (5 B) a value
    sel = est.recompute_time_overhead("selective", **kw)
    want = 1e10 / 0.5e15 + 9 * 1e8 / (2e12 * 0.7)
    assert sel["recompute_s"] == pytest.approx(want)
    no_dropout = est.recompute_time_overhead("selective", dropout=False, **kw)
    assert no_dropout["recompute_s"] == pytest.approx(1e10 / 0.5e15 + 4e8 / 1.4e12)
    assert est.recompute_time_overhead("none", **kw)["overhead"] == 0


def test_llama_activations_and_the_ring():
    s, b, h, a, t = 8192, 1, 16384, 128, 8
    spec = est.MODELS["405B"]
    kw = dict(d_ff=spec.d_ff, n_kv_heads=8, gated_mlp=True, dropout=False)
    sbh = s * b * h
    # norms 4, q/k/v and MLP inputs 2 + 2 whole; q 2, k and v 4·8/128, the output
    # projection's input 2, SwiGLU 6·d_ff/h split; scores 2as/h (no dropout)
    split = 2 + 4 * 8 / 128 + 2 + 6 * spec.d_ff / h
    got = est.activation_bytes_per_layer(s, b, h, a, tp=t, **kw)
    assert got == pytest.approx(sbh * (8 + (split + 2 * a * s / h) / t))
    sp = est.activation_bytes_per_layer(
        s, b, h, a, tp=t, sequence_parallel=True, recompute="selective", **kw
    )
    assert sp == pytest.approx(sbh / t * (8 + split))
    # the ring: no score matrix, the output and its lse kept, all / cp
    ring = est.cp_activation_bytes_per_layer(
        s, b, h, a, 16, tp=t, sequence_parallel=True, **kw
    )
    assert ring == pytest.approx((sp + (sbh + a * s * b) * 2 / t) / 16)


def test_largest_model_per_zero_stage():
    # ZeRO's Table 2: 32 GB V100s, 64-way data parallel
    sizes = [est.largest_model(32 * GB, 64, s) for s in range(4)]
    assert [round(x / 1e9, 1) for x in sizes] == [2.0, 7.6, 14.4, 128.0]
    conv = est.zero_states_conventions(7.5e9, 64, 3, largest_layer_params=1e8)
    assert conv["paper"] == 16 * 7.5e9 / 64 and conv["dtlab"] == 18 * 7.5e9 / 64
    assert conv["deepspeed"] == 18 * 7.5e9 / 64 + 4e8


def test_gpu_presets():
    assert est.GPUS["A100-40GB"].memory_bytes == 40 * GB
    assert est.GPUS["H200-141GB"].memory_bytes == 141 * GB
    assert est.GPUS["A100-80GB"].peak_bf16_flops == 312e12


def test_run_reads_a_config_once_for_memory_and_traffic():
    from dtlab.model import GPTConfig
    from dtlab.topology import Layout
    from dtlab.train import TrainConfig

    model = GPTConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
    layout = Layout(dp=2, pp=2)
    config = TrainConfig(
        model=model, layout=layout, strategy="zero2", global_batch_size=16,
        grad_accum_steps=2, microbatches=2, precision="bf16",
    )  # fmt: skip
    run = est.Run.of(config)
    # 16 sequences / (dp 2 x 2 flushes x 2 microbatches) = 2 per microbatch
    assert (run.micro_batch_size, run.per_flush, run.per_step) == (2, 2, 4)
    assert run.zero_stage == 2 and run.precision == "bf16"
    common = dict(zero_stage=2, precision="bf16", micro_batch_size=2)
    # memory holds one flush's microbatches, traffic pays every microbatch
    assert run.memory(0) == est.layout_memory(
        model, layout, microbatches=2, stage=0, **common
    )
    assert run.traffic() == est.layout_traffic(model, layout, microbatches=4, **common)
    with pytest.raises(ValueError, match="has no layout"):
        est.Run.of(config.replace(layout=None))

"""FP8 training mechanics (dtlab.fp8): formats against torch's own numbers, the
scaled cast's error bounds, delayed against current scaling, Float8Linear against an
fp32 nn.Linear and its GEMM against torch._scaled_mm, FP8 weights all-gathered over
gloo with their bytes recorded, and the course's GPT trained in FP8 beside bf16.

Every tolerance is derived in the test that uses it. The two numbers they rest on:
rounding to nearest with m mantissa bits errs by at most u = 2^-(m+1) relative to a
normal value (e4m3: 2^-4, e5m2: 2^-3), and by at most half the smallest subnormal
below the normal range; fp32 sums of K terms err by at most about K·2^-24 of the
sum of magnitudes.
"""

import math

import pytest
import torch
from torch import nn

from dtlab import comm, fp8, telemetry
from dtlab.launch import spawn
from dtlab.model import GPT, GPTConfig

E4M3, E5M2 = fp8.FORMATS["e4m3"], fp8.FORMATS["e5m2"]
FP32_U = 2.0**-24  # fp32's unit roundoff


# ---- formats ------------------------------------------------------------------------
# bit patterns (sign 0): smallest subnormal 0x01; smallest normal: exponent field 1,
# mantissa 0 = 1 << m; largest: e4m3fn's S.1111.110 (S.1111.111 is its NaN), e5m2's
# S.11110.11 (exponent 11111 is inf/NaN)
BIT_PATTERNS = {"e4m3": (0x01, 0x08, 0x7E), "e5m2": (0x01, 0x04, 0x7B)}


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_format_table_agrees_with_torch_finfo_and_the_bits(name):
    row, f = fp8.format_table()[name], fp8.fp8_format(name)
    info = torch.finfo(f.dtype)
    assert row["max"] == info.max and row["smallest_normal"] == info.smallest_normal
    assert row["exponent_bits"] + row["mantissa_bits"] + 1 == info.bits
    # the same numbers read from the bytes themselves, not from finfo
    sub, normal, top = BIT_PATTERNS[name]
    bits = torch.tensor([sub, normal, top], dtype=torch.uint8).view(f.dtype).float()
    assert bits.tolist() == [row["smallest_subnormal"], row["smallest_normal"], f.max]
    # m mantissa bits: 1 + 2^-m is a number of the format, 1 + 2^-(m+1) (a tie)
    # rounds to even, back to 1
    m = row["mantissa_bits"]
    steps = torch.tensor([1 + 2.0**-m, 1 + 2.0 ** -(m + 1)]).to(f.dtype).float()
    assert steps.tolist() == [1 + 2.0**-m, 1.0]
    assert row["unit_roundoff"] == 2.0 ** -(m + 1)
    assert fp8.fp8_format(f.dtype) is f and fp8.fp8_format(name.upper()) is f


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_round_trip_error_is_within_half_an_ulp(name):
    f = fp8.fp8_format(name)
    gen = torch.Generator().manual_seed(0)
    lo, hi = math.log2(f.smallest_normal), math.log2(f.max)
    for scale in (1.0, 3.7, 2.0**-10):
        # magnitudes log-uniform over the format's whole normal range, after scaling
        mag = 2 ** (lo + (hi - lo) * torch.rand(20_000, generator=gen))
        x = mag * torch.sign(torch.randn(20_000, generator=gen)) / scale
        q, s = fp8.quantize(x, name, scale)
        assert q.dtype == f.dtype and float(s) == pytest.approx(scale)
        rel = ((fp8.dequantize(q, s) - x).abs() / x.abs()).max().item()
        # the bound holds, and is nearly reached: a wrong mantissa count fails
        assert 0.85 * f.unit_roundoff < rel <= f.unit_roundoff, rel
    # below the normal range the error is absolute: half the smallest subnormal
    tiny = torch.rand(10_000, generator=gen) * f.smallest_normal
    err = (fp8.dequantize(fp8.quantize(tiny, name, 1.0)[0], 1.0) - tiny).abs().max()
    assert err <= f.smallest_subnormal / 2


def test_saturation_clamps_where_a_plain_cast_overflows():
    x = torch.tensor([1e6, -1e6, 500.0, 57344.0 * 1.2, 1.0])
    q4, _ = fp8.quantize(x, "e4m3", 1.0)
    q5, _ = fp8.quantize(x, "e5m2", 1.0)
    assert q4.float().tolist() == [448.0, -448.0, 448.0, 448.0, 1.0]
    assert q5.float().tolist() == [57344.0, -57344.0, 512.0, 57344.0, 1.0]
    assert torch.isinf(x[:1].to(torch.float8_e5m2).float()).all()  # why we clamp
    assert fp8.saturated_fraction(x, "e4m3", 1.0) == pytest.approx(4 / 5)
    assert fp8.saturated_fraction(x, "e5m2", 1.0) == pytest.approx(3 / 5)


# ---- scaling ------------------------------------------------------------------------
def test_delayed_scaling_uses_the_history_before_the_current_tensor():
    d = fp8.DelayedScaling("e4m3", history_len=2, margin=1)
    amaxes = [1.0, 2.0, 4.0, 3.0, 0.5, 0.25]
    used = [float(d.quantize(torch.tensor([a, -a / 2]))[1]) for a in amaxes]
    # call 0 scales from itself; call t from max(amax[t-2], amax[t-1]); margin 1
    # halves every scale: 448 / (amax · 2)
    expected_amax = [1.0, 1.0, 2.0, 4.0, 4.0, 3.0]
    assert used == [pytest.approx(448 / (a * 2)) for a in expected_amax]
    assert d.history.tolist() == [0.5, 0.25]
    assert float(d.scale) == pytest.approx(448 / (0.5 * 2))  # the next call's


def test_delayed_scaling_saturates_on_a_jump_that_current_scaling_absorbs():
    gen = torch.Generator().manual_seed(1)
    delayed = fp8.DelayedScaling("e4m3", history_len=4)
    current = fp8.CurrentScaling("e4m3")
    for _ in range(5):  # a steady regime, amax about 1
        x = torch.randn(256, generator=gen).clamp(-1, 1)
        delayed.quantize(x), current.quantize(x)
    spike = torch.randn(256, generator=gen) * 100  # amax jumps ~100x (a loss spike)
    stale = delayed.scale.clone()
    q_d, s_d = delayed.quantize(spike)
    q_c, s_c = current.quantize(spike)
    assert torch.equal(s_d, stale)  # the scale was fixed before the spike was seen
    assert fp8.saturated_fraction(spike, "e4m3", s_d) > 0.9
    assert fp8.dequantize(q_d, s_d).abs().max() <= 448 / float(s_d) * (1 + 1e-6)
    assert fp8.saturated_fraction(spike, "e4m3", s_c) == 0
    normal = spike.abs() * s_c >= E4M3.smallest_normal
    rel = (fp8.dequantize(q_c, s_c) - spike).abs()[normal] / spike.abs()[normal]
    assert rel.max() <= E4M3.unit_roundoff
    # one call later the history holds the spike: delayed scaling has caught up
    assert float(delayed.scale) == pytest.approx(448 / spike.abs().max().item())


def test_zero_and_non_finite_amax():
    cur = fp8.CurrentScaling("e5m2", name="grad_out")
    q, s = cur.quantize(torch.zeros(4))
    assert float(s) == 1.0 and not q.float().any()
    d = fp8.DelayedScaling("e4m3", history_len=2)
    assert float(d.quantize(torch.zeros(3))[1]) == 1.0  # first call, amax 0: 1
    d.quantize(torch.full((3,), 2.0))
    kept = float(d.scale)
    d.quantize(torch.zeros(3)), d.quantize(torch.zeros(3))  # history all zeros
    assert float(d.scale) == kept  # the scale stays what it was
    before = d.history.clone()
    with pytest.raises(ValueError, match="'x'.*inf or NaN"):
        fp8.DelayedScaling(name="x").quantize(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="'grad_out'.*inf or NaN"):
        cur.quantize(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="inf or NaN"):
        d.quantize(torch.tensor([float("nan")]))
    assert torch.equal(d.history, before)  # refused before any state changed
    assert float(fp8.scale_from_amax(1e-40, "e4m3")) == torch.finfo().max  # capped


def test_bad_input_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'"):
        fp8.fp8_format("e3m4")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8.quantize(torch.ones(2), torch.bfloat16)
    with pytest.raises(ValueError, match="margin must be >= 0"):
        fp8.CurrentScaling("e4m3", margin=-1)
    with pytest.raises(ValueError, match="margin must be >= 0"):
        fp8.Recipe(margin=-0.5)
    with pytest.raises(ValueError, match="history_len must be a positive integer"):
        fp8.DelayedScaling("e4m3", history_len=0)
    with pytest.raises(ValueError, match="history_len must be a positive integer"):
        fp8.Recipe(history_len=0)
    with pytest.raises(ValueError, match="unknown FP8 scaling 'static'"):
        fp8.Recipe(scaling="static")
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp8-rowwise'"):
        fp8.recipe("fp8-rowwise")
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="scale must be one positive finite"):
            fp8.quantize(torch.ones(2), "e4m3", bad)
    with pytest.raises(ValueError, match="expects an FP8 tensor"):
        fp8.dequantize(torch.ones(2), 1.0)
    linear = nn.Linear(4, 3)
    linear.weight = nn.Parameter(torch.ones(3, 4, 1))
    with pytest.raises(ValueError, match=r"2-D weight.*\(3, 4, 1\)"):
        fp8.Float8Linear.from_linear(linear)
    with pytest.raises(ValueError, match="expects an nn.Linear"):
        fp8.Float8Linear.from_linear(nn.Conv1d(2, 2, 1))
    layer = fp8.Float8Linear(4, 3)
    with pytest.raises(ValueError, match="in_features=4"):
        layer(torch.ones(2, 5))
    a = torch.ones(2, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="both must have K columns"):
        fp8.fp8_matmul(a, torch.tensor(1.0), a[:, :3], torch.tensor(1.0))
    with pytest.raises(ValueError, match="b must be FP8"):
        fp8.fp8_matmul(a, torch.tensor(1.0), torch.ones(2, 4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="unknown FP8 matmul impl"):
        fp8.Float8Linear(4, 3, impl="cublas")
    with pytest.raises(ValueError, match="expects an FP8 shard"):
        fp8.all_gather_fp8(torch.ones(4))  # checked before any collective
    with pytest.raises(
        ValueError, match=r"skip names \['lm_head'\], which are not Linear"
    ):
        fp8.convert_to_float8(GPT(TINY), skip=["lm_head"])


# ---- the FP8 GEMM: dtlab's emulation against torch._scaled_mm -----------------------
PAIRS = [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e5m2")]


def _fp8_pair(shape_a, shape_b, fa, fb, gen):
    a, b = torch.randn(shape_a, generator=gen), torch.randn(shape_b, generator=gen) * 5
    return fp8.quantize(a, fa), fp8.quantize(b, fb)


@pytest.mark.parametrize("fa,fb", PAIRS)
def test_emulation_agrees_with_torch_scaled_mm(fa, fb):
    why = fp8.scaled_mm_error(
        "cpu", fp8.FP8_DTYPES[fa], fp8.FP8_DTYPES[fb], torch.float32
    )
    if why is not None:
        pytest.skip(f"torch._scaled_mm does not run {fa} x {fb} here: {why}")
    gen = torch.Generator().manual_seed(2)
    for M, K, N in ((16, 32, 16), (37, 96, 53), (3, 5, 7), (8, 1024, 8)):
        (a, sa), (b, sb) = _fp8_pair((M, K), (N, K), fa, fb, gen)
        ours = fp8.fp8_matmul(a, sa, b, sb, impl="emulate")
        theirs = fp8.fp8_matmul(a, sa, b, sb, impl="scaled_mm")
        # Both see the same FP8 values; FP8 products are exact in fp32 (4x4 bits).
        # Emulation: fp32 sum (<= (K-1)·u of sum|ab|), then x 1/(sa·sb) (3 more
        # roundings). CPU _scaled_mm scales each operand first (2 roundings), then
        # multiplies (1) and sums ((K-1)·u). Each is within (K+3)·u of the exact
        # result, so they are within twice that of each other.
        magnitude = (a.float().abs() @ b.float().abs().t()) / (sa * sb)
        bound = 2 * (K + 3) * FP32_U * magnitude
        assert ((ours - theirs).abs() <= bound).all(), (M, K, N)


# ---- Float8Linear against an fp32 nn.Linear ------------------------------------------
def _cast_error(t, f, scale):
    """Elementwise bound on |fp8(t) - t|: u·|t| for normal values, plus half the
    smallest subnormal (in t's units) for those below the normal range."""
    return f.unit_roundoff * t.abs() + f.smallest_subnormal / (2 * float(scale))


def _product_bound(a, ea, b, eb):
    """|a'b'^T - ab^T| <= |a| eb^T + ea (|b| + eb)^T for |a'-a| <= ea, |b'-b| <= eb,
    plus fp32 accumulation on both sides (2(K+3)·u of |a||b|^T)."""
    K = a.shape[1]
    exact = a.abs() @ b.abs().t()
    return a.abs() @ eb.t() + ea @ (b.abs() + eb).t() + 2 * (K + 3) * FP32_U * exact


@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("impl", ["scaled_mm", "emulate"])
def test_float8_linear_matches_fp32_linear_within_fp8_rounding(recipe, impl):
    gen = torch.Generator().manual_seed(3)
    ref = nn.Linear(48, 40)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(40, 48, generator=gen) * 0.1)
        ref.bias.copy_(torch.randn(40, generator=gen))
    layer = fp8.Float8Linear(48, 40, recipe=recipe, impl=impl)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 12, 48, generator=gen)  # leading dims are flattened
    r = torch.randn(2, 12, 40, generator=gen)  # loss = sum(y * r): grad_y = r
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x_ref), layer(x_ours)
    (y_ref * r).sum().backward()
    (y * r).sum().backward()
    # first call: delayed scaling scales from the tensor itself, like current
    sx, sw = layer.x_scaling.scale, layer.weight_scaling.scale
    sg = layer.grad_scaling.scale
    if recipe == "delayed":  # .scale is already the next call's: use the history
        sx, sw, sg = (
            fp8.scale_from_amax(s.history[-1], s.format)
            for s in (layer.x_scaling, layer.weight_scaling, layer.grad_scaling)
        )
    X, W, G = x.reshape(-1, 48), ref.weight.detach(), r.reshape(-1, 40)
    ex, ew = _cast_error(X, E4M3, sx), _cast_error(W, E4M3, sw)
    eg = _cast_error(G, E5M2, sg)
    checks = {
        "y": (y.reshape(-1, 40), y_ref.reshape(-1, 40), _product_bound(X, ex, W, ew)),
        "grad_x": (
            x_ours.grad.reshape(-1, 48),
            x_ref.grad.reshape(-1, 48),
            _product_bound(G, eg, W.t(), ew.t()),
        ),
        "grad_w": (
            layer.weight.grad,
            ref.weight.grad,
            _product_bound(G.t(), eg.t(), X.t(), ex.t()),
        ),
    }
    for name, (ours, theirs, bound) in checks.items():
        err = (ours - theirs).abs()
        assert (err <= bound).all(), f"{name}: {(err / bound).max():.2f} of bound"
        assert err.max() > 0, f"{name} is exact: the FP8 path did not run"
    # the bias is added in fp32 after the matmul: its gradient is sum(grad_y)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)


def test_gradients_flow_and_delayed_histories_roll():
    layer = fp8.Float8Linear(16, 8, recipe="delayed")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(4)
    w0 = layer.weight.detach().clone()
    for _ in range(3):
        x = torch.randn(4, 16, generator=gen, requires_grad=True)
        opt.zero_grad()
        layer(x).square().sum().backward()
        for t in (x.grad, layer.weight.grad, layer.bias.grad):
            assert t is not None and torch.isfinite(t).all() and t.abs().sum() > 0
        opt.step()
    assert not torch.equal(layer.weight, w0)
    for s in (layer.x_scaling, layer.weight_scaling, layer.grad_scaling):
        # 3 calls into a history of 16: 13 empty slots, then the 3 amaxes
        assert (s.history[:13] == 0).all() and (s.history[13:] > 0).all(), s
    assert layer.grad_scaling.format.name == "e5m2"
    assert layer.x_scaling.format.name == layer.weight_scaling.format.name == "e4m3"


def test_from_linear_keeps_the_parameters_themselves():
    linear = nn.Linear(6, 5)
    opt = torch.optim.SGD(linear.parameters(), lr=0.5)  # built before the swap
    state = {k: v.clone() for k, v in linear.state_dict().items()}
    layer = fp8.Float8Linear.from_linear(linear.eval(), "current")
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert not layer.training and "recipe=fp8-current" in repr(layer)
    assert state.keys() == layer.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in layer.state_dict().items())
    layer(torch.randn(3, 6)).sum().backward()
    opt.step()  # the old optimizer steps the Float8Linear's weight
    assert not torch.equal(layer.weight, state["weight"])
    assert fp8.Float8Linear.from_linear(nn.Linear(6, 5, bias=False)).bias is None


TINY = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, d_model=16)


def test_convert_swaps_every_linear_but_the_head():
    model = GPT(TINY)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert fp8.convert_to_float8(model, "delayed") is model
    swapped = {n for n, m in model.named_modules() if isinstance(m, fp8.Float8Linear)}
    assert swapped == set(names) - {"head"} and len(swapped) == 6 * TINY.n_layers
    assert type(model.head) is nn.Linear and model.head.weight is model.wte.weight
    x = torch.randint(TINY.vocab_size, (2, TINY.seq_len))
    _, loss = model(x, x)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    # explicit names, a filter, a bare Linear, and converting twice
    only_mlp = fp8.convert_to_float8(GPT(TINY), skip=lambda n, m: ".mlp." not in n)
    mlp = {n for n in names if ".mlp." in n}
    assert {
        n for n, m in only_mlp.named_modules() if isinstance(m, fp8.Float8Linear)
    } == mlp
    assert isinstance(fp8.convert_to_float8(nn.Linear(4, 4)), fp8.Float8Linear)
    kept = fp8.convert_to_float8(GPT(TINY), skip=["head", "blocks.0.attn.q"])
    assert type(kept.blocks[0].attn.q) is nn.Linear
    before = kept.blocks[1].mlp.fc
    assert fp8.convert_to_float8(kept).blocks[1].mlp.fc is before


# ---- FP8 on the wire: a real all-gather over gloo ------------------------------------
def _gather_fp8_weight():
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(5)) * 3
    shard = full.chunk(n)[r]  # (8/n, 6): this rank's rows
    out = {}
    # gloo itself refuses float8 tensors: keep its message
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    try:
        gather(torch.empty(8, 6, dtype=torch.float8_e4m3fn), shard.to(E4M3.dtype))
        out["gloo_float8"] = "ran"
    except RuntimeError as e:
        out["gloo_float8"] = str(e)
    rec = telemetry.Recorder(r)
    with telemetry.use(rec):
        scale = fp8.sharded_scale(shard, "e4m3")
        q, _ = fp8.quantize(shard, "e4m3", scale)
        gathered = fp8.all_gather_fp8(q)
        for dtype in (torch.bfloat16, torch.float32):  # the same rows, 16 and 32 bits
            comm.all_gather(
                torch.empty(8, 6, dtype=dtype), shard.to(dtype), tag=str(dtype)
            )
    out.update(
        full=full, scale=scale, gathered=gathered.view(torch.uint8), events=rec.events
    )
    return out


def test_all_gather_fp8_carries_one_byte_per_element_over_gloo():
    results = spawn(_gather_fp8_weight, 2, timeout=30)
    q_full, s_full = fp8.quantize(results[0]["full"], "e4m3")  # one process, whole
    by_tag = {}
    for out in results:
        assert "Invalid scalar type" in out["gloo_float8"], out["gloo_float8"]
        assert torch.equal(out["scale"], s_full)  # the MAX all-reduce of amaxes
        assert torch.equal(out["gathered"], q_full.view(torch.uint8))  # bit for bit
        for e in telemetry.comm_events(out["events"]):
            by_tag.setdefault(e["tag"], []).append(e)
    numel = q_full.numel()
    (amax_ar,) = {(e["op"], e["payload_bytes"]) for e in by_tag["fp8-amax"]}
    assert amax_ar == ("all_reduce", 4)  # one fp32 amax per rank
    payload = {}
    for tag, dtype, size in (
        ("fp8-all-gather", "uint8", 1),
        ("torch.bfloat16", "bfloat16", 2),
        ("torch.float32", "float32", 4),
    ):
        (e,) = set(
            (e["op"], e["dtype"], e["numel"], e["payload_bytes"], e["wire_bytes"])
            for e in by_tag[tag]
        )
        assert e[:4] == ("all_gather", dtype, numel, numel * size), e
        payload[dtype] = e
    # the estimate names the same bytes: payload and what each of 2 ranks sends
    est = fp8.fp8_memory(numel, world_size=2)
    assert est["fp8"]["all_gather"] == payload["uint8"][3]
    assert est["bf16"]["all_gather"] == payload["bfloat16"][3]
    assert est["fp8"]["all_gather_wire"] == payload["uint8"][4] == numel / 2
    assert est["saved"]["all_gather"] == payload["bfloat16"][3] - payload["uint8"][3]


def test_fp8_memory_halves_compute_weights_and_leaves_the_optimizer():
    n = 1_000
    est = fp8.fp8_memory(n)
    assert (
        est["bf16"]["compute_weights"] == 2 * n and est["fp8"]["compute_weights"] == n
    )
    for same in ("gradients", "master_weights", "adam_states"):
        assert est["saved"][same] == 0
    assert est["fp8"]["master_weights"] + est["fp8"]["adam_states"] == 12 * n  # K
    assert est["fp8"]["all_gather_wire"] == 0  # one rank sends nothing
    with pytest.raises(ValueError, match="n_params must be a positive integer"):
        fp8.fp8_memory(0)


# ---- training: the course's GPT in fp32, bf16 and FP8 --------------------------------
def test_fp8_loss_curve_follows_bf16():
    steps = 30
    curves = fp8.loss_curves(GPTConfig(), steps=steps)
    assert set(curves) == set(fp8.PRECISIONS)
    assert curves["fp32"][0] == pytest.approx(math.log(64), rel=0.02)  # untrained

    def tail(name, end=steps):
        return sum(curves[name][end - 5 : end]) / 5  # mean of 5 steps

    for name in ("fp8-delayed", "fp8-current"):
        assert curves[name] != curves["bf16"]  # FP8 really rounds differently
        # Tolerance: no useful bound exists for a 30-step trajectory, so the yard-
        # stick is a change nobody calls a regression. Changing only the init seed
        # moves this run's final loss by up to 0.030 nats (1.4 %; seeds 0-3 measured
        # 2.064-2.094). FP8 must stay within 1 % of bf16; measured gaps were 0.15 %
        # at most (seeds 0-3, both recipes).
        assert abs(tail(name) - tail("bf16")) <= 0.01 * tail("bf16"), name
        # still learning at the end: each 5-step mean below the one before
        assert tail(name) < tail(name, steps - 5) < tail(name, steps - 10), name
    assert abs(tail("bf16") - tail("fp32")) <= 0.01 * tail("fp32")


def test_against_torchao_float8_linear_where_installed():
    torchao = pytest.importorskip(
        "torchao.float8", reason="torchao is not installed (not in this venv)"
    )
    gen = torch.Generator().manual_seed(6)
    ref = nn.Linear(32, 16, bias=False)
    x = torch.randn(16, 32, generator=gen)
    theirs = torchao.convert_to_float8_training(nn.Sequential(ref))
    ours = fp8.Float8Linear.from_linear(ref, "current")
    W = ref.weight.detach()
    with torch.no_grad():
        y_theirs, y_ours = theirs(x), ours(x)
        # both within FP8 rounding of the fp32 result (tensorwise scales, e4m3)
        sx, sw = fp8.scale_from_amax(fp8.amax(x), E4M3), ours.weight_scaling.scale
        bound = _product_bound(x, _cast_error(x, E4M3, sx), W, _cast_error(W, E4M3, sw))
        for y in (y_theirs, y_ours):
            assert ((y - x @ W.t()).abs() <= bound).all()

"""Chapter 08's claims (``notebooks/08_memory_techniques.ipynb``), run in its kernel
before the cluster stops: activation bytes to the byte, recomputation's FLOPs,
accumulation's gradient and traffic, the optimizer states, offload and bf16's share,
each measured against dtlab's estimate."""

# 2. activation checkpointing: every block saved exactly dtlab's estimate
for _mode, _r in measured.items():
    assert all(v == ours[_mode] for v in _r["per_block"]), (
        f"{_mode}: a block saved other bytes than dtlab_saved_bytes_per_layer",
        _r["per_block"],
        ours[_mode],
    )
assert saving.measured == saving.estimate, saving
assert trained["full"]["activations"] < trained["selective"]["activations"], trained
assert trained["selective"]["activations"] < trained["none"]["activations"], trained

# optional: the whole forward is layout_memory(activations="dtlab"), to the byte;
# the paper's terms add up to its formula and dtlab's to the measurement
for _mode, _w in whole.items():
    assert _w["saved"] == _w["exact"], (_mode, _w)
assert p_sum == paper["none"], (p_sum, paper["none"])
assert d_sum == measured["none"]["block_bytes"], (d_sum, measured["none"])
# recomputation's extra FLOPs are est.recompute_overhead(early_stop=True)'s
for _mode, _extra in extra_flops.items():
    _want = est.recompute_overhead(_mode, s, h, early_stop=True)
    assert abs(_extra - _want) < 1e-9, (_mode, _extra, _want)

# 3. gradient accumulation: the reference's losses (k backward passes add in
# another order: fp32 rounding, not bit for bit), activations follow the microbatch
for _k, _acc in accum.items():
    assert _acc["gap"] < 1e-5, f"k={_k}: {_acc['gap']:.1e} from the reference"
    assert abs(_acc["activations"] / accum[1]["activations"] - 1 / _k) < 0.02, (
        f"k={_k}: activations do not follow the microbatch (1/k)"
    )
assert all(r["wire"] == accum[1]["wire"] for r in accum.values()), accum

# optional: ZeRO-2 reduce-scatters every microbatch; FSDP2 without sync once
assert zero2[2]["reduce_scatter"] == 2 * zero2[1]["reduce_scatter"], zero2
assert zero2[2]["all_gather"] == zero2[1]["all_gather"], zero2
assert rs_every["calls"] == 4 * rs_local["calls"], (rs_every, rs_local)
assert rs_every["wire_bytes"] == 4 * rs_local["wire_bytes"], (rs_every, rs_local)
assert worst < 1e-6, f"FSDP2's gradient shards differ by {worst:.1e}"

# optional: AdamW keeps 8 bytes a parameter and a 4-byte step per tensor;
# Adafactor under 5 % of that; 8-bit moments about a quarter of the fp32 bytes
assert opt_states["AdamW"]["bytes"] == 8 * psi + 4 * n_tensors, opt_states["AdamW"]
assert opt_states["Adafactor"]["per_param"] < 0.05 * opt_states["AdamW"]["per_param"]
assert int8 < 0.27 * fp32, (int8, fp32)

# 4. offload: the estimate to the byte, up to Adam's step counters; the PCIe bytes
for _off, _r in offload.items():
    _host = sum(
        _r["memory"][k] for k in ("host_params", "host_grads", "host_optimizer")
    )
    assert _r["memory"]["params"] == _r["predicted"]["params"], (_off, _r)
    assert 0 <= _host - _r["predicted"].get("host", 0) <= steps, (_off, _host, _r)
assert offload[True]["losses"] == offload[False]["losses"], offload
assert traffic["to_host"] == offload[True]["memory"]["host_grads"], traffic

# 5. bf16 halves the activations (up to the causal mask's bools and the LayerNorm
# statistics); weights and optimizer as estimated (+ Adam's step counters), and the
# gradient the optimizer reads is fp32 (dtlab's 18 bytes a parameter)
assert 0.5 <= bf16_ratio < 0.51, bf16_ratio
for _precision, _got in states.items():
    _want = wanted[_precision]
    assert all(0 <= _got[k] - _want[k] <= steps for k in ("params", "optimizer")), (
        _precision,
        _got,
        _want,
    )
    assert _got["grads"] == 4 * psi, (_precision, _got["grads"])
assert states["bf16"]["params"] * 2 == states["fp32"]["params"], states
assert states["bf16"]["optimizer"] > states["fp32"]["optimizer"], states

# optional: the lost replica was replaced, and the run is the uninterrupted one
assert run.losses() == whole_run.losses(), "the recovered run differs"
assert cluster.pids[2] != killed[0], "rank 2 still runs in the killed engine"

"""Chapter 06's claims (``notebooks/06_mixed_precision.ipynb``), run in its kernel
before the cluster stops: what the chapter measured about fp16's range, the loss
scale on four ranks, the three policies, their bytes per parameter and PyTorch's
autocast loop beside dtlab's."""

# dtlab.amp's fp16 limits are torch.finfo's
assert torch.finfo(torch.float16).smallest_normal == amp.FP16_SMALLEST_NORMAL
assert torch.finfo(torch.float16).max == amp.FP16_MAX

# 1. a loss scale keeps what fp16 flushes; too large a one overflows (the loss is
# computed in fp32, as autocast does, so only gradients can)
assert rows[0]["lost"] > rows[2]["lost"] and rows[2]["finite"], rows
assert not rows[3]["finite"], "at S = 2^20 the largest gradients pass 65504: inf"
assert flushed.measured > 0 and flushed.estimate > 0, flushed

# 2. the live fp16 run on four ranks
assert all(r["records"] == recs for r in fp16), "the ranks took different decisions"
assert not recs[0]["skipped"], "the first step is taken at S = 2^16 (an fp32 loss)"
assert 1 < len(skipped) < len(recs) // 3, f"a saw-tooth, not a collapse: {skipped}"
assert all(
    b["scale"] == a["scale"] / 2 if a["skipped"] else b["scale"] >= a["scale"]
    for a, b in zip(recs, recs[1:])
), "after every skip the scale halved, and it never fell otherwise"
assert skips.measured == skips.estimate, (
    "the skipped steps are LossScaler's rule replayed at the run's ceiling",
    skips,
)

# 3. three policies: bf16 rounds (measured ~0.01); every skipped fp16 step is an
# update not taken, so its curve lags fp32's by up to 5 updates here (~0.18)
assert gaps["bf16"] < 0.05 and gaps["fp16"] < 0.3, gaps
bf16_records = runs["bf16"]["records"]
assert not any(r["skipped"] for r in bf16_records), "bf16 skipped a step"
assert {r["scale"] for r in bf16_records} == {1.0}, "bf16's scale is not 1"
_reference = train_reference(CFG, steps=20, global_batch_size=16).losses
assert all(abs(a - b) < 1e-5 * b for a, b in zip(losses["fp32"], _reference)), (
    "the fp32 policy on four ranks is the single-process reference trainer"
)

# optional: one AdamW step on bf16 weights loses updates the fp32 masters keep
assert (torch.tensor(1.0, dtype=torch.bfloat16) + 1e-3).item() == 1.0
for _lr, (_unmoved, _) in adam_steps.items():
    assert _unmoved > 0, f"lr = {_lr:g}: bf16 weights lose updates the masters keep"

# 4. bytes per parameter, measured tensor by tensor == amp.bytes_per_param
for _name, _run in runs.items():
    _want = amp.bytes_per_param(_name)
    assert all(
        _run["memory"][part] == getattr(_want, part)
        for part in ("params", "grads", "optimizer")
    ), (_name, _run["memory"], _want)
assert state_bytes.measured == state_bytes.estimate == 16, state_bytes

# 5. CPU autocast's policy and the dtypes of the chapter's GPT under both designs
assert not any(
    what.startswith("error") for p in policies.values() for what in p.values()
), policies
assert policies["bf16"] == policies["fp16"], "one autocast policy for bf16 and fp16"
assert all(policies["fp16"][op] == "lower" for op in ("linear", "matmul", "bmm"))
assert (
    autocast_dtypes["wte"]
    == autocast_dtypes["blocks.0.ln_1"]
    == autocast_dtypes["ln_f"]
    == "float32"
    and autocast_dtypes["head"] == autocast_dtypes["blocks.0.mlp.fc"] == "float16"
), autocast_dtypes
assert {v for k, v in dtlab_dtypes.items() if k != "loss"} == {"float16"}
assert autocast_dtypes["loss"] == dtlab_dtypes["loss"] == "float32"

# the framework exercise ran, and the loop on the page agrees with dtlab's policy
assert report.name == "autocast_step" and report.attempted, report
assert same, "GradScaler and LossScaler: different scales or skips"
_skips = [i for i, r in enumerate(dtlab_rows) if r["skipped"]]
assert _skips and _skips[0] > 0, f"skipped the same steps, never the first: {_skips}"
assert loop_gap < 1e-3, f"autocast's and dtlab's losses {loop_gap:.1e} apart"
_bf16_gap = max(
    abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(bf16_theirs, bf16_ours)
)
assert _bf16_gap < 2e-3, f"bf16 autocast and dtlab's policy {_bf16_gap:.1e} apart"
assert {r["scale"] for r in bf16_theirs + bf16_ours} == {1.0}, "bf16 needs no scale"
assert not any(r["skipped"] for r in bf16_theirs + bf16_ours), "bf16 skipped a step"

# optional: FP8 keeps 16-bit weights and gradients; the fp32 master and moments
# (12 of the 16 bytes) dominate the model states
assert fp8["params"] == amp.bytes_per_param("bf16").params * est.MODELS["7B"].n_params
assert fp8["optimizer"] == 3 * (fp8["params"] + fp8["grads"]), fp8

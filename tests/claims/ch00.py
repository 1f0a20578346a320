"""Chapter 00's claims (notebooks/00_why_distribute.ipynb): the arithmetic behind
every number its prose quotes, and the memory calculator moved the way a learner
would move it, read back from what it draws. Runs in the chapter's kernel."""

import math

# ---- 1. bytes per parameter (ZeRO §3) ----------------------------------------------
assert (mixed_adam.params, mixed_adam.grads, mixed_adam.K) == (2, 2, 12), mixed_adam
assert mixed_adam.total == est.bytes_per_param("fp32", "adam").total == 16
assert est.bytes_per_param("pure_bf16", "adam").total == 8, "the popular 560 GB"

# ---- 2. parameter counts -----------------------------------------------------------
assert measured == tiny.n_params(), (measured, tiny.n_params())
assert attention == 2.25 * h70 * h70, "GQA: attention holds 2.25h² per layer"
assert mlp == 10.5 * h70 * h70, "SwiGLU with d_ff = 28672 = 3.5h: 10.5h² per layer"
assert m70.n_params == m70.n_layers * (attention + mlp) + 2 * V70 * h70
assert round(m70.n_params / 1e9, 1) == 69.0 and round(rule / 1e9, 1) == 64.7
assert m70.n_params > 1.05 * rule, "70B is above the 12Lh² + Vh rule of thumb"

# ---- 3. the bill on one device -----------------------------------------------------
assert bill["7B", "mixed"]["total"] > H100.memory_bytes
assert all(
    bill[k, p]["total"] > H100.memory_bytes
    for k in ("70B", "405B")
    for p in est.STATE_PRECISIONS
), "70B and 405B are over 80 GB under every precision policy"
assert 1.05e12 < 16 * m70.n_params < 1.15e12, "about 1.1 TB of model states for 70B"
seven = est.memory_per_device("7B", recompute="selective")
assert round(16 * m7.n_params / GB) == 108, "7B: about 108 GB of model states"
assert round(seven["activations"] / GB) == 18, "7B: about 18 GB of activations at 4k"

# ---- activations (Korthikanti et al. 2022) -----------------------------------------
s7, h7, a7 = 4096, m7.d_model, m7.n_heads
assert est.activation_bytes_per_layer(s7, 1, h7, a7) == s7 * h7 * (
    34 + 5 * a7 * s7 / h7
)
assert math.isclose(acts["selective"][1], 2 * acts["selective"][0]), "linear in s"
assert acts["none"][-1] / acts["none"][-2] > 3, "the attention scores grow with s²"

# ---- 4. the time wall --------------------------------------------------------------
assert 23 < days_1024 < 25, days_1024
assert years_1 > 60 and round(years_1) == 67, years_1
assert math.isclose(flops, 8.4e23), flops

# ---- 5. the calculator, moved as the chapter's "things to try" say -----------------
try:
    assert calc.model.value == "70B" and calc.gpus.value == 8
    calc.stage.value = 1
    assert not calc.fits, "70B on 8 H100s: ZeRO-1 is far over"
    calc.stage.value = 3
    on_8 = calc.memory[3]["total"] - calc.memory[3]["activations"]
    assert math.isclose(on_8, 16 * m70.n_params / 8), "ZeRO-3 on 8 GPUs: 16Ψ/8 bytes"
    assert round(16 * m70.n_params / 8 / GB) == 138

    calc.gpus.value = 64  # 70B, mixed Adam, 64 H100s, ZeRO-3
    expected = est.memory_per_device(
        "70B", world_size=64, stage=3, micro_batch=1, recompute="selective"
    )
    states = expected["total"] - expected["activations"]
    assert math.isclose(calc.shown_gb(3), expected["total"] / GB), calc.shown_gb(3)
    assert round(states / GB) == 17 and round(expected["activations"] / GB) == 91
    assert not calc.fits and expected["activations"] > 4 * states, (
        "the model states fit; the activations, which ZeRO does not shard, do not"
    )
    calc.gpus.value = 4096  # the floor: what stages 1 and 2 keep whole stays
    for stage, whole in ((1, 4), (2, 2)):  # 2Ψ + 2Ψ bytes, then 2Ψ bytes
        floor = calc.memory[stage]["total"] - calc.memory[stage]["activations"]
        assert whole * m70.n_params < floor < 1.01 * whole * m70.n_params, stage
    calc.gpus.value = 64

    calc.precision.value = "fp32"
    assert math.isclose(calc.memory[3]["activations"], 2 * expected["activations"]), (
        "fp32 doubles the activations"
    )
    calc.precision.value = "mixed"

    calc.recompute.value = "full"  # each layer keeps only its input
    assert calc.fits, "full recomputation brings 70B under 80 GB on 64 GPUs"
    calc.stage.value = 1  # ZeRO-1 keeps 4Ψ bytes of bf16 weights and grads whole
    assert not calc.fits, "ZeRO-1 does not: its replicated 4Ψ bytes alone are 276 GB"
    assert round(4 * m70.n_params / GB) == 276

    calc.model.value = "custom"
    assert calc.layers.layout.display is None, "'custom' shows the layers slider"
    assert "custom" in calc.figure.layout.title.text, calc.figure.layout.title.text
    calc.model.value = "405B"
    calc.recompute.value = "none"
    assert not calc.fits, "405B without recomputation does not fit"
    assert not calc.failures, f"{len(calc.failures)} callbacks raised: {calc.failures}"
finally:  # back to where the calculator started
    calc.model.value, calc.stage.value, calc.precision.value = "70B", 0, "mixed"
    calc.gpus.value, calc.recompute.value = 8, "selective"

# ---- 6. the fit table and the interview answers ------------------------------------
from dtlab.exercises.ch00_memory import fitting_gpus  # noqa: E402

assert fitting_gpus(m70.n_params, H100.memory_bytes, 2) is None, "70B: no ZeRO-2 fits"
assert fitting_gpus(m70.n_params, H100.memory_bytes, 3) == 16, "70B fits ZeRO-3 on 16"
assert "-" in fit_table().splitlines()[3], fit_table()
figure1 = [est.zero_memory_per_device(7.5e9, 64, s)["total"] / GB for s in range(4)]
assert [round(x, 1) for x in figure1] == [120.0, 31.4, 16.6, 1.9], "ZeRO's Figure 1"

# Chapter 09's claims (notebooks/09_planning_at_scale.ipynb), run in its kernel before
# the cell that stops the cluster: the planner's formulas against the live run, the
# 70B and 405B answers, long context, MoE, HSDP, the planner panel (driven here as a
# person would edit its boxes), serving, and the graph partitions.

# ---- 2. the planner's formulas against this cluster -----------------------------
for _s in measured:
    _got, _want = measured[_s], predicted[_s]
    _counters = 4 * _got["tensors"]  # AdamW's step: 4 bytes a tensor, not modelled
    assert (
        _got["memory"]["params"] == _want["params"]
        and _got["memory"]["grads"] == _want["grads"]
        and _got["memory"]["optimizer"] == _want["optimizer"] + _counters
    ), (f"{_s}: weights, gradients and optimizer state to the byte", _got, _want)
    assert abs(_got["wire"] - _want["wire"]) < 1e-6 * _want["wire"], (
        f"{_s}: the bytes sent per step, as layout_traffic says",
        _got["wire"],
        _want["wire"],
    )
assert (
    measured["ddp"]["memory"]["activations"] == predicted["ddp"]["exact activations"]
), (
    "ddp: activations exactly layout_memory(activations='dtlab')",
    measured["ddp"]["memory"]["activations"],
    predicted["ddp"]["exact activations"],
)
assert predicted["ddp"]["activations"] > predicted["ddp"]["exact activations"], (
    "Korthikanti's count (dropout masks included) sits above what this GPT saves"
)

# ---- optional: the published 8K layout, dry-run on the real code ---------------
from dtlab.dryrun.compare import LN_STATS, SCALARS, STEP_COUNTER  # noqa: E402

assert world == 8192 and str(config.layout) == "dp64·tp8·pp16", "8,192 ranks"
assert config.microbatches == 32 and gpt.n_layers // lay.pp == 8 and lay.pp == 16, (
    "32 microbatches a step (16 in flight on the first of 16 stages), 8 layers a stage",
    config.microbatches,
    gpt.n_layers,
)
assert config.activation_checkpointing == "none", "the dry run recomputes nothing"
assert dry.unexplained() == [], ("every difference has its reason", dry.unexplained())
(_r,) = dry.ranks
assert _r.rank == 0 and _r.role == "first", "rank 0 is the first pipeline stage"
for _c in ("params", "grads"):
    assert held[_c]["measured"] == held[_c]["estimate"] > 0, f"{_c} to the byte"
assert held["optimizer"]["difference"] == 100, held["optimizer"]
assert STEP_COUNTER in held["optimizer"]["reason"], "100 bytes: AdamW's step counters"
# 2 more bytes (fp32 for bf16) x 2 statistics x 8,192 tokens x 2 LayerNorms x 8
# layers x 16 microbatches in flight on the first stage
assert held["activations"]["difference"] == 2 * 2 * 8192 * 2 * 8 * 16 == 8_388_608
assert LN_STATS in held["activations"]["reason"], held["activations"]
assert round(held["activations"]["measured"] / 1e9) == 480, (
    "480 GB of activations on rank 0",
    held["activations"]["measured"],
)
assert round(held["activations"]["measured"] / 80e9) == 6, "six times an H100's 80"
_row8k = beside["405B 8K, 8192 H100"][0]
assert _row8k.checkpointing != "none", (
    "the planner's row for this layout recomputes",
    _row8k.checkpointing,
)
_dry_sent = {row["category"]: row for row in _r.traffic}
assert {"dp", "tp", "pp", "world"} <= set(_dry_sent), set(_dry_sent)
for _axis in ("dp", "tp", "pp", "world"):
    _d = _dry_sent[_axis]["difference"]
    assert 0 < _d <= 32 and SCALARS in _dry_sent[_axis]["reason"], (_axis, _d)
# the published column: Llama 3.1 405B's own estimate beside the stand-in's
assert f"{held['params']['measured'] / 1e9:.1f}" == "8.2", held["params"]
assert f"{held['params']['published'] / 1e9:.1f}" == "6.9", held["params"]
assert "GQA" in held["params"]["published_reason"]
assert "128 layers for 126" in published.reason, published.reason
_w = held["params"]["measured"] / held["params"]["published"]
_g = _dry_sent["dp"]["measured"] / _dry_sent["dp"]["published"]
assert abs(_g / _w - 1) < 1e-3, ("dp traffic larger by the weights' share", _g, _w)

# ---- 4. 70B on 8 × 80 GB ----------------------------------------------------------
assert z3["optimizer"] == 12 * PSI_70B / 8, "ZeRO-3: K = 12 bytes a parameter / 8"
assert abs(states - 16 * PSI_70B / 8) < 1e-9 * states and states / est.GB > 130, (
    "70B under ZeRO-3 over 8: 16Ψ/8, above 130 GB per GPU before activations",
    states / est.GB,
)
assert plan_70b.best is None and plan_70b.rejected, "no layout of 70B fits on 8 GPUs"
for _name, _p in options.items():
    assert _p.best.memory["total"] <= _p.assumptions["usable_GB"] * est.GB, (
        f"{_name}: the best layout fits in the usable memory"
    )
_off = options["8 GPUs + ZeRO-Offload"].best
if _off.zero_stage == 3:
    assert (
        _off.memory["params"] == 2 * PSI / 8 and _off.memory["host"] == 16 * PSI / 8
    ), "offload at ZeRO-3: 2 B a parameter on the GPUs, dtlab's 12 + 4 B on the hosts"

# ---- 5. 405B on 1024 GPUs ---------------------------------------------------------
assert best.layout.tp <= 8, f"the best layout keeps tp inside a node: {best.layout}"
assert best.memory["total"] <= plan_405b.assumptions["usable_GB"] * est.GB, "it fits"
assert (
    rows["tp16, ethernet"]["comm_s"] > 10 * rows["tp8 × pp2, ethernet"]["comm_s"]
    and rows["tp8 × pp2, ethernet"]["step_s"] < rows["tp16, ethernet"]["step_s"]
), "over Ethernet, tp=16 across nodes communicates > 10× as long as tp8 × pp2"

# the published layouts: each fits by the planner's count (405B at 128K with ring
# attention's own activations), and the 76B GPT's is priced near its 140 TFLOP/s
for _case, (_row, _best) in beside.items():
    assert _row is not None and _row.fits, f"{_case}: the published layout fits"
    assert 0 < _row.mfu <= 1 and 0 < _best.mfu <= 1, f"{_case}: MFU is a share"
_row76 = beside["76B, 1024 A100"][0]
assert abs(_row76.achieved_flops_per_gpu / 140e12 - 1) < 0.05, (
    "76B at Narayanan's layout: within 5 % of the published 140 TFLOP/s per GPU",
    _row76.achieved_flops_per_gpu,
)

# ---- 6. long context, MoE, HSDP ---------------------------------------------------
# cp=8 divides by 8, the ring's own output and log-sum-exp added (no score matrix):
# (s·b·h + a·s·b) bf16 values a layer over tp = 8, 80 layers
_kept = 80 * (131072 * 8192 + 64 * 131072) * 2 / 8
assert abs(eight["activations"] * 8 / (one["activations"] + _kept) - 1) < 1e-9, (
    "cp=8: one eighth of the selective count plus the ring's output and lse"
)
assert p1 == 8 * p8, "ep=8: one expert per rank and layer instead of eight"
assert hsdp["total"] == 2 * full16["total"], "HSDP 2 × 8 holds twice ZeRO-3 over 16"
assert abs(full16["total"] - 18 * PSI / 16) < 1e-9 * full16["total"], (
    "dtlab's ZeRO-3 count: 18 bytes a parameter (the fp32 gradient slice)"
)

# ---- 7. the planner panel: what editing the boxes and pressing Plan does ---------
p_slow = panel.update(inter_GBps=3.0)  # a slow network between the nodes
assert p_slow.best.layout.tp <= 8, "a slow network keeps tp inside the node"
p_small = panel.update(model="13B", n_gpus=8, inter_GBps=50.0)
assert p_small.best is not None and p_small.best.memory["total"] < 72 * est.GB, (
    "13B fits on one node of 8"
)

# ---- 8. training vs serving --------------------------------------------------------
assert serve["weights"] == 2 * PSI_70B / 8, "serving keeps 2 bytes a parameter, / tp"
assert (train["params"] + train["grads"] + train["optimizer"]) / train["params"] == 8, (
    "training keeps 8× the weights' bytes: 16 B a parameter against 2"
)
assert tp_comm + tp_read < pp_comm + pp_read, "per token, tp=8 is faster than pp=8"

# ---- optional: graphs ----------------------------------------------------------------
assert cut(strips) == 3 * n, "4 strips cut three boundaries of n edges"
assert cut(hashed) > 20 * cut(strips), "a random partition cuts 20× more"

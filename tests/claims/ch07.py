# Chapter 07's claims (notebooks/07_3d_parallelism.ipynb), run in its kernel before
# the cell that stops the cluster: the rank order on nodes, the control panel driven
# as a person would click it, every layout against the estimate, ZeRO under a
# pipeline, PyTorch's 2-D job, accelerate, the translation table and MT-NLG.
import time

# ---- 1. the rank order on nodes ---------------------------------------------------
assert tp_inside_nodes(Layout(dp=2, tp=2, pp=2), 4), "dp2·tp2·pp2: tp groups per node"
assert tp_inside_nodes(Layout(dp=8, tp=8, pp=35), 8), "MT-NLG: a tp group is one node"
assert not tp_inside_nodes(Layout(dp=4, tp=16, pp=35), 8), "tp=16 on nodes of 8"
# pp is the slowest coordinate: a stage is dp·tp = 64 consecutive ranks, 8 whole nodes
_mt = Layout(dp=8, tp=8, pp=35)
assert all(
    len({_mt.coords(r)["pp"] for r in range(n * 8, n * 8 + 8)}) == 1
    for n in range(_mt.world_size // 8)
), "MT-NLG: no node holds two pipeline stages"

# ---- 2. the control panel, clicked from here rather than from a learner's cell ----
assert panel.valid_layouts == valid and not invalid, (
    "the picker offers every layout of 4 (4 heads, 4 layers: all fit)",
    panel.valid_layouts,
    invalid,
)
panel.layout.value = Layout(dp=2, pp=2)
panel.schedule.value = "1f1b"
panel.microbatches.value = 2
panel.steps.value = BASE.steps
panel.run_button.click()
live_run = panel.wait(timeout=120)
assert not panel.errors, f"the panel's run finished with errors: {panel.errors}"
board = panel.dashboard
during = [u for u in board.updates if u["t"] < min(panel.live.rank_t_end)]
assert len({u["step"] for u in during if u["step"] >= 0}) >= 2, (
    "the dashboard redrew while the ranks trained, not only at the end",
    len(board.updates),
    len(during),
)
assert [len(r) for r in live_run.records] == [BASE.steps] * N, (
    f"every rank recorded {BASE.steps} steps"
)

# Stop: ends every rank at the same step boundary, without an interrupt
panel.steps.value = 500
panel.run_button.click()
deadline = time.monotonic() + 60
while panel.live.step < 1 and time.monotonic() < deadline:
    time.sleep(0.05)
print(panel.stop())
stopped = panel.wait(timeout=60)
lengths = [len(r) for r in stopped.records]
assert len(set(lengths)) == 1 and lengths[0] < 500 and not panel.live.interrupted, (
    "Stop ended every rank at the same step boundary, without an interrupt",
    lengths,
)
panel.steps.value = BASE.steps

# ---- 3. every layout of four against the estimate --------------------------------
_gap = max(
    abs(a - b) / b for run in runs.values() for a, b in zip(run.losses(), ref.losses)
)
assert len(runs) == 6 and _gap < 1e-4, ("six layouts train like one process", _gap)
_off = []
for _name, _pair in found.items():
    for _axis in ("dp", "tp", "pp"):
        _got, _want = _pair[_axis]
        # loss and control scalars ride on the same groups: a few bytes over
        if not ((_got == _want == 0) or abs(_got - _want) <= 0.05 * _want):
            _off.append((_name, _axis, _got, _want))
    _got, _want = _pair["states"]
    # Adam's step counters (4 bytes per tensor) are all the formula leaves out
    if not _want <= _got <= _want * 1.01:
        _off.append((_name, "states", _got, _want))
assert not _off, (
    "every layout's bytes per axis within 5 % of est.layout_traffic and its model "
    "states within 1 % of est.layout_memory",
    _off,
)
assert found["dp2·tp2·pp1"]["tp"][0] > found["dp2·tp2·pp1"]["dp"][0] > 0, (
    "dp2·tp2 sends more on tp (activations) than on dp (gradients)",
    found["dp2·tp2·pp1"],
)

_ddp_row, _tppp_row = compare_table([runs["dp4·tp1·pp1"], runs["dp1·tp2·pp2"]])
assert _tppp_row["memory"]["params"] < _ddp_row["memory"]["params"] / 2, (
    "tp2·pp2 holds well under half of DDP's weights per rank"
)
assert _ddp_row["bytes_per_step"]["tp"] == 0 < _tppp_row["bytes_per_step"]["tp"], (
    "only tp2·pp2 sends on the tp axis"
)

# ZeRO-1/2/3 under a 4-microbatch pipeline
_off = [
    (n, dp_bytes[n], dp_pred[n])
    for n in dp_bytes
    if abs(dp_bytes[n] - dp_pred[n]) > 0.05 * dp_pred[n]
]
assert not _off, ("dp bytes per step within 5 % of est.layout_traffic", _off)
assert abs(ratio - (PP_M + 1) / 2) < 0.05 * ratio, ("ZeRO-2 pays (m + 1)/2", ratio)
assert dp_bytes["zero3"] > dp_bytes["zero2"], (
    "ZeRO-3 sends more again: the weights are gathered for every microbatch",
    dp_bytes,
)
_losses = [run.losses() for run in zero_pp.values()]
_gap = max(abs(a - b) / b for run in _losses for a, b in zip(run, _losses[0]))
assert _gap < 1e-4, ("ZeRO-1/2/3 under the pipeline train the same losses", _gap)

# ---- 4. PyTorch's 2-D job and accelerate -----------------------------------------
_gap = max(abs(a - b) / b for a, b in zip(theirs, ref.losses))
assert _gap < 1e-4, ("PyTorch's FSDP2 + DTensor follows the reference", _gap)
_gap = max(abs(a - b) / b for a, b in zip(ours_2d, theirs))
assert _gap < 1e-4, ("dtlab's dp2·tp2 ZeRO-3 follows PyTorch's", _gap)

for _r in acc:
    assert _r["prepared"] == [
        "DistributedDataParallel",
        "AcceleratedOptimizer",
        "DataLoaderShard",
    ], ("prepare wrapped the model in torch's DDP", _r["prepared"])
    assert (_r["kind"], _r["backend"]) == ("MULTI_CPU", "gloo"), _r
    assert _r["local_batch"] == (JOB.global_batch_size // N, MODEL.seq_len), (
        f"the DataLoaderShard handed every rank {JOB.global_batch_size // N} sequences",
        _r["local_batch"],
    )
    assert _r["losses"] == acc[0]["losses"], "every rank reports the same mean loss"
_gap = max(abs(a - b) / b for a, b in zip(acc[0]["losses"], ours_ddp))
assert _gap < 2e-6, ("accelerate's losses are dtlab's DDP's within 2e-6", _gap)

assert [r["rank"] for r in launched] == [0, 1] and all(
    r["env"]["TORCHELASTIC_RUN_ID"] for r in launched
), "accelerate launch started 2 ranks through torch's elastic launcher"
assert launched[0]["losses"] == launched[1]["losses"] and all(
    r["distributed_type"] == "MULTI_CPU" for r in launched
), ("both launched ranks trained the same run on MULTI_CPU", launched)

# the translation table, each entry loaded by its own library
_parsed = [r["deepspeed_parsed"] for r in table_rows]
assert [p["zero_stage"] for p in _parsed] == [0, 1, 2, 3] and all(
    p["world_size"] == N for p in _parsed
), ("DeepSpeed's own parser read each config's stage, on a world of 4", _parsed)
assert [r["accelerate_loaded"]["distributed_type"] for r in table_rows] == [
    "MULTI_CPU",
    "DEEPSPEED",
    "DEEPSPEED",
    "DEEPSPEED",
], "accelerate loaded DDP as MULTI_CPU and the ZeRO configs as its DeepSpeed plugin"
_forms = [isinstance(r["fsdp2"], str) for r in table_rows]
assert _forms == [True, True, False, False], (
    "FSDP2 has a form for ZeRO-2 and 3 only, and says what to use for the others"
)

# ---- 5. MT-NLG ---------------------------------------------------------------------
assert no_tp_pp["total"] > 10 * A100.memory_bytes, "DP alone cannot hold MT-NLG"
assert table[("none", 0)]["total"] > A100.memory_bytes, (
    "with TP and PP but no recomputation, stage 0 does not fit in 80 GB"
)
assert table[("full", 1)]["total"] < 0.5 * A100.memory_bytes, (
    "full checkpointing and ZeRO-1 fit in half of 80 GB"
)
for _zero, _want in formula.items():
    assert abs(mt_states[_zero] - _want) <= 1e-6 * _want, (
        "the formulas on ψ = Ψ/(tp·pp) are the estimate's",
        _zero,
        mt_states[_zero],
        _want,
    )
assert layer_ms[16] > 10 * layer_ms[8], (
    "TP = 16 spends more than 10× as long per layer on the wire",
    layer_ms,
)
assert times[16]["comm_s"] > times[8]["comm_s"], "TP = 16 communicates longer"
assert times[16]["step_s"] > times[8]["step_s"], "TP = 16 steps slower than TP = 8"

# ---- 6. the planner's answer to the layout exercise --------------------------------
assert plan_70b.fits and plan_70b.best is plan_70b.fits[0], (
    "the planner finds plans for 70B on 64 H100s, the fastest first"
)
assert all(row.layout.tp <= 8 for row in plan_70b.fits[:3]), "tp stays in a node"

# ---- the layout trained live from a cell -------------------------------------------
assert [len(r) for r in watched.records] == [40] * N, "every rank trained 40 steps"
assert watched.losses()[-1] < watched.losses()[0], watched.losses()

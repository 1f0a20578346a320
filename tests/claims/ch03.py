# Chapter 03's claims (ZeRO stages 1-3, FSDP2, HSDP, DeepSpeed), run in the chapter's
# kernel just before its last cell (tests/claims/README.md).
from dtlab.frameworks.translate import deepspeed_config

# ---- the live memory view drew what the engines sent --------------------------------
assert explorer.live.received > 0 and explorer.live.redraws >= 1, (
    f"the memory events arrived live and the figure redrew: "
    f"{explorer.live.received} events, {explorer.live.redraws} redraws"
)

# ---- parity: every stage against the reference and against each other ---------------
ref_params = dict(ref.model.named_parameters())
assert all(max_gap(runs[s][0]["losses"], ref.losses) < 1e-5 for s in runs), gap
assert all(
    max((runs[s][0]["params"][k] - ref_params[k]).abs().max() for k in ref_params)
    < 1e-4
    for s in runs
), "every stage ends with the reference's weights, gathered back from the shards"
assert all(
    runs[s][0]["losses"] == runs[0][0]["losses"]
    and all(
        torch.equal(runs[s][0]["params"][k], runs[0][0]["params"][k])
        for k in ref_params
    )
    for s in runs
), "the four stages agree with each other bit for bit"

# ---- memory per rank: the paper's formula to the byte --------------------------------
assert all(
    measured[s]["params"] == predicted[s]["params"]
    and measured[s]["grads"] == predicted[s]["grads"]
    and measured[s]["optimizer"] == predicted[s]["optimizer"] + step_counters[s]
    for s in runs
), "weights, gradients and optimizer state: the formula plus 4 B per local shard"
assert states[3] - step_counters[3] == (states[0] - step_counters[0]) / N, (
    "stage 3 keeps exactly 1/N of what stage 0 keeps"
)
assert states[2] == predicted[2]["total"] + step_counters[2], (
    "the zero2_state_bytes comparison: measured = estimate + step counters"
)
assert peak_params == 4 * psi // N + root + 2 * block < 4 * psi, (
    "stage 3's peak: the slices, the root and two blocks"
)
assert len(set(acts.values())) == 1, f"activations differ between stages: {acts}"

# ---- bytes per step ------------------------------------------------------------------
assert all(
    sum(e["payload_bytes"] for e in comm_by_stage[s] if e["op"] == op) == paper[s][op]
    for s in runs
    for op in ("all_reduce", "reduce_scatter", "all_gather")
), "each collective's payload is the paper's"
assert wire[3] / wire[0] == 1.5 == paper[3]["wire"] / paper[0]["wire"], (
    "the zero3_wire_ratio comparison: 3Ψ against 2Ψ"
)
assert rows[1]["wire_bytes"] == rows[2]["wire_bytes"] == rows[0]["wire_bytes"], (
    "stages 1 and 2 send exactly what DDP sends"
)
assert rows[3]["wire_bytes"] == 1.5 * rows[0]["wire_bytes"], "stage 3 sends 1.5×"
assert (
    rows[0]["states_bytes"]
    > rows[1]["states_bytes"]
    > rows[2]["states_bytes"]
    > rows[3]["states_bytes"]
), "each stage holds less than the one before"

# ---- mixed precision and offload -----------------------------------------------------
for off in (False, True):
    got = mixed[off][1]
    want = est.zero_states_per_rank(psi, N, 3, "mixed", offload=off)
    assert (
        got["params"] == want["params"]
        and got["grads"] == want["grads"]
        and got["host_grads"] == want["host_grads"]
    ), f"bf16 (offload={off}): weights and gradients where the formula puts them"
assert mixed[True][0][0]["losses"] == mixed[False][0][0]["losses"], (
    "offload changes where the step runs, not its result"
)
comm_bf16 = [
    e
    for e in mixed[True][2]
    if e["kind"] == "comm" and e.get("tag") not in NOT_TRAINING
]
assert {e["dtype"] for e in comm_bf16} == {"bfloat16"}, "every collective carried bf16"

# ---- beyond this machine -------------------------------------------------------------
assert [round(x, 1) for x in paper_gb] == [120.0, 31.4, 16.6, 1.9], (
    f"the ZeRO paper's Figure 1: {paper_gb}"
)
assert offload_13b["total"] < 32 * est.GB, "13B's fp16 weights fit a 32 GB V100"

# ---- the optional sections: frozen parameters, checkpoints ---------------------------
full_numel = {name: p.numel() for name, p in GPT(CFG).named_parameters()}
assert all(
    sum(v["shown"][name][0][0] for v in views) == numel
    for name, numel in full_numel.items()
), "every parameter is cut into 1-D pieces across the ranks, which add up to it"
assert views[0]["shown"]["wpe.weight"][1] is None and all(
    v["frozen_unchanged"] and v["frozen_state"] == 0 for v in views
), "the frozen position embedding: no gradient, no Adam state, not moved by decay"
assert resharded[0] and resharded[1], "weights and Adam state survive 4 -> 2 ranks"

# ---- FSDP2 and HSDP beside dtlab -----------------------------------------------------
assert all(
    max_gap(fsdp2[k]["losses"], fsdp2["dtlab ZeRO-3"]["losses"]) < 2e-6
    for k in ("FSDP2 reshard=True", "FSDP2 reshard=False", "FSDP2 HSDP (2, 2)")
), "FSDP2, with or without resharding, and HSDP train like dtlab's ZeRO (fp32)"
assert (
    max_gap(fsdp2["FSDP2 bf16 policy"]["losses"], fsdp2["dtlab ZeRO-3 bf16"]["losses"])
    < 2e-3
), "FSDP2's bf16 policy tracks dtlab's bf16 compute"
assert all(
    sent(f, op) == sent(d, op)
    for f, d in [
        ("FSDP2 reshard=True", "dtlab ZeRO-3"),
        ("FSDP2 reshard=False", "dtlab ZeRO-2"),
        ("FSDP2 bf16 policy", "dtlab ZeRO-3 bf16"),
    ]
    for op in ("all_gather", "reduce_scatter")
), "the same all-gathers and reduce-scatters as dtlab, byte for byte"
assert sent("FSDP2 reshard=True", "all_gather") == 2 * 4 * PSI, "ZeRO-3 gathers 2 × 4Ψ"
assert hsdp["mesh"] == {"shape": (2, 2), "names": ("replicate", "shard")}, hsdp["mesh"]
assert hsdp["placements"] == ["R", "S(0)"], hsdp["placements"]
assert (
    fsdp2["FSDP2 reshard=False"]["memory"]["params"] == 4 * PSI // N
    and fsdp2["dtlab ZeRO-2"]["memory"]["params"] == 4 * PSI
), "between steps FSDP2 without resharding keeps shards; dtlab's ZeRO-2 full weights"
assert report.name == "fully_shard" and report.attempted, report

# ---- DeepSpeed beside dtlab ----------------------------------------------------------
assert DS_CONFIG == deepspeed_config(JOB.replace(strategy="zero2", offload=True), N), (
    "the JSON on the page is dtlab's translation of the job"
)
assert all(
    ds_sent(f"DeepSpeed {s}", "all_reduce") - 4 == 4 * PSI
    and ds_sent(f"DeepSpeed {s}", "all_gather") == 4 * PSI
    and ds_sent(f"dtlab {s}", "reduce_scatter") == 4 * PSI
    for s in ("ZeRO-1", "ZeRO-2")
), "DeepSpeed's ZeRO-1/2 all-reduce the buckets (+ a 4-byte flag); dtlab scatters"
assert (
    ds_sent("DeepSpeed ZeRO-3", "all_gather") == 4 * PSI
    and ds_sent("dtlab ZeRO-3", "all_gather") == 8 * PSI
    and ds_sent("DeepSpeed ZeRO-3", "reduce_scatter") == 4 * PSI
), "DeepSpeed's ZeRO-3 gathered each weight once in the step; dtlab's twice"
assert ds["DeepSpeed ZeRO-2"]["memory"]["optimizer"] - 4 == 12 * PSI // N, (
    "DeepSpeed's ZeRO-2 optimizer holds 12Ψ/N: an fp32 master partition and moments"
)
assert all(answer != "ran" for answer in answers.values()), answers

rows70 = {(r["stage"], r["offload"]): r for r in found["70B"]["rows"]}
psi70, largest = found["70B"]["params"], found["70B"]["largest_layer"]
assert (
    rows70[2, False]["deepspeed_gpu"] == rows70[2, False]["dtlab_gpu"] + 2 * psi70 // 8
), "ZeRO-2: DeepSpeed counts dtlab's bytes plus its 16-bit gradient partition, 2Ψ/N"
assert (
    rows70[3, False]["deepspeed_gpu"] == rows70[3, False]["dtlab_gpu"] + 4 * largest
), "ZeRO-3: plus one gathered layer in fp32 (4 × the largest layer)"
assert rows70[2, False]["dtlab_gpu"] == rows70[2, False]["paper_gpu"] + 2 * psi70 / 8, (
    "dtlab counts an fp32 gradient slice where the paper counts fp16: + 2Ψ/N"
)

# Chapter 05's claims (notebooks/05_pipeline_parallel.ipynb), run in the chapter's
# kernel just before it stops its cluster: every number the chapter proved, out of the
# learner's path. The explorer's controls are driven from here, never from the page.

# section 2's reveal: rank 1 of 1F1B at p=4, m=6 warms up with p − stage − 1 = 2
# forwards, runs 4 F/B pairs, then the 2 backwards left; the schedule is valid
pipeline.validate(s1f1b)
rank1 = [str(a) for a in s1f1b.compute_order(1)]
assert rank1 == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5".split(), rank1
computes = {n: sum(a[0] in "FB" for a in acts) for n, acts in phases.items()}
assert computes == {"warm-up": 2, "steady": 8, "cool-down": 2}, computes

# section 3: the simulated steps at p=4, m=8, t_f=1, t_b=2 (t_B = t_W = 1)
assert step["GPipe"] == step["1F1B"] == (M + P - 1) * 3, (
    f"GPipe and 1F1B: a step of (m + p − 1)(t_f + t_b), got {step}"
)
assert pipeline.bubble(ideal["1F1B"]) == est.pipeline_bubble_fraction(P, M), (
    "1F1B's bubble is (p − 1)/(m + p − 1) of the step"
)
assert step["interleaved 1F1B, v=2"] == M * 3 + (P - 1) * 3 / 2, (
    "interleaving with v = 2 halves the bubble's time"
)
assert step["ZB-H1"] == M * 3 + (P - 1) * 1, (
    "ZB-H1: (p − 1)(t_f + t_B − t_W) of bubble, a third of 1F1B's here"
)
# the derivation, stage by stage, under GPipe and 1F1B: i·t_f before the first
# forward, (p − 1 − i)(t_f + t_b) between, i·t_b after the last backward
for name in ("GPipe", "1F1B"):
    for row in idle[name]:
        i = row["stage"]
        assert (row["before"], row["between"], row["after"]) == (
            i * 1.0,
            (P - 1 - i) * 3.0,
            i * 2.0,
        ), (name, row)
assert not off, f"simulated bubbles off the formula: {off}"

# section 6, moved as a learner would: every stage ran every F, B (and W) of the
# schedule in its order and held as many microbatches as the schedule bounds
for p, m, name, v in [
    (4, 4, "gpipe", 1),
    (2, 4, "interleaved", 2),
    (4, 4, "zb_h1", 1),
    (4, 8, "1f1b", 1),
    (2, 4, "zb_v", 1),  # the V: two chunks a rank, whatever v the controls show
    (2, 4, "dualpipe_v", 1),
]:
    explorer.verify(p, m, name, v)
    if name == "gpipe":
        assert explorer.last["bound"] == [m] * p, "GPipe's bound: m on every stage"
    if name == "1f1b":
        assert explorer.last["bound"] == [p - s for s in range(p)], (
            "1F1B's bound: p − stage"
        )
explorer.check(pp_first)

# optional section at p = 2: the runs kept the schedule, and the ideal timeline's
# bubble is 1/(m + 1) at every m
for last in p2_runs.values():
    explorer.check(last)
assert all(abs(f - i) < 1e-9 for f, i, _ in p2.values()), p2

# section 7: GPipe holds all 8 microbatches on every stage, 1F1B p − stage; Megatron's
# trick freed every sent stage output on stages 0..2; every message carried b·s·h fp32
assert [s["peak_in_flight"] for s in mem["gpipe"]] == [8, 8, 8, 8], mem["gpipe"]
assert [s["peak_in_flight"] for s in mem["1f1b"]] == [
    est.pipeline_in_flight(4, stage, 8, "1f1b") for stage in range(4)
], mem["1f1b"]
assert abs(ratio - 4 / 8) < 0.01, f"1F1B/GPipe stage 0 peak bytes {ratio:.3f}"
sent_out = 8 * ROWS * LIVE.seq_len * LIVE.d_model * 4
assert all(s["freed_bytes"] == sent_out for s in mem["1f1b"][:3]), (
    [s["freed_bytes"] for s in mem["1f1b"]],
    sent_out,
)
act_bytes = ROWS * LIVE.seq_len * LIVE.d_model * 4
assert pp_sends and all(e["payload_bytes"] == act_bytes for e in pp_sends), (
    "every message carries b·s·h fp32 values"
)

# optional section on more microbatches: rank 1 sends 2m messages, the same bytes
# at every m (m activations forward, m gradients back)
for m, res in fixed.items():
    assert res[1]["sends"] == 2 * m, (m, res[1]["sends"])
    assert res[1]["bytes"] == 2 * 32 * LIVE.seq_len * LIVE.d_model * 4, (m, res[1])

# section 8: TP sends more than 20 times the bytes PP does, per stage and microbatch
assert tp_bytes > 20 * pp_bytes, (tp_bytes, pp_bytes)

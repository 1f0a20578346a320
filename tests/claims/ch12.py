# Chapter 12's claims (notebooks/12_frontier.ipynb), run in the chapter's kernel just
# before it stops its cluster: every number the chapter states, out of the learner's
# path.

# section 1: the jump saturates under delayed scaling at the jump's step only (step 1
# clips a sliver: its amax 1.2 exceeds step 0's 1.0); current scaling never clips, and
# every delayed scale is 448 over the largest of the (up to) 4 amaxes before it
assert jump[4]["delayed_clipped"] > 0.5 and jump[4]["delayed_error"] > 0.5, jump[4]
for i, row in enumerate(jump):
    assert row["current_clipped"] == 0 and row["current_error"] < 0.04, row
    if i != 4:
        assert row["delayed_clipped"] < 0.01, row
    if i > 0:
        seen = max(r["amax"] for r in jump[max(0, i - 4) : i])
        assert abs(row["delayed_scale"] - 448 / seen) < 1e-4 * row["delayed_scale"], i

# FP8 really rounds differently from bf16, and every curve ends within 1 % of bf16
for name in ("fp8-delayed", "fp8-current"):
    assert curves[name] != curves["bf16"], name
    assert abs(tail[name] - tail["bf16"]) <= 0.01 * tail["bf16"], (name, tail)

# the FP8 all-gather: 1, 2 and 4 bytes per parameter and 4 bytes of amax per weight,
# exactly as the estimate says; the prediction's answer is psi / 2 bytes on 2 ranks
for what, got, want in fp8_bytes_rows:
    assert got == want, f"{what}: measured {got:,.0f} B, the estimate {want:,.0f} B"
assert psi_fp8 == 98_304 and sent["fp8 all-gather"] == psi_fp8 / 2, sent
assert all(g["exact"] for g in gathered), gathered

# section 2: the simulated schedules equal the formulas, step and peak memory
for row in rows:
    assert abs(row["step"] - row["estimate"]) < 1e-9, row["schedule"]
    assert row["peak"] == row["peak_estimate"], row["schedule"]
by_name = {row["schedule"]: row for row in rows}
assert abs(by_name["ZB-V"]["bubble"] - 0.04) < 1e-12  # 0.5 of 12.5 units
assert abs(by_name["1F1B"]["bubble"] - 0.2) < 1e-12  # the page's "20 %"
assert by_name["ZB-V"]["peak"] == [2, 2] and by_name["DualPipeV"]["peak"] == [2.5, 2.5]
# the page's p = 4, m = 8 figures: 5.9 % for the V, 27 % for 1F1B
wide = {row["schedule"]: row["bubble"] for row in schedule_rows(4, 8)}
assert round(wide["ZB-V"], 3) == 0.059 and round(wide["1F1B"], 2) == 0.27, wide

# live: every schedule trains to the reference, and each rank's peak in flight is
# est.pipeline_in_flight's (1F1B in microbatches, the V in chunks: [2, 1], [4, 4],
# [5, 5])
for name, r in v_runs.items():
    v_gap = worst_gap(r.losses(), v_reference)
    assert v_gap < 2e-6, f"{name}: max rel. gap {v_gap:.1e} to the reference"
    want = [est.pipeline_in_flight(2, k, 4, name) for k in range(2)]
    assert peak_in_flight(r.events) == want, (name, peak_in_flight(r.events), want)
assert peak_in_flight(v_runs["zb_v"].events) == [4, 4]

# torch.distributed.pipelining: the same loss on rank 0 (None on rank 1) and the same
# gradients, bit for bit, for both V schedules
for name, res in torch_runs.items():
    assert res[0]["loss"] == res[0]["torch_loss"], name
    assert res[1]["loss"] is None and res[1]["torch_loss"] is None, name
    assert all(x["grad_gap"] == 0 for x in res), name

# section 3: Newton-Schulz of halves is not of the whole; both designs equal
# torch.optim.Muon bit for bit (the page's confirm), and their bytes and FLOPs are
# dtlab.muon.estimate's, per tag and per rank
assert ns_gap > 0.1, ns_gap
for design, (out, events) in muon_runs.items():
    want = muon_traffic(shapes, 2, design)
    for rank in range(2):
        mine = {
            tag: v / STEPS
            for tag, v in wire_by_tag(events, rank).items()
            if tag.startswith("muon/")
        }
        assert mine == want.wire_bytes, (design, rank, mine, want.wire_bytes)
    assert [rank["flops"] for rank in out] == muon_flops(shapes, 2, design), design
for what, got, want in muon_bytes_rows:
    assert got == want, f"{what}: measured {got:,.0f} B, the estimate {want:,.0f} B"
naive_total = muon_traffic(shapes, 2, "naive").total_wire_bytes
assert naive_total == 5 * 24_576, naive_total  # 10 B an element, half of it sent
assert muon_traffic(shapes, 2, "owner").total_wire_bytes == 0.8 * naive_total
# owner-compute: each rank owns half the matrices and does half the Newton-Schulz work
owned = [rank["owned"] for rank in muon_runs["owner"][0]]
assert sorted(owned[0] + owned[1]) == list(range(12)), owned
assert sum(muon_flops(shapes, 2, "owner")) == muon_flops(shapes, 2, "naive")[0]

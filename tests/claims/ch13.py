# Chapter 13's claims (notebooks/13_resilience.ipynb), run in the chapter's kernel just
# before it stops its cluster: every number the chapter states, out of the learner's
# path.
import math

# section 1: Llama 3's count (419 unexpected interruptions in 54 days on 2,048 servers)
# gives a server an MTBF of about 264 days, one interruption every ~3 hours for the
# whole run; 128 servers fail every 49.5 h
assert round(54 * 24 / 419) == 3
assert node_mtbf == 54 * 86_400 * 2048 / 419 and round(node_mtbf / 86_400) == 264
assert M == node_mtbf / 128 and round(M / 3600, 1) == 49.5, M
assert math.isclose(tau_yd, math.sqrt(2 * C * M)) and round(tau_yd / 3600, 2) == 1.82
assert tau_daly < tau_yd and round(tau_daly / 3600, 2) == 1.79  # Daly's correction
# the optimum wastes ~3.7 %; half or twice the interval costs about a quarter more
w_best = ft.expected_waste(tau_yd, C, M)
assert round(w_best, 3) == 0.037 and math.isclose(w_best, math.sqrt(2 * C / M))
for other in (tau_yd / 2, 2 * tau_yd):
    ratio = ft.expected_waste(other, C, M) / w_best
    assert 1.2 < ratio < 1.3, ratio
# the simulation, which knows nothing of the formula, finds its best within 5 % of
# Young-Daly (the page's confirm) and agrees near the optimum; at 24 h the first-order
# formula overstates the waste
assert abs(best / tau_yd - 1) < 0.05, best / tau_yd
by_hours = {round(r["interval_h"], 2): r for r in waste}
assert abs(by_hours[1.82]["simulated"] - by_hours[1.82]["waste"]) < 0.002
assert by_hours[24.0]["simulated"] < by_hours[24.0]["waste"] - 0.01
assert min(simulated) <= min(r["simulated"] for r in waste) + 1e-12
# 16,384 GPUs: a failure every 3.1 h, a checkpoint every 27 minutes, ~15 % lost
assert round(M_16k / 3600, 1) == 3.1 and round(tau_16k / 60) == 27
assert round(waste_16k, 2) == 0.15 and math.isclose(waste_16k / w_best, 4, rel_tol=1e-9)

# section 2: replica 2 sits out steps 3-5 and is healed for step 6; every replica ends
# at step 12 with the same weights; the curves agree exactly before the loss
ALL, THREE = (0, 1, 2, 3), (0, 1, 3)
assert lost[0]["live"] == [ALL] * 3 + [THREE] * 3 + [ALL] * 6, lost[0]["live"]
assert all(r["live"] == lost[0]["live"] for r in lost)
assert all(r["live"] == [ALL] * STEPS for r in clean)
assert lost[2]["loss"][3:6] == [None] * 3 and all(r["step"] == STEPS for r in lost)
assert same_weights(lost) and same_weights(clean)
assert lost[0]["loss"][:3] == clean[0]["loss"][:3]
assert 0 < ft_gap < 0.05, ft_gap  # close, not equal (the page says 0.012)
assert psi == 106_240 and B // 4 == 4  # "4 rows per replica", "12 rows instead of 16"
# healing: only replica 2 received state, at least the weights and both moments (12 B
# a parameter), plus torch.save's framing; rank 0 sent it (+ 8 bytes of size)
assert [r["healed_bytes"] > 0 for r in lost] == [False, False, True, False]
assert 12 * psi <= lost[2]["healed_bytes"] <= 12 * psi + 64 * 1024
heal_sent = [
    e["payload_bytes"]
    for e in lost_events
    if e.get("rank") == 0 and e.get("tag") == "heal" and e.get("op") == "send"
]
assert sum(heal_sent) == lost[2]["healed_bytes"] + 8, heal_sent
# while replica 2 is out, the gradient all-reduce runs over 3 replicas
for step in range(STEPS):
    grads = [
        e
        for e in lost_events
        if e.get("rank") == 0 and e.get("tag") == "ft_grads" and e["step"] == step
    ]
    n = 3 if 3 <= step < 6 else 4
    want = est.wire_bytes("all_reduce", 4 * psi, n)
    assert [e["wire_bytes"] for e in grads] == [want], (step, grads)

# LocalSGD and DiLoCo send one H-th of DDP's gradient bytes, to the byte; both train,
# a little behind DDP on the same steps
for what, got, want in local_bytes_rows:
    assert got == want, f"{what}: measured {got:,.0f} B, the estimate {want:,.0f} B"
assert sent["diloco"] == sent["localsgd"] == sent["ddp"] / H
assert sent["diloco"] == ft.local_sgd_bytes_per_step(psi, 4, 4) == 159_360
for name in ("localsgd", "diloco"):
    curve = local_curves[name]
    assert curve[-1] < curve[0] - 0.3, (name, curve)
    assert curve[-1] > local_curves["ddp"][-1], name
    gaps = [abs(a - b) for a, b in zip(curve, local_curves["ddp"])]
    assert max(gaps) < 0.15, (name, max(gaps))
    # after every meeting the replicas hold the same weights
    assert same_weights(local_runs[name]), name

# section 3: 7,248 parameters, 12 bytes each in the checkpoint; a DDP rank reads all of
# them, a ZeRO-3 rank half; each load continues the run that never stopped to 2e-6
# relative, and the single-process reference too
assert meta_psi == 7248 and ours["payload_bytes"] == 12 * meta_psi
assert sorted(ours["data_bytes"].values()) == [12 * meta_psi // 4] * 4
for case, (_, out) in loads.items():
    want = 6 * meta_psi if case.endswith("ZeRO-3 dp2") else 12 * meta_psi
    assert [r["bytes_read"] for r in out] == [want, want], case
    assert all(r["step"] == K and r["resharded"] for r in out), case
    assert reshard_gaps[case] < 2e-6, (case, reshard_gaps[case])
    for a, b in zip(out[0]["losses"], reference[K:]):
        assert abs(a - b) <= 2e-6 * b, (case, a, b)
# the ZeRO-3 load's plan for wte.weight (33 x 16 = 528 elements): the two ranks'
# pieces tile the tensor, and each rank's reads fill its piece exactly
plans = loads["ZeRO-3 dp4 -> ZeRO-3 dp2"][1]
assert plans[0]["piece"][0] == 0 and plans[1]["piece"][1] == 33 * 16
assert plans[0]["piece"][1] == plans[1]["piece"][0]
for out in plans:
    lo, hi = out["piece"]
    assert sum(n for r in out["reads"] for _, _, n in r["segments"]) == hi - lo
# DCP: loaded on 2 at step K, the same losses as its run that never stopped; more
# bytes on disk than the tensors hold, several times over
assert dcp_loaded[0]["step"] == K
for a, b in zip(dcp_loaded[0]["losses"], dcp_run[0]["losses"][K:]):
    assert abs(a - b) <= 2e-6 * b, (a, b)
assert theirs["stored_bytes"] > 5 * theirs["payload_bytes"], theirs
assert theirs["metadata_bytes"] > ours["metadata_bytes"]

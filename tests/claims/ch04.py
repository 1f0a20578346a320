# Chapter 04's claims (notebooks/04_tensor_parallel.ipynb), run in the chapter's kernel
# just before it stops its cluster: every number the chapter proved, out of the
# learner's path. The explorer's controls are driven from here, never from the page.
import math

# section 2: each collective of the MLP carries the whole activation, b·s·h fp32 values
mlp_payloads = {e["payload_bytes"] for e in mlp_events}
assert mlp_payloads == {4 * 8 * 32 * 4}, f"the MLP's all-reduces carried {mlp_payloads}"

# section 4: the explorer at tp=2 measured the ring formula's bytes on every layer
tp2_formula = tp2_step["pred"]["wire_bytes"]
assert all(math.isclose(b, tp2_formula) for b in tp2_step["sent"].values()), (
    f"tp=2: rank 0 sent {tp2_step['sent']} per layer, the formula says {tp2_formula}"
)
# moved as a learner would: every layer runs the estimate's collectives (2 all-reduces
# each way; 2 all-gathers + 2 reduce-scatters each way under SP), sends the ring
# formula's bytes, and the loss on every rank is the single process's within 1e-6
for tp, sp in [(2, False), (4, True), (2, True), (4, False)]:
    explorer.verify(tp, sp)

# section 5: activation memory per layer
assert by[1, False] > by[2, False] > by[4, False], f"TP did not shrink them: {by}"
assert by[2, True] < by[2, False] and by[4, True] < by[4, False], (
    f"SP did not shrink them further: {by}"
)
assert all(0.6 < m / p <= 1.0 for m, p in zip(act_measured, act_predicted)), (
    "every measurement sits at or below Korthikanti's formula, by at most 40 %: "
    f"{[round(m / p, 3) for m, p in zip(act_measured, act_predicted)]}"
)

# section 6: parameter bytes per rank equal est.tp_params_per_rank, byte for byte
assert held == formula, f"parameters per rank {held}, the formula's {formula}"

# optional section on dropout: the replicated stream draws the same mask on both
# ranks of a tp group, the sharded stream different ones
assert torch.equal(drop_res[0][0][False], drop_res[1][0][False]), (
    "the replicated stream drew different masks"
)
assert not torch.equal(drop_res[0][0][True], drop_res[1][0][True]), (
    "the sharded stream drew the same mask on both ranks"
)

# section 7: the loss fell by more than 10 % in 12 steps at tp=4 + SP
assert tp_losses[-1] < 0.9 * tp_losses[0], f"losses {tp_losses}"

# section 8: over NVLink the collectives are shorter than the matmuls (they can hide
# behind them); over InfiniBand and Ethernet longer (part stays exposed)
assert times["nvlink"]["comm_s"] < times["nvlink"]["compute_s"], times["nvlink"]
for link in ("infiniband", "ethernet"):
    assert times[link]["comm_s"] > times[link]["compute_s"], (link, times[link])
# and the step measured on this machine spent time in collectives
assert comm_s > 0 and step_s > 0 and n_calls > 0, (comm_s, step_s, n_calls)

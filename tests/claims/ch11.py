# Chapter 11's claims (notebooks/11_beyond_3d.ipynb), run in the chapter's kernel just
# before it stops its cluster: every number the chapter proved, out of the learner's
# path. The beyond-3D control panel is driven from here, never from the page.

# section 2: the load-balanced layout gives every rank the same causal work; contiguous
# chunks give the later ranks more
assert len(set(balanced)) == 1, f"load-balanced causal scores per rank: {balanced}"
assert plain == sorted(plain) and plain[-1] > plain[0], (
    f"contiguous chunks should load the later ranks: {plain}"
)

# section 3 (the reveal): two blocks merged by their lse = one softmax over all keys
merge_gap = (merged - whole).abs().max().item()
assert merge_gap < 1e-6, f"two merged blocks differ from one softmax by {merge_gap:.1e}"

# section 4: Ulysses refuses a cp that does not divide the heads, before any rank starts
assert refusal is not None and "n_heads" in refusal, (
    f"Ulysses at cp=4 on a 2-head model was not refused by name: {refusal!r}"
)

# section 5: every cp layout trains to the single-process losses (2e-6 relative)
for name, r in cp_runs.items():
    cp_gap = worst_gap(r.losses(), reference)
    assert cp_gap < 2e-6, f"{name}: max rel. gap {cp_gap:.1e} to the reference"
# ... and every byte the cp ranks sent, and every activation byte they kept, equals
# dtlab.estimate's figure (per layer, per step, gradients over dp·cp)
for what, got, want in cp_bytes_rows + cp_memory_rows:
    assert got == want, f"{what}: measured {got:,.0f} B, the estimate {want:,.0f} B"
# the two predictions' measurements are those figures
for variant, per_layer in (("ring", 73_728), ("ulysses", 24_576)):
    sent = cp_traffic(cp_runs[f"cp=4, {variant}"])["attention"] / DENSE.n_layers
    assert sent == per_layer, f"cp=4 {variant}: {sent:,.0f} B per layer"

# section 7: every ep layout trains to the single-process MoE (2e-6 relative)
for name, r in ep_runs.items():
    ep_gap = worst_gap(r.losses(), moe_reference)
    assert ep_gap < 2e-6, f"{name}: max rel. gap {ep_gap:.1e} to the MoE reference"
# the no-drop ep=4 run: every rank's MoE bytes equal the exact figure from the routing
# it recorded, and their mean sits near the uniform estimate the learner predicted
exact_run = ep_runs["dp=4, ep=4"]
for rank in range(4):
    exact = sum(
        est.ep_traffic_from_counts(
            count_matrix(exact_run.events, 1, layer), rank, EXACT.d_model
        )["wire_bytes"]
        for layer in ("blocks.0.mlp", "blocks.1.mlp")
    )
    got = moe_bytes(exact_run, rank)
    assert got == exact, (
        f"ep=4 rank {rank}: {got:,.0f} B, from its routing {exact:,.0f}"
    )
uniform = est.ep_bytes_per_layer(tokens, EXACT.d_model, 4, n_experts=4, top_k=2)
assert 0.5 < (sum(ep_sent) / 4) / uniform["wire_bytes"] < 1.5, (
    f"mean MoE bytes per layer {sum(ep_sent) / 4:,.0f}, uniform {uniform['wire_bytes']}"
)

# optional section, the realistic router: every rank's all-to-all and count bytes equal
# the exact figure from the recorded count matrix
for what, got, want in ep_bytes_rows:
    assert got == want, f"{what}: measured {got:,.0f} B, from the routing {want:,.0f} B"

# section 8: ZeRO-3 and HSDP train to the reference; their bytes per axis and the
# hybrid rank's weights and gradients equal the estimate, to the byte
for name, hsdp_gap in hsdp_gaps.items():
    assert hsdp_gap < 2e-6, f"{name}: max rel. gap {hsdp_gap:.1e} to the reference"
for what, got, want in hsdp_bytes_rows:
    assert got == want, f"{what}: measured {got:,.0f} B, the estimate {want:,.0f} B"
hsdp_held = measured_memory(hsdp.events)
hsdp_want = est.hsdp_states_per_rank(psi, 2, 2, 3, "fp32")
for what in ("params", "grads"):
    assert hsdp_held[what] == hsdp_want[what], (
        f"HSDP {what} per rank: {hsdp_held[what]:,} B, "
        f"the estimate {hsdp_want[what]:,.0f} B"
    )

# optional section: FSDP2's HSDP matches dtlab's bit for bit, in losses and bytes per op
assert theirs["losses"] == hsdp.losses(), (theirs["losses"], hsdp.losses())
for what, got, want in fsdp2_bytes_rows:
    assert got == want, f"{what}: FSDP2 {got:,.0f} B, dtlab {want:,.0f} B"

# optional section, the control panel: what a learner's click does. Pick dp2·cp2·ep2,
# press Run, wait (bounded)
beyond_layout = Layout(dp=2, cp=2, ep=2)
panel.layout.value = beyond_layout
panel.steps.value = 4
panel.run_button.click()
beyond = panel.wait(timeout=180)
assert not panel.errors, f"the dp2·cp2·ep2 run from the panel failed: {panel.errors}"
board = panel.dashboard
mates = {r: [x for x in beyond_layout.group_of("cp", r) if x != r][0] for r in range(4)}
assert all(board.matrix[r][mates[r]] > 0 for r in range(4)), (
    "every rank sends K/V blocks to its cp partner: "
    + ", ".join(f"r{r}→r{m}: {board.matrix[r][m]:,.0f} B" for r, m in mates.items())
)
routed = [t.y for t in board.figures["experts"].data]
assert len(routed) == 4 and all(sum(y) > 0 for y in routed), (
    f"the experts view shows every rank's tokens per expert: {routed}"
)

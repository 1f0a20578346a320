"""Chapter 02's claims (notebooks/02_data_parallel.ipynb): nn.DataParallel's
gradient and memory, DDP's parity with one process, the bytes and buckets against
the estimates, the bucket views, gradient accumulation, PyTorch's DDP and its
launchers beside dtlab's, and the gradient noise scale. Runs in the chapter's
kernel, with its cluster still up."""

# ---- set-up --------------------------------------------------------------------------
assert ready == [True] * N, f"{N} engines ready: {ready}"

# ---- 1. nn.DataParallel --------------------------------------------------------------
assert dp_worst < 1e-6, (
    "one process, one batch: the same gradient as a plain single-model step "
    f"(largest difference {dp_worst:.1e}, the same sums added in another order)"
)
assert replica_losses.shape == (4,), "one mean loss per replica: average them yourself"
assert dp_report[0]["grads"] == PSI * 4 and dp_report[1]["grads"] == 0, (
    "only the primary holds gradients"
)
assert dp_report[0]["outputs"] == 4 * dp_report[1]["outputs"], (
    "the primary holds the outputs of the whole batch: 4× a replica's"
)
assert torch_dp.device_ids == [], "torch's DataParallel finds no GPU to replicate to"
assert torch_dp_loss.item() == plain_loss.item(), (
    "without GPUs nn.DataParallel's forward is the module's"
)

# ---- 2. DDP on four ranks ------------------------------------------------------------
assert len({tuple(v) for v in digests.values()}) == 1, "identical weights on every rank"
assert len({tuple(v) for v in losses.values()}) == 1, "every rank reports one loss"
assert len({v[-1] for v in local.values()}) == N, "each rank's slice: its own loss"
assert ddp_worst < 1e-5, f"DDP vs one process: {ddp_worst:.1e}"

# ---- 3. overlap and bytes ------------------------------------------------------------
assert all(
    first_launch_inside_backward(run.events, r, s)
    for r in range(N)
    for s in range(config.steps)
), "the first bucket leaves while backward is still computing"
assert all(v == predicted for v in sent.values()), (
    f"every rank sent exactly 2(N−1)/N · 4Ψ bytes: {sent} vs {predicted}"
)
assert bytes_check.measured == bytes_check.estimate, bytes_check

# ---- 4. bucket size ------------------------------------------------------------------
assert all(r["buckets"] == r["predicted_buckets"] for r in rows), (
    f"the bucket count at every cap is PyTorch's rule: {rows}"
)
assert all(r["wire_bytes"] == est.ddp_bytes_per_step(PSI, N) for r in rows), (
    "the bytes per step do not depend on the cap"
)
assert rows[-1]["buckets"] == 1 and hidden_check.estimate == 0, (
    "one 25 MiB bucket: the model hides nothing"
)
assert 0 <= hidden_check.measured <= 100, hidden_check

# ---- 5. the reducer's bucket views ---------------------------------------------------
assert all(v["views"] and v["storages"] for v in views), "every .grad a bucket view"
assert all(v["bucket_bytes"] == 4 * PSI for v in views), (
    "the buckets hold exactly the 4Ψ bytes of fp32 gradients: no second copy"
)

# ---- 6. gradient accumulation --------------------------------------------------------
assert all(abs(a - b) < 1e-5 * b for a, b in zip(accum.losses(), ref8)), (
    "4 accumulated microbatches train like one batch of 16, up to rounding"
)
assert all(b == 4 and c == buckets for b, c, buckets in counts), counts

# ---- 7. PyTorch's DDP beside dtlab's -------------------------------------------------
assert torch_worst < 2e-6, f"torch DDP vs dtlab DDP: {torch_worst:.1e}"
assert all(theirs["memory"][k] == ours["memory"][k] for k in ("params", "grads")), (
    "each rank holds the same weights and gradients under both"
)
assert theirs["memory"]["grads"] == 4 * PSI, "4Ψ bytes of fp32 gradients"
assert theirs["memory"]["optimizer"] == ours["memory"]["optimizer"], (
    "the same AdamW state: two moments of 4Ψ and a step counter per tensor"
)
ar_theirs = theirs["traffic"][1]["all_reduce"]["payload_bytes"]
ar_ours = ours["traffic"][1]["all_reduce"]["payload_bytes"]
assert ar_theirs == 4 * PSI and ar_ours == 4 * PSI + 8, (
    "both all-reduce the 4Ψ gradient bytes once per step (one 25 MiB bucket); dtlab "
    f"adds its 8-byte float64 loss record: {ar_theirs}, {ar_ours}"
)

# ---- optional: the launchers ---------------------------------------------------------
assert spawned[0]["losses"] == torchrun[0]["losses"], "mp.spawn and torchrun: same bits"
launch_worst = max(
    abs(a - b) / b for a, b in zip(torchrun[0]["losses"], ours["losses"])
)
assert launch_worst < 2e-6, f"torchrun's 2 ranks vs dtlab's 4: {launch_worst:.1e}"
assert (
    {r["start_method"] for r in spawned} == {"spawn"}
    and all(r["env"]["RANK"] is None for r in spawned)
    and len({r["ppid"] for r in spawned}) == 1
), "mp.spawn: fresh interpreters, children of one parent, told no RANK or WORLD_SIZE"
assert all(
    (r["env"]["RANK"], r["env"]["WORLD_SIZE"]) == (str(r["rank"]), "2")
    and r["env"]["TORCHELASTIC_RUN_ID"]
    for r in torchrun
), "torchrun: every worker given RANK, WORLD_SIZE and a run id by the agent"

# ---- optional: the gradient noise scale ----------------------------------------------
assert all(
    0.5 < measured_noise[s][b] / (noise_scale(noise[s]["rows"], N) / b) < 2
    for s in noise
    for b in BATCHES
), "the measured noise/signal follows B_noise / B at every batch size, within 2×"
assert all(
    measured_noise[s][b] > 2 * measured_noise[s][4 * b]
    for s in noise
    for b in (4, 8, 16, 32)
), "4× the batch, a quarter of the noise (more than halved at every size)"
assert noise_after > 2 * noise_before, (
    f"the noise scale grows as the loss falls: {noise_before:.1f} -> {noise_after:.1f}"
)

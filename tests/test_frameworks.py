"""dtlab beside the real frameworks: the same job (dtlab.frameworks.job: dtlab's GPT,
batch slices, seed and AdamW) under torch DDP (on the engines, mp.spawn, torchrun),
FSDP2 and HSDP, autocast + GradScaler, HF accelerate (prepare, accelerate launch)
and DeepSpeed ZeRO-1/2/3 and offload, each compared with dtlab's own run of it.

Tolerances, and why:

- **fp32 on 2 ranks: the same bits.** Every framework here averages two ranks'
  gradients as (a + b)/2 or a/2 + b/2, which are equal in floating point (a sum of
  two has one order, halving is exact), on the same slices, with the same AdamW:
  torch DDP, accelerate (torch DDP inside), DeepSpeed ZeRO-1/2/3 and ZeRO-Offload
  (torch's AdamW on the host). Measured: identical losses.
- **fp32 on 4 ranks** (FSDP2, HSDP, torch DDP): gloo adds four shares in an order
  that depends on the buffer's layout (dtlab's buckets and units are not torch's),
  a few ulp per gradient. Measured at most 1.5e-8 relative over 3 steps, allowed
  2e-6, the tolerance of tests/test_parallelize.py; a wrong average misses by 1e-3.
- **bf16**: FSDP2's ``MixedPrecisionPolicy(bf16, bf16)`` rounds the same tensors as
  dtlab's ZeRO-3 with ``compute_dtype=bf16`` in other sums: measured 5.5e-6,
  allowed 2e-3 (tests/test_amp_strategies.py's bf16 tolerance). autocast is a
  different design (it keeps the residual stream and LayerNorms in fp32; dtlab
  casts the whole model): measured 4e-4 over 10 steps, allowed 2e-3.
- **DeepSpeed ZeRO-3** computes every linear layer with its own
  ``torch.nn.functional.linear`` (a matmul, then the bias added; torch's is one fused
  call): measured 6e-8 relative over 3 steps, allowed 1e-6. It patches torch for the
  whole process; dtlab.frameworks.deepspeed_run puts torch's back after each run.
- **fp16** DeepSpeed ZeRO-2 against dtlab's ZeRO-2 (2 ranks, 4 steps, the
  translated config): the same scale every step, no skip in either, losses
  measured 8e-6 apart, allowed 3e-4 (fp16's tolerance elsewhere).

Bytes are compared with one yardstick (dtlab.frameworks.traffic counts every
torch.distributed collective, dtlab's own included) and must agree exactly where
the algorithms are the same (FSDP2 and dtlab's ZeRO send the same all-gathers and
reduce-scatters); where they differ the test pins the difference and says why.
What cannot run on CPU is skipped with DeepSpeed's own error printed.
"""

import pytest
import torch

from dtlab import estimate
from dtlab.capabilities import lacking
from dtlab.events import zero_stage
from dtlab.frameworks import missing
from dtlab.model import GPT, GPTConfig
from dtlab.train import TrainConfig

CFG = GPTConfig()  # 2 layers, d_model 64, vocab 64, seq 32: Ψ = 106,240
PSI = GPT(CFG).n_params()
JOB = TrainConfig(model=CFG, steps=3, global_batch_size=8)

needs_deepspeed = pytest.mark.skipif(
    missing("deepspeed") is not None, reason=str(missing("deepspeed"))
)
needs_accelerate = pytest.mark.skipif(
    missing("accelerate") is not None, reason=str(missing("accelerate"))
)


def _payload(traffic: dict) -> dict:
    """``{op: payload bytes}`` of one step's traffic."""
    return {op: row["payload_bytes"] for op, row in traffic.items()}


# ---- torch DDP, on the engines and under its launchers (chapter 02) ------------------
def _ddp_pair(config):
    from dtlab.frameworks.job import dtlab_run
    from dtlab.frameworks.torch_ddp import train_ddp

    return {"torch": train_ddp(config), "dtlab": dtlab_run(config)}


@pytest.fixture(scope="module")
def ddp2(lab_cluster):
    """torch DDP and dtlab's DDP on the 2-rank engines, rank 0's view."""
    return lab_cluster(2).run(_ddp_pair, JOB, timeout=120)[0]


@pytest.mark.cluster
def test_torch_ddp_matches_dtlab_ddp_bit_for_bit(ddp2):
    torch_run, ours = ddp2["torch"], ddp2["dtlab"]
    assert torch_run["wrapped"].endswith("DistributedDataParallel")
    assert torch_run["losses"] == ours["losses"]  # fp32, 2 ranks: the same bits
    assert torch_run["grad_norms"] == ours["grad_norms"]
    assert torch_run["memory"]["params"] == ours["memory"]["params"] == 4 * PSI
    assert torch_run["memory"]["grads"] == ours["memory"]["grads"] == 4 * PSI
    assert torch_run["memory"]["optimizer"] == ours["memory"]["optimizer"]
    # one bucket of 25 MB holds every gradient: one all-reduce of 4Ψ per step;
    # dtlab's trainer adds its float64 loss record (8 bytes)
    for step in (1, 2):
        theirs = torch_run["traffic"][step]["all_reduce"]
        mine = ours["traffic"][step]["all_reduce"]
        assert theirs["payload_bytes"] == 4 * PSI
        assert mine["payload_bytes"] == 4 * PSI + 8


@pytest.mark.cluster
@pytest.mark.slow
def test_spawn_and_torchrun_launch_the_same_job(ddp2):
    """The script under each launcher, from a subprocess with a bounded wait: the
    same losses as on the engines, and what each launcher told its processes."""
    from dtlab.frameworks.torch_ddp import launch

    ours = ddp2["dtlab"]["losses"]
    spawned = launch("spawn", JOB, 2, timeout=180)
    torchrun = launch("torchrun", JOB, 2, timeout=180)
    for records in (spawned, torchrun):
        assert [r["rank"] for r in records] == [0, 1]
        assert all(r["losses"] == ours for r in records)
        assert all(r["env"]["MASTER_ADDR"] == "127.0.0.1" for r in records)
        assert all(r["env"]["GLOO_SOCKET_IFNAME"] == "lo" for r in records)
    # mp.spawn: fresh interpreters (start method spawn), children of the script,
    # told only their index: no RANK, WORLD_SIZE or LOCAL_RANK
    assert {r["start_method"] for r in spawned} == {"spawn"}
    assert len({r["ppid"] for r in spawned}) == 1
    assert all(r["env"]["RANK"] is None for r in spawned)
    assert all(r["env"]["WORLD_SIZE"] is None for r in spawned)
    # torchrun: plain subprocesses of its agent, every variable set by it
    assert {r["start_method"] for r in torchrun} == {None}
    for r in torchrun:
        env = r["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(r["rank"]), str(r["rank"]))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert env["TORCHELASTIC_RUN_ID"] is not None and env["OMP_NUM_THREADS"]
    print(
        f"\nspawn: {spawned[0]['wall_s']:.1f} s, torchrun: "
        f"{torchrun[0]['wall_s']:.1f} s; losses {ours}"
    )


# ---- FSDP2 and HSDP (chapter 03) -----------------------------------------------------
def _fsdp2_runs(job):
    from dtlab.frameworks.fsdp2 import train_fsdp2
    from dtlab.frameworks.job import dtlab_run
    from dtlab.frameworks.torch_ddp import train_ddp

    zero3, zero2 = job.replace(strategy="zero3"), job.replace(strategy="zero2")
    bf16 = zero3.replace(precision="bf16")
    return {
        "fsdp": train_fsdp2(zero3),
        "fsdp_no_reshard": train_fsdp2(zero2),
        "hsdp": train_fsdp2(zero3, replicate=2),
        "fsdp_bf16": train_fsdp2(bf16),
        "torch_ddp": train_ddp(job),
        "dtlab_zero3": dtlab_run(zero3),
        "dtlab_zero2": dtlab_run(zero2),
        "dtlab_bf16": dtlab_run(bf16),
        "dtlab_ddp": dtlab_run(job),
    }


@pytest.mark.cluster
def test_fsdp2_and_hsdp_match_dtlabs_zero(lab_cluster):
    runs = lab_cluster(4).run(_fsdp2_runs, JOB, timeout=240)
    r = runs[0]
    assert all(run["fsdp"]["losses"] == r["fsdp"]["losses"] for run in runs)
    ref = r["dtlab_zero3"]["losses"]
    for name in ("fsdp", "fsdp_no_reshard", "hsdp"):
        assert r[name]["losses"] == pytest.approx(ref, rel=2e-6), name
    assert r["torch_ddp"]["losses"] == pytest.approx(r["dtlab_ddp"]["losses"], rel=2e-6)
    bf16 = r["fsdp_bf16"]["losses"]
    assert bf16 == pytest.approx(r["dtlab_bf16"]["losses"], rel=2e-3)
    # DTensor parameters, sharded along dim 0; HSDP replicated over dp_replicate
    assert r["fsdp"]["param_type"] == "torch.distributed.tensor.DTensor"
    assert r["fsdp"]["placements"] == ["S(0)"]
    assert r["hsdp"]["mesh"] == {"shape": (2, 2), "names": ("dp_replicate", "dp_shard")}
    assert r["hsdp"]["placements"] == ["R", "S(0)"]
    # what a rank holds: Ψ/4 of the fp32 weights, Ψ/2 under HSDP (2 shards)
    assert r["fsdp"]["memory"]["params"] == r["dtlab_zero3"]["memory"]["params"]
    assert r["fsdp"]["memory"]["params"] == 4 * PSI // 4
    assert r["hsdp"]["memory"]["params"] == 4 * PSI // 2
    # the same bytes as dtlab's ZeRO: per step each unit is all-gathered for forward
    # and again for backward (reshard_after_forward, ZeRO-3's 3Ψ) or once (ZeRO-2),
    # and reduce-scattered once
    for fsdp, ours, gathers in [
        ("fsdp", "dtlab_zero3", 2),
        ("fsdp_no_reshard", "dtlab_zero2", 1),
        ("fsdp_bf16", "dtlab_bf16", 2),
    ]:
        theirs, mine = _payload(r[fsdp]["traffic"][1]), _payload(r[ours]["traffic"][1])
        for op in ("all_gather", "reduce_scatter"):
            assert theirs[op] == mine[op], (fsdp, op)
        width = 2 if fsdp == "fsdp_bf16" else 4  # bytes per value on the wire
        assert theirs["all_gather"] == gathers * width * PSI, fsdp
        assert theirs["reduce_scatter"] == width * PSI, fsdp
    # HSDP: gathers and scatters within a shard group of 2, then all-reduces its
    # gradient shard (Ψ/2) across the 2 replicas
    hsdp = _payload(r["hsdp"]["traffic"][1])
    assert hsdp["all_reduce"] == 4 * PSI // 2
    assert hsdp["all_gather"] == 2 * 4 * PSI
    print(
        "\nFSDP2 wire bytes per step and rank: "
        f"{r['fsdp']['traffic'][1]['all_gather']['wire_bytes']:.0f} gathered, "
        f"HSDP {r['hsdp']['traffic'][1]['all_gather']['wire_bytes']:.0f}"
    )


# ---- autocast + GradScaler (chapter 06) ----------------------------------------------
def test_autocast_keeps_the_loss_in_fp32_and_casts_the_matmuls():
    from dtlab.frameworks.autocast import autocast_policy, module_dtypes

    for precision in ("bf16", "fp16"):
        policy = autocast_policy(precision)
        print(f"\nCPU autocast, {precision}: {policy}")
        # fp16 runs on CPU too (torch 2.13): no probed operator failed
        assert not [op for op, what in policy.items() if what.startswith("error")]
        for op in ("linear", "matmul", "bmm", "scaled_dot_product_attention"):
            assert policy[op] == "lower", (precision, op)
        for op in ("cross_entropy", "nll_loss", "mse_loss"):
            assert policy[op] == "fp32", (precision, op)
        for op in ("layer_norm", "softmax", "gelu"):
            assert policy[op] == "follows input", (precision, op)
    config = JOB.replace(precision="fp16")
    theirs, ours = module_dtypes(config), module_dtypes(config, "dtlab")
    # autocast: linear layers in fp16, the embeddings, the residual stream and so
    # the LayerNorms stay fp32; dtlab casts the whole model; both compute the loss
    # in fp32
    assert theirs["head"] == theirs["blocks.0.mlp.fc"] == "float16"
    assert theirs["wte"] == theirs["blocks.0.ln_1"] == theirs["ln_f"] == "float32"
    assert {v for k, v in ours.items() if k != "loss"} == {"float16"}
    assert theirs["loss"] == ours["loss"] == "float32"


def test_autocast_bf16_tracks_dtlabs_bf16_policy():
    from dtlab.frameworks.autocast import train_autocast, train_dtlab

    config = JOB.replace(steps=10, precision="bf16")
    theirs, ours = train_autocast(config), train_dtlab(config)
    assert [r["loss"] for r in theirs] == pytest.approx(
        [r["loss"] for r in ours], rel=2e-3
    )
    for run in (theirs, ours):  # bf16: no scaling, nothing skipped
        assert {r["scale"] for r in run} == {1.0}
        assert not any(r["skipped"] for r in run)
    assert theirs[-1]["loss"] < theirs[0]["loss"]


# ---- accelerate (chapter 07) ---------------------------------------------------------
def _accelerate_run(config):
    from dtlab.frameworks.accelerate_run import train_accelerate

    return train_accelerate(config)


@needs_accelerate
@pytest.mark.cluster
def test_accelerate_prepare_is_torch_ddp_on_dtlabs_slices(lab_cluster, ddp2):
    runs = lab_cluster(2).run(_accelerate_run, JOB, timeout=120)
    for run in runs:
        assert run["prepared"] == [
            "torch.nn.parallel.distributed.DistributedDataParallel",
            "accelerate.optimizer.AcceleratedOptimizer",
            "accelerate.data_loader.DataLoaderShard",
        ]
        assert (run["distributed_type"], run["backend"]) == ("MULTI_CPU", "gloo")
        assert run["num_processes"] == 2
        assert run["local_batch"] == (JOB.global_batch_size // 2, CFG.seq_len)
        assert run["losses"] == ddp2["dtlab"]["losses"]  # bit for bit


@needs_accelerate
@pytest.mark.cluster
@pytest.mark.slow
def test_accelerate_launch_headless(ddp2):
    from dtlab.frameworks.accelerate_run import launch

    records = launch(JOB, 2, timeout=180)
    for rank, r in enumerate(records):
        assert r["losses"] == ddp2["dtlab"]["losses"]
        assert r["distributed_type"] == "MULTI_CPU"
        # accelerate launch --multi_gpu hands the processes to torchrun
        assert r["env"]["RANK"] == str(rank) and r["env"]["TORCHELASTIC_RUN_ID"]
    print(f"\naccelerate launch: {records[0]['wall_s']:.1f} s")


# ---- DeepSpeed (chapter 03) ----------------------------------------------------------
def _deepspeed_runs(job, names=("zero1", "zero2", "zero3", "offload")):
    from dtlab.frameworks.deepspeed_run import train_deepspeed
    from dtlab.frameworks.job import dtlab_run

    configs = {
        "zero1": job.replace(strategy="zero1"),
        "zero2": job.replace(strategy="zero2"),
        "zero3": job.replace(strategy="zero3"),
        "offload": job.replace(strategy="zero2", offload=True),
        "fp16": job.replace(strategy="zero2", precision="fp16", steps=4),
    }
    out = {}
    for name in names:
        config = configs[name]
        out[name] = {"deepspeed": train_deepspeed(config), "dtlab": dtlab_run(config)}
    out["linear_after"] = torch.nn.functional.linear.__module__
    return out


@needs_deepspeed
@pytest.mark.cluster
def test_deepspeed_zero_stages_match_dtlab(lab_cluster):
    runs = lab_cluster(2).run(_deepspeed_runs, JOB, timeout=300)
    r, n = runs[0], 2
    for name in ("zero1", "zero2", "zero3", "offload"):
        ds, ours = r[name]["deepspeed"], r[name]["dtlab"]
        assert all(run[name]["deepspeed"]["losses"] == ds["losses"] for run in runs)
        if name == "zero3":
            # ZeRO-3 trains with its own torch.nn.functional.linear (input @ W.t(),
            # then + bias; torch's fuses them): other roundings, a few ulp
            assert ds["losses"] == pytest.approx(ours["losses"], rel=1e-6), name
        else:
            assert ds["losses"] == ours["losses"], name  # fp32, 2 ranks: same bits
        assert ds["loss_scale"] == [1.0] * JOB.steps and not any(ds["skipped"])
    # ...and gives torch's back when it is done: dtlab's next run is not DeepSpeed's
    assert runs[0]["linear_after"] == "torch._C._nn"
    assert r["zero3"]["deepspeed"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    # memory: ZeRO-3 holds Ψ/N of the weights in both; DeepSpeed's optimizer keeps a
    # separate fp32 partition (its master copy, even of an fp32 model) besides
    # Adam's two moments: 12Ψ/N, where dtlab's fp32 shards are the masters (8Ψ/N)
    z3 = r["zero3"]["deepspeed"]["memory"]
    assert z3["params"] == r["zero3"]["dtlab"]["memory"]["params"] == 4 * PSI // n
    z2 = r["zero2"]["deepspeed"]["memory"]
    assert z2["optimizer"] - 4 == 12 * PSI // n  # + Adam's 4-byte step counter
    # dtlab: the moments of its shards, and one 4-byte step counter per local shard
    # (a piece of each parameter this rank's slice touches: at most all of them)
    counters = r["zero2"]["dtlab"]["memory"]["optimizer"] - 8 * PSI // n
    n_params = len(list(GPT(CFG).parameters()))
    assert counters % 4 == 0 and 0 < counters // 4 <= n_params
    # bytes: DeepSpeed 0.19.8's ZeRO-1/2 reduce the gradients with an all-reduce
    # of its buckets (each rank keeps its partition: use_multi_rank_bucket_allreduce)
    # and all-gather the updated weights: 3(N-1)/N·4Ψ on the wire, 1.5x dtlab's
    # reduce-scatter + all-gather. Its ZeRO-3 gathers each weight once per step (its
    # reuse distance keeps a small model's weights from forward to backward)
    for name in ("zero1", "zero2"):
        ds = _payload(r[name]["deepspeed"]["traffic"][1])
        mine = _payload(r[name]["dtlab"]["traffic"][1])
        assert ds["all_reduce"] - 4 == 4 * PSI  # and a 4-byte overflow flag
        assert ds["all_gather"] == mine["all_gather"] == 4 * PSI
        assert mine["reduce_scatter"] == 4 * PSI and "reduce_scatter" not in ds
    ds3 = _payload(r["zero3"]["deepspeed"]["traffic"][1])
    mine3 = _payload(r["zero3"]["dtlab"]["traffic"][1])
    assert ds3["reduce_scatter"] == mine3["reduce_scatter"] == 4 * PSI
    assert (ds3["all_gather"], mine3["all_gather"]) == (4 * PSI, 8 * PSI)


@needs_deepspeed
@pytest.mark.skipif(
    lacking("deepspeed_fp16") is not None, reason=str(lacking("deepspeed_fp16"))
)
@pytest.mark.cluster
def test_deepspeed_fp16_matches_dtlab(lab_cluster):
    # fp16 (ZeRO-2, the translated config): the same scale each step, no skip.
    # DeepSpeed trains fp16 on a CPU only where oneDNN has fp16 kernels
    # (AVX512-FP16 or AMX-FP16); elsewhere dtlab.capabilities says why it is skipped
    r = lab_cluster(2).run(_deepspeed_runs, JOB, ("fp16",), timeout=300)[0]
    ds, ours = r["fp16"]["deepspeed"], r["fp16"]["dtlab"]
    assert ds["loss_scale"] == [2.0**16] * 4 == ours["loss_scale"]
    assert ds["skipped"] == ours["skipped"] == [False] * 4
    assert ds["losses"] == pytest.approx(ours["losses"], rel=3e-4)


def _probe(feature, job):
    from dtlab.frameworks.deepspeed_run import probe

    return probe(feature, job.replace(strategy="zero3"))


def _cannot_run_on_cpu():
    if missing("deepspeed") is not None:
        return []
    from dtlab.frameworks.deepspeed_run import CANNOT_RUN_ON_CPU

    return sorted(CANNOT_RUN_ON_CPU)


@needs_deepspeed
@pytest.mark.cluster
@pytest.mark.parametrize("feature", _cannot_run_on_cpu())
def test_deepspeed_features_that_cannot_run_on_cpu(lab_cluster, feature):
    """Each is tried live; it must still fail (else CANNOT_RUN_ON_CPU is stale),
    and the test is skipped with DeepSpeed's answer as its reason."""
    import deepspeed

    answers = lab_cluster(2).run(_probe, feature, JOB, timeout=180)
    assert all(a != "ran" for a in answers), f"{feature} runs on CPU now"
    pytest.skip(
        f"{feature} cannot run on CPU (deepspeed {deepspeed.__version__}, torch "
        f"{torch.__version__}): {answers[0]}"
    )


@needs_deepspeed
def test_memory_estimates_beside_deepspeeds():
    """7B and 70B on one node of 8 GPUs, model states per GPU. DeepSpeed counts
    what dtlab counts (fp16 weights 2Ψ, fp32 gradient slice, master and moments:
    18Ψ/N with its 16-bit gradient partition) plus, under ZeRO-3, one gathered
    fp32 layer (4 x the largest layer); dtlab counts an fp32 gradient slice where
    the paper counts fp16 (dtlab = paper + 2Ψ/N)."""
    from dtlab.frameworks.deepspeed_run import estimates

    for name in ("7B", "70B"):
        e = estimates(name, gpus_per_node=8)
        psi, n, largest = e["params"], e["gpus"], e["largest_layer"]
        assert psi == estimate.MODELS[name].n_params
        assert (
            largest == estimate.MODELS[name].vocab_size * estimate.MODELS[name].d_model
        )
        rows = {(row["stage"], row["offload"]): row for row in e["rows"]}
        z2, z3 = rows[2, False], rows[3, False]
        assert z2["deepspeed_gpu"] == z2["dtlab_gpu"] + 2 * psi // n
        assert z3["deepspeed_gpu"] == z3["dtlab_gpu"] + 4 * largest
        for row in (z2, z3):
            assert row["dtlab_gpu"] == row["paper_gpu"] + 2 * psi / n
        # offload: the device keeps the 16-bit weights (all of them under ZeRO-2)
        assert rows[2, True]["deepspeed_gpu"] == rows[2, True]["dtlab_gpu"] == 2 * psi
        assert (
            rows[3, True]["deepspeed_gpu"] == rows[3, True]["dtlab_gpu"] + 4 * largest
        )
        # the host: DeepSpeed adds 50 % (additional_buffer_factor) to the 16Ψ
        assert rows[3, True]["deepspeed_host_per_node"] == int(
            1.5 * rows[3, True]["dtlab_host_per_node"]
        )
        assert f"{int(psi / 1e6)}M total params" in e["printout"]
        gb = {k: round(v["deepspeed_gpu"] / 1e9, 1) for k, v in rows.items()}
        print(f"\n{name} on {n} GPUs, DeepSpeed's GB per GPU: {gb}")


# ---- the translation table (chapter 07) ----------------------------------------------
TABLE = [
    JOB,
    JOB.replace(strategy="zero1", precision="fp16", grad_clip=1.0),
    JOB.replace(strategy="zero2", offload=True),
    JOB.replace(strategy="zero3", precision="bf16", grad_accum_steps=2),
]


def _table(configs):
    from dtlab.frameworks.translate import to_markdown, translation_table

    rows = translation_table(configs, 2)
    return rows, to_markdown(rows)


@needs_deepspeed
@needs_accelerate
@pytest.mark.cluster
def test_translation_table_loads_in_every_library(lab_cluster):
    rows, markdown = lab_cluster(2).run(_table, TABLE, timeout=120)[0]
    print("\n" + markdown)
    assert len(markdown.splitlines()) == 2 + len(TABLE)
    for config, row in zip(TABLE, rows):
        ds = row["deepspeed_parsed"]  # what DeepSpeed's own parser understood
        micro = config.global_batch_size // (2 * config.grad_accum_steps)
        assert (ds["world_size"], ds["train_batch_size"]) == (2, 8)
        assert (ds["micro_batch"], ds["grad_accum"]) == (micro, config.grad_accum_steps)
        assert ds["zero_stage"] == (zero_stage(config.strategy) or 0)
        assert (ds["bf16"], ds["fp16"]) == (
            config.precision == "bf16",
            config.precision == "fp16",
        )
        assert ds["gradient_clipping"] == (config.grad_clip or 0.0)
        assert ds["offload"] == ("cpu" if config.offload else "none")
        acc = row["accelerate_loaded"]  # accelerate's ClusterConfig and plugin
        kind = "MULTI_CPU" if config.strategy == "ddp" else "DEEPSPEED"
        assert (acc["distributed_type"], acc["num_processes"]) == (kind, 2)
        assert acc["mixed_precision"] == {"fp32": "no"}.get(
            config.precision, config.precision
        )
        if config.strategy in ("zero2", "zero3"):
            assert row["fsdp2"]["reshard_after_forward"] == (config.strategy == "zero3")
        else:  # no fully_shard form: the row says what to use instead
            assert "use torch's" in row["fsdp2"]


def test_translations_refuse_what_they_cannot_say():
    from dtlab.frameworks.translate import (
        check_fsdp2,
        deepspeed_config,
        fsdp2_arguments,
    )
    from dtlab.topology import Layout

    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer"):
        fsdp2_arguments(JOB.replace(strategy="zero1"), 2)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        fsdp2_arguments(JOB, 2)
    with pytest.raises(ValueError, match="tensor or pipeline"):
        deepspeed_config(JOB.replace(layout=Layout(dp=1, tp=2)), 2)
    with pytest.raises(ValueError, match="does not divide"):
        fsdp2_arguments(JOB.replace(strategy="zero3"), 4, replicate=3)
    built = check_fsdp2(fsdp2_arguments(JOB.replace(strategy="zero3"), 4, replicate=2))
    assert built["mesh_shape"] == (2, 2) and built["reshard_after_forward"]
    # DeepSpeed's defaults that differ from dtlab's are said explicitly
    ds = deepspeed_config(JOB.replace(precision="fp16"), 2)
    assert ds["gradient_clipping"] == 0.0  # DeepSpeed's default is 1.0
    assert ds["fp16"]["hysteresis"] == 1 and ds["fp16"]["initial_scale_power"] == 16
    assert ds["optimizer"]["params"]["torch_adam"] is True

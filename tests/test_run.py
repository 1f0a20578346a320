"""``dtlab run``: one config, the same losses under torchrun, on spawned processes,
in the lab and in the single-process reference; telemetry files that parse and
whose traffic is what dtlab.estimate predicts; bad configs stopped before anything
starts."""

import json
import os
import re
import subprocess
import sys

import psutil
import pytest

from dtlab import estimate, telemetry
from dtlab.reference import train_reference
from dtlab.run import (
    apply_overrides,
    config_from_dict,
    launch,
    load_config,
    main,
    measured_memory,
    measured_traffic,
)
from dtlab.topology import Layout
from dtlab.train import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {
    "model": {"vocab_size": 64, "seq_len": 16, "n_layers": 2, "n_heads": 2,
              "d_model": 32},
    "strategy": "ddp",
    "steps": 3,
    "global_batch_size": 8,
    "bucket_cap_mb": 0.01,
}  # fmt: skip


def _write(tmp_path, d, name="cfg.json"):
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


# ---- configs ------------------------------------------------------------------------
def test_config_files_round_trip_and_take_overrides(tmp_path):
    cfg = load_config(_write(tmp_path, CONFIG))
    assert cfg == config_from_dict(cfg.to_dict())
    assert cfg.model.d_model == 32 and cfg.layout is None
    over = load_config(
        _write(tmp_path, CONFIG),
        ["strategy=zero3", "model.n_layers=4", "layout.dp=2", "grad_clip=0.5",
         "betas=[0.8, 0.9]"],
    )  # fmt: skip
    assert over.strategy == "zero3" and over.model.n_layers == 4
    assert over.layout == Layout(dp=2) and over.grad_clip == 0.5
    assert over.betas == (0.8, 0.9) and over.model.d_model == 32
    toml = tmp_path / "cfg.toml"
    toml.write_text('strategy = "zero1"\nsteps = 2\n[model]\nn_layers = 4\n')
    cfg = load_config(toml)
    assert cfg.strategy == "zero1" and cfg.steps == 2 and cfg.model.n_layers == 4
    # --set does not change the caller's dict
    assert apply_overrides(CONFIG, ["steps=9"])["steps"] == 9 and CONFIG["steps"] == 3


@pytest.mark.parametrize(
    "d, overrides, match",
    [
        ({**CONFIG, "stepz": 3}, [], r"unknown key 'stepz' \(did you mean 'steps'"),
        ({"model": {"n_layer": 2}}, [], "unknown model key 'n_layer'.*n_layers"),
        ({"layout": {"sp": 2}}, [], "valid layout keys: dp, tp, pp, cp, ep"),
        ({"layout": [2, 1, 1]}, [], "layout must be a table"),
        (CONFIG, ["steps"], "KEY=VALUE"),
        (CONFIG, ["optim.lr=1"], "only model, layout have nested keys"),
        (CONFIG, ["lr=-1"], "lr must be positive"),
    ],
)
def test_bad_configs_are_named(tmp_path, d, overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(_write(tmp_path, d), overrides)


def test_unknown_keys_list_every_valid_one(tmp_path, capsys):
    assert main([str(_write(tmp_path, {"colour": 1})), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    # every TrainConfig field, including ones added after dtlab.run was written
    for field in ("strategy", "precision", "schedule", "microbatches", "offload"):
        assert field in err


def test_a_config_the_world_cannot_run_fails_before_any_process(tmp_path, capsys):
    bad = _write(tmp_path, {**CONFIG, "layout": {"dp": 4}})
    before = psutil.Process().children(recursive=True)
    assert main([str(bad), "--nproc", "2", "--out", str(tmp_path / "o")]) == 2
    assert "world has 2" in capsys.readouterr().err
    assert psutil.Process().children(recursive=True) == before
    assert not (tmp_path / "o").exists()
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_traffic_is_the_busiest_ranks_steady_state():
    """ZeRO-1 gathers a step's updated shards at the start of the next step, so step
    0 sends less: the per-step figure leaves it out. Pipeline ranks send different
    amounts: the figure is the busiest rank's, as the estimate's is."""

    def comm(rank, step, axis, wire):
        return {"kind": "comm", "rank": rank, "step": step, "axis": axis,
                "wire_bytes": wire}  # fmt: skip

    events = [{"kind": "step", "rank": r, "step": s} for r in (0, 1) for s in (0, 1, 2)]
    events += [comm(r, s, "dp", 100.0) for r in (0, 1) for s in (0, 1, 2)]  # RS
    events += [comm(r, s, "dp", 100.0) for r in (0, 1) for s in (1, 2)]  # lazy AG
    events += [comm(0, s, "pp", 30.0) for s in (0, 1, 2)]  # rank 1 sends less
    events += [comm(1, s, "pp", 10.0) for s in (0, 1, 2)]
    events += [comm(r, -1, "dp", 1e6) for r in (0, 1)]  # set-up broadcast
    assert measured_traffic(events) == {"dp": 200.0, "pp": 30.0}
    assert measured_traffic(events, {0}) == {"dp": 100.0, "pp": 30.0}
    mem = [{"kind": "memory", "rank": 0, "activations": 5, "params": 7},
           {"kind": "memory", "rank": 1, "activations": 9}]  # fmt: skip
    assert measured_memory(mem) == {"params": 7, "grads": 0, "optimizer": 0,
                                    "activations": 9, "buffers": 0}  # fmt: skip


# ---- the same numbers under every launcher -------------------------------------------
def _torchrun(cfg_path, out, *extra, timeout=240):
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "--max-restarts", "0", "-m", "dtlab.cli",
           "run", str(cfg_path), "--out", str(out), *extra]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    # nothing of the run outlives it: no process is left in its session
    left = [p for p in psutil.process_iter() if _session(p) == proc.pid]
    assert not left, left
    return proc.returncode, stdout, stderr


def _session(p):
    try:
        return os.getsid(p.pid)
    except (ProcessLookupError, PermissionError):
        return None


def _lab_run(d):
    from dtlab.train import TrainConfig, Trainer

    records = Trainer(TrainConfig.from_dict(d)).fit()
    return [r["loss"] for r in records]


@pytest.mark.cluster
@pytest.mark.slow
def test_torchrun_spawn_lab_and_reference_agree(tmp_path, lab_cluster):
    cfg_path = _write(tmp_path, CONFIG)
    out = tmp_path / "torchrun"
    rc, stdout, stderr = _torchrun(cfg_path, out)
    assert rc == 0, stderr[-3000:]
    # one line per step from rank 0 only, then the summary
    lines = stdout.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("step ")] == [
        "1/3", "2/3", "3/3"
    ]  # fmt: skip
    assert "done: 3 steps on 2 ranks" in stdout

    events = {r: telemetry.read_jsonl(out / f"rank{r}.jsonl") for r in (0, 1)}
    steps = {r: [e for e in ev if e["kind"] == "step"] for r, ev in events.items()}
    torchrun_losses = [e["loss"] for e in steps[0]]
    assert [e["loss"] for e in steps[1]] == torchrun_losses  # the global-batch mean
    assert [e["step"] for e in steps[0]] == [0, 1, 2]

    # the same config on spawned processes and on the lab's engines: the same
    # operations in the same order on the same data, so the same bits
    spawned = launch(TrainConfig.from_dict(CONFIG), 2, tmp_path / "spawn", echo=False)
    lab = lab_cluster(2).run(_lab_run, CONFIG, timeout=120)
    assert spawned["losses"] == torchrun_losses
    assert lab[0] == lab[1] == torchrun_losses
    # against one process on the whole batch: the two ranks' means averaged vs one
    # mean over the batch, and bucketed all-reduced gradients vs one backward, round
    # differently in float32, so equal to float32 rounding, not bit for bit
    ref = train_reference(
        config_from_dict(CONFIG).model, steps=3, global_batch_size=8
    ).losses
    assert torchrun_losses == pytest.approx(ref, rel=1e-5)

    # DDP's traffic: one ring all-reduce of the Ψ fp32 gradients per step,
    # 2(N-1)/N · 4Ψ bytes sent by each rank (in several buckets)
    psi = config_from_dict(CONFIG).model.n_params()
    predicted = estimate.ddp_bytes_per_step(psi, 2)
    for ev in events.values():
        grads = [e for e in ev if e["kind"] == "comm" and e["tag"] == "ddp"]
        assert len({e["step"] for e in grads}) == 3 and len(grads) > 3  # buckets
        for step in range(3):
            sent = sum(e["wire_bytes"] for e in grads if e["step"] == step)
            assert sent == pytest.approx(predicted)
            assert all(e["axis"] == "dp" for e in grads)
        assert {"span", "memory"} <= {e["kind"] for e in ev}
    summary = json.loads((out / "summary.json").read_text())
    # everything else on dp is the loss average: 8 bytes a step
    assert summary["wire_bytes_per_step"]["dp"] == pytest.approx(predicted + 8)
    assert summary["wire_bytes_per_step_estimate"]["dp"] == pytest.approx(predicted)

    trace = json.loads((out / "trace.json").read_text())
    ranks = {e["pid"] for e in trace["traceEvents"]}
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1} and {"all_reduce", "F", "opt"} <= names
    assert any(e["ph"] == "C" for e in trace["traceEvents"])  # memory counters
    assert (
        json.loads((out / "config.json").read_text())
        == TrainConfig.from_dict(CONFIG).to_dict()
    )


@pytest.mark.slow
def test_torchrun_with_a_bad_config_exits_cleanly(tmp_path):
    bad = _write(tmp_path, {**CONFIG, "layout": {"dp": 2, "tp": 4}})
    rc, _, stderr = _torchrun(bad, tmp_path / "o", timeout=120)
    assert rc != 0
    # each rank says why (torchrun may stop one before it prints, so any rank will do)
    assert re.search(r"dtlab run \(rank [01]\): layout dp=2 x tp=4", stderr), stderr
    assert not (tmp_path / "o").exists()

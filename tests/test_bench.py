"""``dtlab bench``: the one table assembled from every part's results (checked on
synthetic results, no timing asserted), its JSON and picture, and one real quick
run of the cheapest part."""

import json

import pytest

from dtlab import bench
from dtlab.cli import main as cli_main

# what each part returns, in the shapes of dtlab.bench.{ddp, zero, tensor_parallel,
# pipeline, composed, telemetry}.run, with round numbers
SYNTHETIC = {
    "quick": True,
    "seconds": {"ddp": 1.0},
    "results": {
        "ddp": [
            {"world_size": 2, "dtlab_step_s": 0.030, "torch_step_s": 0.020,
             "overlap": 0.5, "exposed_s": 0.001, "buckets": 3, "params": 1000},
        ],
        "zero": [
            {"variant": "torch ZeRO-1", "world_size": 2, "step_s": 0.010,
             "peak_bytes": None},
            {"variant": "torch FSDP2", "world_size": 2, "step_s": 0.040,
             "peak_bytes": None},
            {"variant": "dtlab stage 1", "world_size": 2, "step_s": 0.015,
             "peak_bytes": 10},
            {"variant": "dtlab stage 3", "world_size": 2, "step_s": 0.020,
             "peak_bytes": 5},
        ],
        "tp": {"world_size": 2,
               "mlp": {"dtlab_s": 0.002, "dtensor_s": 0.004, "max_abs_diff": 0.0},
               "attention": {"dtlab_s": 0.003, "dtensor_s": 0.003,
                             "max_abs_diff": 1e-7}},
        "pp": {"p": 4, "steps": 5, "model": {},
               "step_s": {"dtlab 1f1b": 0.05, "torch 1f1b": 0.1},
               "bubble": {4: {"measured": 0.45, "formula": 3 / 7},
                          8: {"measured": 0.3, "formula": 3 / 11}},
               "bubble_small": {"p": 2, "bubble": {
                   4: {"measured": 0.21, "formula": 0.2}}}},
        "2d": {"world_size": 4, "steps": 8, "model": {},
               "step_s": {"dtlab": 0.06, "torch": 0.04}, "max_rel_loss_diff": 1e-7},
        "telemetry": {
            "world_size": 2, "steps": 3,
            "configs": {
                "ddp": {"layout": {"dp": 2, "tp": 1, "pp": 1}, "strategy": "ddp",
                        "bytes_measured": {"dp": 2e6},
                        "bytes_predicted": {"dp": 2e6, "tp": 0.0, "pp": 0.0},
                        "memory_measured": {"params": 1e6, "grads": 1e6,
                                            "optimizer": 2e6, "activations": 0},
                        "memory_predicted": {"params": 1e6, "grads": 1e6,
                                             "optimizer": 2e6, "activations": 0}},
                "ddp pp=2": {"error": "ValueError: not this time"},
            },
            "overhead": {"on_s": 0.011, "off_s": 0.010, "events_per_step": 9},
        },
    },
}  # fmt: skip


def _by_what(rows):
    return {(r["what"], r["n"]): r for r in rows}


def test_every_comparison_becomes_a_row_with_its_ratio():
    rows = _by_what(bench.assemble(SYNTHETIC))
    # against PyTorch: dtlab / torch, times in ms
    assert rows["DDP step", 2]["ratio"] == pytest.approx(1.5)
    assert rows["DDP step", 2]["dtlab"] == pytest.approx(30.0)
    assert rows["ZeRO-1 step", 2]["ratio"] == pytest.approx(1.5)
    assert rows["ZeRO-1 step", 2]["against"] == "ZeroRedundancyOptimizer"
    assert rows["ZeRO-3 step", 2]["ratio"] == pytest.approx(0.5)
    assert rows["ZeRO-3 step", 2]["against"] == "FSDP2 fully_shard"
    assert rows["TP mlp fwd+bwd", 2]["ratio"] == pytest.approx(0.5)
    assert rows["TP attention fwd+bwd", 2]["ratio"] == pytest.approx(1.0)
    assert rows["PP 1F1B step", 4]["ratio"] == pytest.approx(0.5)
    assert rows["dp2·tp2 ZeRO-3 step", 4]["ratio"] == pytest.approx(1.5)
    assert rows["dp2·tp2 ZeRO-3 step", 4]["against"] == "FSDP2 + DTensor TP"
    # against prediction: measured / predicted
    assert rows["1F1B bubble p=4 m=4", 4]["ratio"] == pytest.approx(0.45 / (3 / 7))
    assert rows["1F1B bubble p=4 m=8", 4]["reference"] == pytest.approx(3 / 11)
    assert rows["1F1B bubble p=2 m=4", 2]["ratio"] == pytest.approx(0.21 / 0.2)
    assert rows["ddp: sent on dp/step", 2]["ratio"] == pytest.approx(1.0)
    assert rows["ddp: sent on dp/step", 2]["dtlab"] == pytest.approx(2.0)  # MB
    assert ("ddp: sent on tp/step", 2) not in rows  # nothing sent, none predicted
    assert rows["ddp: optimizer", 2]["ratio"] == pytest.approx(1.0)
    assert ("ddp: activations", 2) not in rows
    assert rows["DDP step, telemetry on vs off", 2]["ratio"] == pytest.approx(1.1)
    # a config that could not run is a row that says why, not a silent gap
    assert rows["ddp pp=2", 2]["note"].startswith("ValueError: not this time")
    assert rows["ddp pp=2", 2]["ratio"] is None
    sections = {r["section"] for r in rows.values()}
    assert sections == {"speed", "bubble", "bytes", "memory", "overhead"}


def test_a_failed_part_is_a_row_and_the_rest_still_shows():
    results = {**SYNTHETIC["results"], "zero": {"error": "RankError: rank 1: boom"}}
    broken = {**SYNTHETIC, "results": results}
    rows = bench.assemble(broken)
    failed = [r for r in rows if r["what"] == "(failed)"]
    assert [r["note"] for r in failed] == ["RankError: rank 1: boom"]
    assert any(r["what"] == "DDP step" for r in rows)


def test_the_table_prints_every_row_and_ratio():
    rows = bench.assemble(SYNTHETIC)
    text = bench.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["section", "comparison", "N"]
    assert len(lines) == len(rows) + 2  # header, rule, one line per row
    assert "1.500" in lines[2] and "torch DDP" in lines[2]
    for r in rows:
        assert r["what"] in text


def test_json_report_round_trips(tmp_path):
    rep = bench.report(SYNTHETIC)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(rep))
    back = json.loads(path.read_text())
    assert back["rows"] == json.loads(json.dumps(bench.assemble(SYNTHETIC)))
    assert back["results"]["pp"]["bubble"]["4"]["measured"] == 0.45
    assert {"torch", "cpus"} <= set(back["machine"])


def test_bench_figure_draws_every_ratio_and_row():
    pytest.importorskip("plotly")
    from dtlab.lab.figures.bench import bench_figure

    rows = bench.assemble(SYNTHETIC)
    fig = bench_figure(rows)
    bars = [t for t in fig.data if t.type == "bar"]
    table = next(t for t in fig.data if t.type == "table")
    drawn = sorted(x for t in bars for x in t.x)
    assert drawn == sorted(r["ratio"] for r in rows if r["ratio"] is not None)
    assert len(table.cells.values[0]) == len(rows)


def test_bad_arguments_are_named(capsys):
    assert cli_main(["bench", "--only", "ddp,fsdp"]) == 2
    assert "unknown part(s) ['fsdp']" in capsys.readouterr().err
    assert cli_main(["bench", "--plot", "table.svg"]) == 2
    assert ".png" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_ddp_part_runs_for_real(tmp_path, capsys):
    """The cheapest comparison, for real: two processes, dtlab's DDP and PyTorch's
    interleaved (no timing asserted; the JSON must hold what the table shows)."""
    out = tmp_path / "b.json"
    assert cli_main(["bench", "--quick", "--only", "ddp", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    (row,) = rep["rows"]
    raw = rep["results"]["ddp"][0]
    assert row["what"] == "DDP step" and row["n"] == 2 and "DDP step" in printed
    assert row["ratio"] == pytest.approx(raw["dtlab_step_s"] / raw["torch_step_s"])
    assert raw["buckets"] >= 1 and raw["params"] > 0

"""dtlab.dryrun: the real composition and step on a fake process group.

- A small layout (tp2·pp2·dp2 of a tiny GPT, world 8): every rank's bytes held by
  category and bytes sent per axis, op and tag are what a real gloo run of the same
  config records on that rank, exactly; under bf16 the activations differ by the
  one stated reason (the meta device's fp32 LayerNorm statistics), to the byte.
- Llama 3 405B's published 8K layout (tp8·cp1·pp16·dp64, 8192 ranks; a GPT
  stand-in of the same width, heads, vocabulary and context): the numbers stand
  beside layout_memory / layout_traffic, each difference zero or with its reason.
- The 128K layout (cp16 composed with tp8 and pp16, 16,384 ranks) with full
  recomputation, as Meta ran it: the ring's bytes (its forward twice) and the held
  bytes equal the estimate, and rank 0 fits in 80 GB; what dtlab does not compose
  is refused with TrainConfig.check's own error; bad worlds and ranks are refused
  by name; ``dtlab plan --dry-run`` prints the table.
"""

import json

import pytest
import torch

from dtlab.cli import main as cli_main
from dtlab.cli import parse_layout
from dtlab.dryrun import dry_run, llama3_405b, representative_ranks, stand_in
from dtlab.dryrun.child import measure_step, meta_world
from dtlab.dryrun.compare import LN_STATS, SCALARS, STEP_COUNTER, layernorm_stats_extra
from dtlab.model import GPTConfig
from dtlab.topology import Layout
from dtlab.train import TrainConfig

TINY = GPTConfig(n_layers=4, d_model=32, n_heads=4, vocab_size=64, seq_len=16)
LAYOUT = Layout(dp=2, tp=2, pp=2)


def _config(**changes):
    return TrainConfig(
        model=TINY, layout=LAYOUT, steps=1, global_batch_size=8, **changes
    )


def _real_runs(configs):
    """On every rank of a real gloo world: measure_step of each config, and of the
    first a second step without the flush (the steady state the flush stands for)."""
    return [measure_step(c) for c in configs] + [
        measure_step(configs[0], steps=2, flush=False)
    ]


def _without_times(measurement):
    return {"memory": measurement["memory"], "traffic": measurement["traffic"]}


def test_a_small_layout_dry_runs_to_the_bytes_a_real_gloo_run_records():
    from dtlab.launch import spawn

    zero1 = _config(strategy="zero1")  # its lazy gather flushed into the step
    bf16 = _config(strategy="ddp", precision="bf16")
    real = spawn(_real_runs, 8, [zero1, bf16], timeout=120)
    dry = dry_run(zero1, 8, rank=list(range(8)))
    assert dry.rank_ids == list(range(8))
    for r in range(8):
        got = dry.rank(r).measurement
        assert got["coords"] == real[r][0]["coords"]
        assert _without_times(got) == _without_times(real[r][0]), f"rank {r}"
        assert got["steps"] == 1
        # one step and the flushed gather = a second step's steady state, to the byte
        assert _without_times(real[r][0]) == _without_times(real[r][2]), f"rank {r}"
    # 16-bit: everything equal but the LayerNorm statistics, by their stated count
    dry16 = dry_run(bf16, 8, rank=[0, 6])  # first and last stage
    for r in (0, 6):
        got, want = dry16.rank(r).measurement, real[r][1]
        assert got["traffic"] == want["traffic"]
        for category, value in want["memory"].items():
            extra = 0
            if category in ("activations", "peak"):
                extra = layernorm_stats_extra(bf16, LAYOUT, got["coords"]["pp"])
                assert extra > 0
            assert got["memory"][category] == value + extra, (r, category)
        row = {x["category"]: x for x in dry16.rank(r).memory}["activations"]
        assert row["difference"] == 0 or LN_STATS in row["reason"]


@pytest.mark.slow  # one rank of 8192 (a 128-layer, h=16384 GPT on the meta device)
def test_llama3_405b_8k_layout_stands_beside_the_estimate():
    config, world, published = llama3_405b("8k", 8192)
    assert world == 8192 and str(config.layout) == "dp64·tp8·pp16"
    report = dry_run(config, world, rank=0, published=published)
    assert report.unexplained() == []
    (r,) = report.ranks
    assert r.role == "first" and r.coords == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    memory = {row["category"]: row for row in r.memory}
    for c in ("params", "grads"):  # dtlab's ZeRO-2 states, exactly as counted
        assert memory[c]["measured"] == memory[c]["estimate"] > 0
    assert STEP_COUNTER in memory["optimizer"]["reason"]
    assert LN_STATS in memory["activations"]["reason"]
    assert memory["activations"]["measured"] > 4e11  # 16 microbatches in flight
    traffic = {row["category"]: row for row in r.traffic}
    for axis in ("dp", "tp", "pp"):
        row = traffic[axis]
        assert row["measured"] > 1e9
        assert row["difference"] == 0 or SCALARS in row["reason"]
    assert set(traffic["dp"]["ops"]) >= {"reduce_scatter", "all_gather"}
    # the loss, norm and overflow scalars: a few bytes, each axis's difference
    assert SCALARS in traffic["dp"]["reason"] and traffic["dp"]["difference"] < 64
    # beside the published architecture's estimate, with what the stand-in changes
    assert memory["params"]["published"] > 0
    assert "GQA" in memory["params"]["published_reason"]
    assert "405B" in report.table() and "why:" in report.table()


@pytest.mark.slow  # one rank of 16,384: cp16 composed with tp8 and pp16
def test_llama3_405b_128k_layout_dry_runs_and_fits_with_full_recomputation():
    config, world, _ = llama3_405b("128k", 16384, checkpointing="full")
    assert str(config.layout) == "dp8·tp8·pp16·cp16" and world == 16384
    report = dry_run(config, world, rank=0)
    assert report.unexplained() == []
    (r,) = report.ranks
    assert r.coords == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    traffic = {row["category"]: row for row in r.traffic}
    # the ring's K/V of this rank's 16 heads and 8,192 tokens, every layer, and
    # its forward once more in the recomputation: exactly the estimate
    assert traffic["cp"]["measured"] == traffic["cp"]["estimate"] > 1e11
    assert traffic["cp"]["ops"]["send"] == traffic["cp"]["measured"]  # p2p, a ring
    for axis in ("dp", "tp", "pp"):
        row = traffic[axis]
        assert row["difference"] == 0 or SCALARS in row["reason"]
    memory = {row["category"]: row for row in r.memory}
    for c in ("params", "grads", "activations"):
        assert memory[c]["measured"] == memory[c]["estimate"] > 0, c
    # as Meta ran it, on 80 GB H100s: 16 microbatches' block inputs in flight
    held = sum(memory[c]["measured"] for c in ("params", "grads", "optimizer"))
    assert held + memory["activations"]["measured"] < 80e9


@pytest.mark.parametrize("sp", [False, True])
def test_full_recomputation_sends_the_forwards_collectives_again(sp):
    """The recomputed forward's tp collectives, but the block's last (the MLP's g:
    torch's checkpoint stops once backward's tensors are rebuilt), counted by the
    estimate to the byte; under sequence parallelism the replicated weights'
    gradients are summed over tp once per microbatch (the hook)."""
    plain = _config(sequence_parallel=sp)
    full = _config(sequence_parallel=sp, activation_checkpointing="full")
    sent = {}
    for name, config in (("plain", plain), ("full", full)):
        report = dry_run(config, 8, rank=0)
        assert report.unexplained() == [], name
        sent[name] = {row["category"]: row for row in report.ranks[0].traffic}["tp"]
    m = plain.resolve_microbatches(LAYOUT)  # microbatches a step
    S = (8 // 2 // m) * 16 * 32 * 4  # one microbatch's activations: b·s·h, fp32
    layers = 2  # rank 0's stage
    # over tp = 2 an all-reduce sends S, an all-gather or a reduce-scatter S/2
    again = 2 * S / 2 + S / 2 if sp else S  # 2 all-gathers + 1 reduce-scatter, or 1
    microbatches = m
    assert sent["full"]["estimate"] - sent["plain"]["estimate"] == pytest.approx(
        layers * microbatches * again
    )
    assert sent["full"]["measured"] - sent["plain"]["measured"] == pytest.approx(
        layers * microbatches * again
    )


def test_bad_worlds_and_ranks_are_named():
    config = _config()
    with pytest.raises(ValueError, match="not a multiple of the layout's tp x cp x pp"):
        dry_run(config, 10)
    with pytest.raises(ValueError, match="the world has 16"):  # TrainConfig.check
        dry_run(config, 16)
    with pytest.raises(ValueError, match="rank 8 is outside the world of 8 ranks"):
        dry_run(config, 8, rank=8)
    with pytest.raises(ValueError, match="rank must be an int"):
        dry_run(config, 8, rank="0")
    with pytest.raises(ValueError, match="world_size"):
        dry_run(config, 0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        dry_run(config, 8, timeout=0)
    with pytest.raises(ValueError, match="jobs"):
        dry_run(config, 8, jobs=0)
    with pytest.raises(ValueError, match="config must be a TrainConfig"):
        dry_run({"model": {}}, 8)


def test_representative_ranks_and_stand_in():
    assert representative_ranks(Layout(dp=64, tp=8, pp=16)) == [0, 512, 7680]
    assert representative_ranks(Layout(dp=4)) == [0]
    s = stand_in("405B", pp=16)
    assert (s.model.n_layers, s.model.d_model, s.model.n_heads) == (128, 16384, 128)
    assert s.model.vocab_size == 128256 and not s.model.tied_head
    assert s.model.d_ff == 3 * 53248 // 2  # SwiGLU's parameters in two matrices
    assert "126" in s.reason and "GQA" in s.reason
    with pytest.raises(ValueError, match="no published Llama 3 405B layout"):
        llama3_405b("8k", 1024)


def test_meta_world_is_undone_after_its_block():
    item, ptr = torch.Tensor.item, torch.UntypedStorage.data_ptr
    with meta_world():
        t = torch.ones(3, device="meta")
        assert float(t.sum()) == 0.0
        a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert torch.Tensor.item is item and torch.UntypedStorage.data_ptr is ptr
    with pytest.raises(RuntimeError):
        float(torch.ones(1, device="meta"))


def test_the_cli_prints_the_dry_run_table(tmp_path, capsys):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(_config(strategy="ddp").to_dict()))
    out_json = tmp_path / "report.json"
    code = cli_main(["plan", "--dry-run", "--config", str(path), "--rank", "7",
                     "--json", str(out_json)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0
    assert "rank 7 (pp1 dp1 cp0 tp1; last stage" in text
    assert "held params" in text and "sent tp" in text
    assert json.loads(out_json.read_text())["ranks"][0]["rank"] == 7
    # a layout dtlab does not compose: refused, with the check's words, exit code 2
    code = cli_main(["plan", "--dry-run", "--context", "128k", "--schedule", "zb_h1"])
    assert code == 2
    assert "does not compose with ZeRO" in capsys.readouterr().err
    assert parse_layout("tp8·cp1·pp16·dp64") == {"tp": 8, "cp": 1, "pp": 16, "dp": 64}
    with pytest.raises(ValueError, match="--layout"):
        parse_layout("tp8,xx2")

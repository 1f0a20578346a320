"""HSDP (dtlab.zero.hsdp): ZeRO within a shard group, replicas across groups, on a
2 × 2 grid of 4 ranks (shard groups [0, 1], [2, 3]; replicate groups [0, 2], [1, 3]).

What is checked, and why each comparison may be exact:

- against one process, on the same global batch of 8 sequences (rank r takes the
  r-th quarter). The grid sums each gradient element as (g0 + g1) + (g2 + g3): the
  shard group's reduce-scatter adds two terms (one order), the replicas' all-reduce
  adds two (one order), and dividing by 4 is exact. A one-process reference doing
  the same additions (``_same_order``) therefore matches bit for bit, at every stage,
  for AdamW on the GPT and for AdamW and SGD on a model with frozen and unused
  parameters. The plain reference (``dtlab.reference.train_reference``) backpropagates
  the whole batch at once, another order of float sums: ~1e-7 relative on the
  gradients, which Adam passes on at about their size; after 3 steps of lr 1e-2 the
  weights differ by at most 8.9e-6 and the losses by 7e-8 relative (measured, every
  stage alike), so 1e-4 (1 % of one step) still catches a missing average or a
  replica that skipped its all-reduce (that would be off by ~lr).
- against PyTorch's FSDP2 HSDP, ``fully_shard(mesh=2D DeviceMesh(replicate, shard))``:
  FSDP2 reduce-scatters in the shard dim and all-reduces in the replicate dim, the
  same two-term sums, and divides by powers of two, so the losses and weights are
  equal bit for bit (its per-parameter dim-0 chunks cut elsewhere than dtlab's flat
  units, which does not matter when every sum has two terms).
- the bytes each rank sends per step on each axis equal
  :func:`dtlab.estimate.hsdp_comm_per_step` exactly (Ψ as padded to the shard size),
  and the bytes it holds equal :func:`dtlab.estimate.hsdp_states_per_rank`: the
  shard group's divisor, not the world's.
"""

import pytest
import torch

from dtlab import bench, estimate
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.reference import train_reference
from dtlab.topology import Layout
from tests.models import FROZEN, branchy_model

pytestmark = pytest.mark.cluster

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, d_model=16)
GLOBAL_BATCH = 8
LR = 1e-2
STEPS = 3
ADAMW = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # the reference's
N, SHARD = 4, 2  # 2 replicas of 2 shards
ADAM_STEP_BYTES = 4  # AdamW's fp32 step counter, one per local shard it steps


# ---- the grid, three ways ------------------------------------------------------------
def _grid(how: str):
    """(shard group, replicate group) of this rank: from ``hsdp_groups``, from raw
    ``new_group`` calls, or a ``Topology(Layout(dp=2, tp=2))``'s tp axis (ranks
    [0, 1], [2, 3]) as the shard group and its dp axis ([0, 2], [1, 3]) as the
    replicate group."""
    import torch.distributed as dist

    from dtlab.topology import Layout, Topology
    from dtlab.zero import hsdp_groups

    if how == "helper":
        g = hsdp_groups(SHARD)
        return g.shard, g.replicate
    if how == "new_group":
        r = dist.get_rank()
        # every rank creates every group, in the same order (a collective)
        rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        columns = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        return rows[r // SHARD], columns[r % SHARD]
    topo = Topology(Layout(dp=2, tp=2))
    return topo.axis("tp"), topo.axis("dp")


def _train(model, opt, rec, steps=STEPS, tracker=None, micro=1, no_sync=False):
    """AdamW steps, rank r on the r-th quarter of the global batch; the global mean
    loss of each step. ``tracker``: the model states after the last backward.
    ``micro=2``: two microbatches a step (``no_sync``: the first under
    ``model.no_sync()``)."""
    import contextlib

    import torch.distributed as dist

    from dtlab import comm

    r = dist.get_rank()
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    losses, held = [], None
    for step in range(steps):
        rec.step = step
        x, y = data.shard(step, GLOBAL_BATCH, r, N)  # (2, T) each
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            quiet = no_sync and i < micro - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                _, loss = model(xm, ym)
                (loss / micro).backward()
            total += loss.detach() / micro
        if tracker is not None and step == steps - 1:
            held = tracker.measure()
        opt.step()
        opt.zero_grad(set_to_none=True)
        comm.all_reduce(total, tag="test/loss")
        losses.append(total.item() / N)
    return losses, held


def _hsdp_run(
    how: str, stage: int, compute_dtype=None, micro=1, no_sync=False, **options
):
    from dtlab import telemetry
    from dtlab.memory import MemoryTracker
    from dtlab.zero import FullyShardedDataParallel

    shard, rep = _grid(how)
    net = GPT(CFG)
    if options.get("sync_module_states"):  # every rank starts from other weights
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.01 * torch.distributed.get_rank())
    model = FullyShardedDataParallel(
        net, compute_dtype, shard, stage=stage, replicate_group=rep, **options
    )
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    rec = telemetry.Recorder()
    tracker = MemoryTracker(model, opt)
    with telemetry.use(rec):
        losses, held = _train(
            model, opt, rec, tracker=tracker, micro=micro, no_sync=no_sync
        )
    last = [
        e
        for e in rec.events
        if e["kind"] == "comm" and e["step"] == STEPS - 1
        and str(e["tag"]).startswith("zero")
    ]  # fmt: skip
    wire: dict[str, float] = {}
    for e in last:
        wire[e["axis"]] = wire.get(e["axis"], 0.0) + e["wire_bytes"]
    return {
        "losses": losses,
        "params": model.gather_full_params(),
        "wire": wire,
        "padded": model.padded_numel,
        "held": held,
        "pieces": len(list(model.parameters())),
        "replicas": model.n_replicas,
        "replica": model.replica_rank,
    }


def _fsdp2_hsdp():
    """FSDP2's HSDP on the same grid: every block, then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from dtlab import telemetry

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("replicate", "shard"))
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, _ = _train(model, opt, telemetry.Recorder())
    return {
        "losses": losses,
        "params": {k: v.full_tensor() for k, v in model.named_parameters()},
    }


def _variants():
    """Mixed precision, offload, accumulation, the stage-3 options and synced
    weights, each under HSDP."""
    return {
        "plain1": _hsdp_run("helper", 1),
        "accum1": _hsdp_run("helper", 1, micro=2),
        "accum1_nosync": _hsdp_run("helper", 1, micro=2, no_sync=True),
        "accum3": _hsdp_run("helper", 3, micro=2),
        "plain3_bf16": _hsdp_run("helper", 3, torch.bfloat16),
        "offload3_bf16": _hsdp_run("helper", 3, torch.bfloat16, offload=True),
        "root_kept": _hsdp_run("helper", 3, keep_root_gathered=True, prefetch=False),
        "synced": _hsdp_run("helper", 3, sync_module_states=True),
    }


def _gpt_runs():
    runs = {f"stage{s}": _hsdp_run("helper", s) for s in (0, 1, 2, 3)}
    runs["new_group"] = _hsdp_run("new_group", 3)
    runs["topology"] = _hsdp_run("topology", 2)
    runs["fsdp2"] = _fsdp2_hsdp()
    return runs


# ---- one process, the grid's order of sums -------------------------------------------
def _same_order(model, loss_of, opt, steps):
    """Each rank's gradient on its own quarter, divided by 4, added as the grid adds
    them: (g0 + g1) + (g2 + g3); ``None`` where no rank has one. Then ``opt`` steps.
    Returns the losses and the first step's averaged gradients."""
    losses, first = [], None
    for step in range(steps):
        quarters, total = [], 0.0
        for r in range(N):
            model.zero_grad(set_to_none=True)
            loss = loss_of(model, step, r)
            loss.backward()
            total += loss.item()
            grads = {k: p.grad for k, p in model.named_parameters()}
            quarters.append({k: g / N for k, g in grads.items() if g is not None})
        for name, p in model.named_parameters():
            if name in quarters[0]:
                q = [quarter[name] for quarter in quarters]
                p.grad = (q[0] + q[1]) + (q[2] + q[3])
            else:
                p.grad = None
        if step == 0:
            first = {k: p.grad for k, p in model.named_parameters()}
        opt.step()
        losses.append(total / N)
    return losses, first


def _gpt_loss(model, step, r):
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).shard(step, GLOBAL_BATCH, r, N)
    return model(x, y)[1]


# ---- the tests -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(lab_cluster):
    return lab_cluster(4)


@pytest.fixture(scope="module")
def gpt_runs(cluster):
    return cluster.run(_gpt_runs, timeout=180)


def _assert_params_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_every_stage_matches_one_process_and_fsdp2_hsdp(gpt_runs):
    ranks = gpt_runs
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses, _ = _same_order(model, _gpt_loss, opt, STEPS)
    same_order = {k: p.detach() for k, p in model.named_parameters()}
    plain = train_reference(
        CFG, steps=STEPS, global_batch_size=GLOBAL_BATCH, lr=LR, betas=(0.9, 0.95)
    )
    plain_params = dict(plain.model.named_parameters())
    for name, run in ranks[0].items():
        assert run["losses"] == pytest.approx(losses, rel=1e-6), name
        _assert_params_equal(run["params"], same_order)  # bit for bit
        assert run["losses"] == pytest.approx(plain.losses, rel=1e-5), name
        diff = max((run["params"][k] - plain_params[k]).abs().max() for k in same_order)
        assert diff < 1e-4, name
    # every rank ends with the same weights: the replicas stepped alike
    for rank_runs in ranks[1:]:
        for name, run in rank_runs.items():
            _assert_params_equal(run["params"], ranks[0][name]["params"])
    ours, theirs = ranks[0]["stage3"], ranks[0]["fsdp2"]
    assert ours["losses"] == theirs["losses"]
    _assert_params_equal(ours["params"], theirs["params"])


def test_bytes_per_axis_equal_the_estimate(gpt_runs):
    for rank, rank_runs in enumerate(gpt_runs):
        for name, run in rank_runs.items():
            if name == "fsdp2":
                continue
            stage = 3 if name == "new_group" else 2 if name == "topology" else None
            stage = int(name[-1]) if stage is None else stage
            want = estimate.hsdp_comm_per_step(run["padded"], SHARD, 2, stage, 4)
            # raw groups are recorded as dp_shard / dp_replicate; a Topology's axes
            # keep their names (its tp axis is the shard group here)
            axes = ("tp", "dp") if name == "topology" else ("dp_shard", "dp_replicate")
            assert run["wire"] == {
                axes[0]: want["shard"]["wire"],
                axes[1]: want["replicate"]["wire"],
            }, name
            assert (run["replicas"], run["replica"]) == (2, rank // SHARD), name
    # what crosses replicas is the reduced slice only: Ψ/S of fp32, once
    run = gpt_runs[0]["stage3"]
    assert run["wire"]["dp_replicate"] == 4 * run["padded"] / SHARD


def test_memory_per_rank_is_the_shard_groups_slice(gpt_runs):
    for rank_runs in gpt_runs:
        for stage in (0, 1, 2, 3):
            run = rank_runs[f"stage{stage}"]
            want = estimate.hsdp_states_per_rank(run["padded"], SHARD, 2, stage, "fp32")
            got = run["held"]
            assert got["params"] == want["params"], stage
            assert got["grads"] == want["grads"], stage
            steps = ADAM_STEP_BYTES * run["pieces"]
            assert got["optimizer"] == want["optimizer"] + steps, stage
    # the layout estimate takes HSDP's shard group: the same divisor
    model = GPTConfig()
    for stage in (1, 2, 3):
        got = estimate.layout_memory(
            model, Layout(dp=8), zero_stage=stage, zero_shard_size=2
        )
        want = estimate.hsdp_states_per_rank(GPT(model).n_params(), 2, 4, stage, "fp32")
        for k in ("params", "grads", "optimizer"):
            assert got[k] == want[k], (stage, k)
    with pytest.raises(ValueError, match="zero_shard_size=3 does not divide"):
        estimate.layout_memory(model, Layout(dp=8), zero_stage=3, zero_shard_size=3)
    # the estimate: S's divisor, whatever R is
    psi = 1e9
    one = estimate.zero_states_per_rank(psi, 8, 3, "mixed")
    assert estimate.hsdp_states_per_rank(psi, 8, 16, 3, "mixed") == one
    traffic = estimate.hsdp_comm_per_step(psi, 8, 16, 3)
    assert traffic["replicate"]["wire"] == pytest.approx(2 * 15 / 16 * 2 * psi / 8)
    assert traffic["shard"]["wire"] == pytest.approx(3 * 7 / 8 * 2 * psi)
    assert traffic["wire"] < estimate.zero_comm_per_step(psi, 128, 3)["wire"]
    with pytest.raises(ValueError, match="replicate_size"):
        estimate.hsdp_comm_per_step(psi, 8, 0, 3)


def test_precision_offload_accumulation_and_sync_change_nothing_else(cluster, gpt_runs):
    out = cluster.run(_variants, timeout=180)[0]
    plain = gpt_runs[0]["stage3"]
    # offload moves masters and optimizer state to the host, the arithmetic stays
    assert out["offload3_bf16"]["losses"] == out["plain3_bf16"]["losses"]
    _assert_params_equal(out["offload3_bf16"]["params"], out["plain3_bf16"]["params"])
    # bf16: 8 bits of mantissa, ~0.4 % on the loss (test_zero.py derives it)
    assert out["plain3_bf16"]["losses"] == pytest.approx(plain["losses"], rel=1e-2)
    # rank 0's weights reach every rank, shard group and replicas: as if all had
    # started from them
    assert out["synced"]["losses"] == plain["losses"]
    _assert_params_equal(out["synced"]["params"], plain["params"])
    # FSDP2's habit for its root and no prefetch: other timing, same numbers
    assert out["root_kept"]["losses"] == plain["losses"]
    _assert_params_equal(out["root_kept"]["params"], plain["params"])
    # two microbatches: stage 3 reduces (both hops) after each backward and adds
    # the slices; stage 1 under no_sync adds full gradients and reduces once, the
    # same additions in another order (Adam may pass a last-bit difference of a
    # near-zero gradient on as a few 1e-6, see test_zero.py)
    assert out["accum3"]["losses"] == pytest.approx(out["accum1"]["losses"], rel=1e-6)
    quiet, loud = out["accum1_nosync"], out["accum1"]
    assert quiet["losses"] == pytest.approx(loud["losses"], rel=1e-6)
    assert (
        max(
            (quiet["params"][k] - loud["params"][k]).abs().max()
            for k in plain["params"]
        )
        < 2e-5
    )
    assert quiet["wire"] == out["plain1"]["wire"]  # one reduction a step, both axes
    # without no_sync, each microbatch reduces: twice the replicas' all-reduce,
    # and in the shard group two reduce-scatters beside the one all-gather
    assert loud["wire"]["dp_replicate"] == 2 * quiet["wire"]["dp_replicate"]
    assert loud["wire"]["dp_shard"] == 1.5 * quiet["wire"]["dp_shard"]


# ---- frozen and unused parameters, the pieces the module shows -----------------------
EXACT_STEPS = 4
EXACT_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
}


def _forked_loss(model, step, r):
    from dtlab.model import regression_batch, shard_batch

    x, y = shard_batch(*regression_batch(step, 8, 6, 3), r, N)
    return torch.nn.functional.mse_loss(model(x, step), y)


def _forked_runs(opt_name):
    """Every stage under HSDP: the final weights and optimizer state (gathered
    whole) and, after the first backward, what the module shows."""
    import torch.distributed as dist

    from dtlab.checkpoint import gather_full_optimizer_state
    from dtlab.zero import FullyShardedDataParallel

    shard, rep = _grid("helper")
    r = dist.get_rank()
    cls, options = EXACT_OPTIMIZERS[opt_name]
    out = {}
    for stage in (0, 1, 2, 3):
        model = FullyShardedDataParallel(
            branchy_model(), None, shard, stage=stage, replicate_group=rep
        )
        opt = cls(model.parameters(), **options)
        shown = None
        for step in range(EXACT_STEPS):
            _forked_loss(model, step, r).backward()
            if step == 0:
                pieces = {s.name: (s.start, s.stop) for s in model.local_shards()}
                shown = {
                    name: (
                        pieces.get(name),
                        None if p.grad is None else p.grad.detach().clone(),
                    )
                    for name, p in model.module.named_parameters()
                }
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[stage] = {
            "params": model.gather_full_params(),
            "state": gather_full_optimizer_state(model, opt),
            "shown": shown,
        }
    return out


@pytest.mark.parametrize("opt_name", list(EXACT_OPTIMIZERS))
def test_frozen_and_unused_parameters_never_move_nor_age(cluster, opt_name):
    model = branchy_model()
    initial = {k: p.detach().clone() for k, p in model.named_parameters()}
    cls, options = EXACT_OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **options)
    _, averaged = _same_order(model, _forked_loss, opt, EXACT_STEPS)
    ref_params = {k: p.detach() for k, p in model.named_parameters()}
    ref_state = {k: opt.state[p] for k, p in model.named_parameters() if p in opt.state}
    ranks = cluster.run(_forked_runs, opt_name, timeout=120)
    for rank, runs in enumerate(ranks):
        for stage, run in runs.items():
            where = (opt_name, rank, stage)
            _assert_params_equal(run["params"], ref_params)  # the frozen ones too
            assert run["state"].keys() == ref_state.keys(), where
            for name, state in ref_state.items():
                for key, value in state.items():
                    assert torch.equal(run["state"][name][key], value), (where, key)
            # after backward the module shows this rank's pieces and their averaged
            # gradients; a frozen parameter shows none
            for name, (piece, grad) in run["shown"].items():
                if name in FROZEN:
                    assert grad is None, (where, name)
                elif stage == 0:
                    assert torch.equal(grad, averaged[name]), (where, name)
                elif piece is not None:
                    start, stop = piece
                    want = averaged[name].reshape(-1)[start:stop]
                    assert torch.equal(grad, want), (where, name)
    for stage in (1, 2, 3):  # replicas hold the same pieces: ranks 0, 2 and 1, 3
        for a, b in ((0, 2), (1, 3)):
            sa, sb = ranks[a][stage]["shown"], ranks[b][stage]["shown"]
            assert {k: v[0] for k, v in sa.items()} == {k: v[0] for k, v in sb.items()}
    for name in FROZEN:
        assert torch.equal(ref_params[name], initial[name])
        assert name not in ref_state
    if opt_name == "adamw":  # the even-step branch stepped twice, the rest 4 times
        state = ranks[0][3]["state"]
        assert float(state["blocks.1.side.bias"]["step"]) == 2
        assert float(state["head.bias"]["step"]) == 4


# ---- bad input -----------------------------------------------------------------------
def _bad_grids():
    """The mistakes a learner makes building the grid, and their messages."""
    import torch.distributed as dist

    from dtlab.zero import FullyShardedDataParallel, hsdp_groups

    msgs = {}
    try:
        hsdp_groups(3)
    except ValueError as exc:
        msgs["size"] = str(exc)
    g = hsdp_groups(SHARD)
    # the replicate group must cross the shard group at this rank only
    try:
        FullyShardedDataParallel(GPT(CFG), None, g.shard, replicate_group=g.shard)
    except ValueError as exc:
        msgs["crossing"] = str(exc)
    # replicas must hold the same slice: pair rank 0 with 3 and 1 with 2
    r = dist.get_rank()
    skew = {k: dist.new_group(list(k)) for k in [(0, 3), (1, 2)]}
    rep = next(grp for k, grp in skew.items() if r in k)
    try:
        FullyShardedDataParallel(GPT(CFG), None, g.shard, replicate_group=rep)
    except ValueError as exc:
        msgs["skew"] = str(exc)
    return msgs


def test_a_wrong_grid_is_refused_by_name(cluster):
    for msgs in cluster.run(_bad_grids, timeout=60):
        assert "shard_size=3 does not divide the 4" in msgs["size"]
        assert "pick it from [1, 2, 4]" in msgs["size"]
        assert "exactly one rank in common" in msgs["crossing"]
        assert "different places of their shard groups" in msgs["skew"]


# ---- the bench row -------------------------------------------------------------------
def test_the_bench_table_has_an_hsdp_row():
    zero = [
        {"variant": "dtlab HSDP", "world_size": 4, "step_s": 0.030},
        {"variant": "torch FSDP2 HSDP", "world_size": 4, "step_s": 0.020},
    ]
    rows = bench.assemble({"quick": True, "results": {"zero": zero}})
    (row,) = [r for r in rows if r["what"] == "HSDP step"]
    assert row["ratio"] == pytest.approx(1.5) and row["n"] == 4
    assert row["against"] == "FSDP2 HSDP (2D mesh)"

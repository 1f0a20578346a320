"""ZeRO stages 0-3: parity with the single-process reference, with each other, with
PyTorch's ZeroRedundancyOptimizer (stage 1) and FSDP2 fully_shard (stage 3); mixed
precision, CPU offload, gradient accumulation; sharded checkpoints and resharding;
frozen and unused parameters left alone by the optimizer, bit for bit against plain
torch optimizers; the module's own gradients after backward; and where fp32 ZeRO is
exactly one process (and where the order of float sums makes it not).

Everything runs on one 4-engine cluster; the 2-rank cases use a process group of
ranks 0 and 1 (ranks 2 and 3 sit that run out), so no second cluster is started."""

import contextlib
import copy
import itertools

import pytest
import torch

from dtlab.model import GPT, MLP, CausalSelfAttention, GPTConfig, SyntheticTokens
from dtlab.reference import train_reference
from tests.models import FROZEN, branchy_model

pytestmark = pytest.mark.cluster

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, d_model=16)
GLOBAL_BATCH = 8
LR = 1e-2  # large enough that three steps move every weight visibly
STEPS = 3
ADAMW = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)  # the reference's


# ---- run on every rank ---------------------------------------------------------------
def _group(n):
    """A process group of ranks 0..n-1 (a collective: every rank calls it); None on
    the ranks outside it."""
    import torch.distributed as dist

    if n == dist.get_world_size():
        return dist.group.WORLD
    g = dist.new_group(list(range(n)))
    return g if dist.get_rank() < n else None


def _train(model, opt, group, steps=STEPS, start=0, micro=1, no_sync=False):
    """AdamW steps on this rank's slice of the global batch; returns the global mean
    loss of each step (``micro`` > 1: gradient accumulation over microbatches; with
    ``no_sync``, all but the last backward under ``model.no_sync()``)."""
    from dtlab import comm

    r, n = comm.group_rank(group), comm.group_size(group)
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    losses = []
    for step in range(start, start + steps):
        x, y = data.shard(step, GLOBAL_BATCH, r, n)  # (B/n, T) each
        total = torch.zeros(())
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            quiet = no_sync and i < micro - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                _, loss = model(xm, ym)
                (loss / micro).backward()
            total += loss.detach() / micro
        opt.step()
        opt.zero_grad(set_to_none=True)
        comm.all_reduce(total, group=group)
        losses.append(total.item() / n)
    return losses


def _zero_run(
    group, stage, compute_dtype=None, offload=False, micro=1, no_sync=False, **options
):
    from dtlab import telemetry
    from dtlab.zero import FullyShardedDataParallel

    model = FullyShardedDataParallel(
        GPT(CFG), compute_dtype, group, stage=stage, offload=offload, **options
    )
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    rec = telemetry.Recorder()
    with telemetry.use(rec):
        losses = _train(model, opt, group, micro=micro, no_sync=no_sync)

    def payload(*ops):  # the wrapper's own collectives (not _train's loss sum)
        return sum(
            e["payload_bytes"]
            for e in rec.events
            if e["kind"] == "comm" and e["op"] in ops
            and str(e.get("tag")).startswith("zero")
        )  # fmt: skip

    gathered = payload("all_gather")
    return {
        "losses": losses,
        "params": model.gather_full_params(),
        "dtypes": {p.dtype for p in model.parameters()},
        "units": model.units,
        "gathered_per_step": gathered / STEPS,
        "reduced_per_step": payload("reduce_scatter", "all_reduce") / STEPS,
    }


def _every_stage(n, compute_dtype=None):
    g = _group(n)
    if g is None:
        return None
    return {s: _zero_run(g, s, compute_dtype) for s in (0, 1, 2, 3)}


def _variants(n):
    """Offload and gradient accumulation, against the plain runs."""
    g = _group(n)
    if g is None:
        return None
    return {
        "plain2": _zero_run(g, 2),
        "offload2": _zero_run(g, 2, offload=True),
        "plain3_bf16": _zero_run(g, 3, torch.bfloat16),
        "offload3_bf16": _zero_run(g, 3, torch.bfloat16, offload=True),
        "accum0": _zero_run(g, 0, micro=2),
        "accum3": _zero_run(g, 3, micro=2),
        # stages 0-1 hold full gradients: accumulate them, reduce once per step
        "plain1": _zero_run(g, 1),
        "accum1": _zero_run(g, 1, micro=2),
        "accum1_nosync": _zero_run(g, 1, micro=2, no_sync=True),
        "accum0_nosync": _zero_run(g, 0, micro=2, no_sync=True),
        # FSDP2's habit for the root, no prefetch, and units picked by class
        "root_kept": _zero_run(g, 3, keep_root_gathered=True, prefetch=False),
        "by_class": _zero_run(g, 3, units=(CausalSelfAttention, MLP)),
    }


def _vs_zero_redundancy_optimizer(n):
    """Stage 1 three ways: torch DDP + torch's ZeroRedundancyOptimizer, torch DDP +
    dtlab's ShardedOptimizer, and dtlab's stage-1 wrapper."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dtlab.zero import ShardedOptimizer

    g = _group(n)
    if g is None:
        return None
    out = {}
    for name, opt_cls in (
        ("torch", ZeroRedundancyOptimizer),
        ("dtlab", ShardedOptimizer),
    ):
        model = DDP(GPT(CFG), process_group=g)
        opt = opt_cls(model.parameters(), torch.optim.AdamW, process_group=g, **ADAMW)
        losses = _train(model, opt, g)
        numel = None
        if name == "dtlab":  # each rank keeps optimizer state for its slice only
            numel = sum(v.numel() for s in opt.optim.state.values() for v in s.values())
        out[name] = {
            "losses": losses,
            "params": {
                k: v.detach().clone() for k, v in model.module.named_parameters()
            },
            "state_numel": numel,
        }
    out["wrapper"] = _zero_run(g, 1)
    return out


def _vs_fsdp2(n):
    """Stage 3 against FSDP2: fully_shard on every block, then on the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    g = _group(n)
    if g is None:
        return None
    model = GPT(CFG)
    mesh = DeviceMesh.from_group(g, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = _train(model, opt, g)
    params = {k: v.full_tensor() for k, v in model.named_parameters()}
    return {"fsdp2": {"losses": losses, "params": params}, "dtlab": _zero_run(g, 3)}


def _checkpoints(path):
    """Stage 3 on 4 ranks: save after 2 steps, compare a resumed run with an
    uninterrupted one; then load the same files on 2 ranks (and at stage 2)."""
    import torch.distributed as dist

    from dtlab.checkpoint import gather_full_optimizer_state, load_sharded, save_sharded
    from dtlab.zero import FullyShardedDataParallel

    world = dist.group.WORLD

    def fresh(group, stage=3):
        model = FullyShardedDataParallel(GPT(CFG), None, group, stage=stage)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW)

    model, opt = fresh(world)
    _train(model, opt, world, steps=2)
    save_sharded(path, model, opt, extra={"step": 2})
    saved_params = model.gather_full_params()
    saved_state = gather_full_optimizer_state(model, opt)
    straight = _train(model, opt, world, steps=2, start=2)
    straight_params = model.gather_full_params()

    model, opt = fresh(world)
    extra = load_sharded(path, model, opt)
    resumed = _train(model, opt, world, steps=2, start=extra["step"])
    out = {
        "straight": straight,
        "resumed": resumed,
        "same_params": all(
            torch.equal(v, straight_params[k])
            for k, v in model.gather_full_params().items()
        ),
        "files": sorted(__import__("os").listdir(path)),
    }
    g2 = _group(2)
    if g2 is not None:
        for stage in (3, 2):
            model, opt = fresh(g2, stage)
            load_sharded(path, model, opt)
            params = model.gather_full_params()
            state = gather_full_optimizer_state(model, opt)
            out[f"two_ranks_stage{stage}"] = {
                "params": all(
                    torch.equal(params[k], v) for k, v in saved_params.items()
                ),
                "state": all(
                    torch.equal(state[k][key], v)
                    for k, st in saved_state.items()
                    for key, v in st.items()
                ),
                "losses": _train(model, opt, g2, steps=2, start=2),
            }
    return out


def _bad_input():
    """The errors a learner meets, with their messages."""
    from dtlab.zero import FullyShardedDataParallel, ShardedOptimizer

    msgs = {}

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                [torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)]
            )
            self.blocks[1].weight = self.blocks[0].weight

    for key, make in (
        ("stage", lambda: FullyShardedDataParallel(GPT(CFG), stage=4)),
        ("dtype", lambda: FullyShardedDataParallel(GPT(CFG), torch.int8)),
        ("tied", lambda: FullyShardedDataParallel(Tied())),
        ("lbfgs", lambda: ShardedOptimizer(GPT(CFG).parameters(), torch.optim.LBFGS)),
        ("not_cls", lambda: ShardedOptimizer(GPT(CFG).parameters(), "adam")),
    ):
        try:
            make()
        except ValueError as exc:
            msgs[key] = str(exc)
    try:
        with FullyShardedDataParallel(GPT(CFG), stage=2).no_sync():
            pass
    except RuntimeError as exc:
        msgs["no_sync2"] = str(exc)
    model = FullyShardedDataParallel(GPT(CFG), stage=1)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    with model.no_sync():
        x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, 2)
        model(x, y)[1].backward()
    try:
        opt.step()
    except RuntimeError as exc:
        msgs["unreduced"] = str(exc)
    model.reduce_gradients()  # what the message asks for: then the step runs
    msgs["stepped"] = opt.step() is None
    return msgs


# ---- the tests -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(lab_cluster):
    return lab_cluster(4)


@pytest.fixture(scope="module")
def reference():
    return train_reference(
        CFG, steps=STEPS, global_batch_size=GLOBAL_BATCH, lr=LR, betas=(0.9, 0.95)
    )


def _assert_params_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.parametrize("n", [2, 4])
def test_every_stage_matches_the_reference_and_each_other(cluster, reference, n):
    runs = cluster.run(_every_stage, n, timeout=120)[0]
    ref_params = dict(reference.model.named_parameters())
    for stage, run in runs.items():
        assert run["dtypes"] == {torch.float32}
        # Not bit-exact against one process: the reference averages the loss over
        # all 8 sequences at once, ZeRO over each rank's 8/n and then over ranks, so
        # float sums run in another order (~1e-7 relative on the gradients). Adam
        # divides by sqrt(v) and passes such differences on at about their size:
        # after 3 steps of lr 1e-2 the weights differ by ~5e-6 here; 1e-4 (1 % of
        # one step) would still catch a missing average or a skipped slice.
        assert run["losses"] == pytest.approx(reference.losses, rel=1e-5), stage
        assert _max_diff(run["params"], ref_params) < 1e-4, stage
    # Among themselves the stages agree bit for bit: same flat layout, and gloo's
    # reduce-scatter sums each element in the same order as its all-reduce.
    for stage in (1, 2, 3):
        assert runs[stage]["losses"] == runs[0]["losses"]
        _assert_params_equal(runs[stage]["params"], runs[0]["params"])


@pytest.mark.parametrize("n", [2, 4])
def test_stage1_matches_zero_redundancy_optimizer(cluster, n):
    out = cluster.run(_vs_zero_redundancy_optimizer, n, timeout=120)[0]
    torch_run, ours = out["torch"], out["dtlab"]
    # behind the same torch DDP, the gradients are identical: the update must be too
    assert ours["losses"] == torch_run["losses"]
    _assert_params_equal(ours["params"], torch_run["params"])
    # rank 0 holds Adam's two moments for its 1/n slice of the parameters, and one
    # step counter per parameter piece in that slice
    sizes = [p.numel() for p in GPT(CFG).parameters()]
    S = -(-sum(sizes) // n)
    pieces = sum(start < S for start in itertools.accumulate([0] + sizes[:-1]))
    assert ours["state_numel"] == 2 * S + pieces
    wrapper = out["wrapper"]
    if n == 2:  # a + b: one order only, so even a different bucket layout agrees
        assert wrapper["losses"] == torch_run["losses"]
        _assert_params_equal(wrapper["params"], torch_run["params"])
    else:
        # DDP buckets parameters in reverse order, dtlab flattens them forward, so
        # on 4 ranks gloo's ring adds each element's 4 terms in another order:
        # ~1e-7 relative, as in the reference comparison above
        assert wrapper["losses"] == pytest.approx(torch_run["losses"], rel=1e-6)
        assert _max_diff(wrapper["params"], torch_run["params"]) < 1e-4


@pytest.mark.parametrize("n", [2, 4])
def test_stage3_matches_fsdp2(cluster, n):
    out = cluster.run(_vs_fsdp2, n, timeout=120)[0]
    theirs, ours = out["fsdp2"], out["dtlab"]
    if n == 2:
        assert ours["losses"] == theirs["losses"]
        _assert_params_equal(ours["params"], theirs["params"])
    else:
        # FSDP2 pads and reduce-scatters each parameter on its own dim 0, dtlab one
        # flat unit: other chunk boundaries, so another summation order on 4 ranks
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
        assert _max_diff(ours["params"], theirs["params"]) < 1e-4


def _bf16_reference():
    """One process making the casts ZeRO makes: bf16 copy of fp32 master weights for
    forward and backward, fp32 AdamW on the master."""
    master = GPT(CFG)
    opt = torch.optim.AdamW(master.parameters(), **ADAMW)
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    losses = []
    for step in range(STEPS):
        x, y = data.batch(step, GLOBAL_BATCH)
        low = copy.deepcopy(master).to(torch.bfloat16)
        _, loss = low(x, y)
        loss.backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(master.named_parameters())


def test_bf16_compute_keeps_fp32_masters(cluster):
    runs = cluster.run(_every_stage, 4, torch.bfloat16, timeout=120)[0]
    ref_losses, ref_params = _bf16_reference()
    for stage in (1, 2, 3):
        assert runs[stage]["losses"] == runs[0]["losses"]
        _assert_params_equal(runs[stage]["params"], runs[0]["params"])
    run = runs[3]
    assert run["dtypes"] == {torch.float32}  # the optimizer steps fp32 masters
    # bf16 keeps 8 bits of mantissa: per-rank sums rounded to bf16 and then added
    # across ranks differ from the one-process sum by ~2^-8 relative. The loss
    # carries that (0.4 %); Adam turns a gradient's sign into a step of ~lr, so a
    # weight whose tiny gradient changed sign moves up to 2·lr per step the other
    # way: bounded by 6·lr after 3 steps, and on average far smaller.
    assert run["losses"] == pytest.approx(ref_losses, rel=1e-2)
    assert _max_diff(run["params"], ref_params) <= 6 * LR
    mean = sum((run["params"][k] - ref_params[k]).abs().mean() for k in ref_params)
    assert mean / len(ref_params) < 0.1 * LR


def test_offload_and_accumulation_change_nothing_but_where_bytes_live(cluster):
    out = cluster.run(_variants, 2, timeout=120)[0]
    # offload moves masters and states to the host; the arithmetic is the same
    for plain, off in (("plain2", "offload2"), ("plain3_bf16", "offload3_bf16")):
        assert out[off]["losses"] == out[plain]["losses"]
        _assert_params_equal(out[off]["params"], out[plain]["params"])
    # two microbatches per step: each backward reduces, the shards accumulate
    assert out["accum3"]["losses"] == out["accum0"]["losses"]
    _assert_params_equal(out["accum3"]["params"], out["accum0"]["params"])
    assert out["accum0"]["losses"] == pytest.approx(out["plain2"]["losses"], rel=1e-5)
    # no_sync: the same training (the sum is reduced once instead of added after
    # each reduction, another order of the same additions) for half the traffic
    for stage in (0, 1):
        quiet, loud = out[f"accum{stage}_nosync"], out[f"accum{stage}"]
        assert quiet["losses"] == pytest.approx(loud["losses"], rel=1e-6)
        # Adam divides by sqrt(v): a last-bit difference in a near-zero gradient can
        # move that weight a few 1e-6 after 3 steps of lr 1e-2 (weights move ~3e-2)
        assert _max_diff(quiet["params"], loud["params"]) < 2e-5
        assert loud["reduced_per_step"] == 2 * quiet["reduced_per_step"]
    assert out["accum1_nosync"]["reduced_per_step"] == out["plain1"]["reduced_per_step"]
    # the options of stage 3 change what moves when, not the numbers
    for name in ("root_kept", "by_class"):
        assert out[name]["losses"] == pytest.approx(out["plain2"]["losses"], rel=1e-6)
    kept, units = out["root_kept"], out["root_kept"]["units"]
    psi, root = sum(u["padded"] for u in units), units[0]["padded"]
    assert units[0]["name"] == "root"
    # every unit gathered twice, except the root kept from forward to backward
    assert kept["gathered_per_step"] == 4 * (2 * psi - root)
    assert len(out["by_class"]["units"]) == 1 + 2 * CFG.n_layers  # root + attn, mlp


def test_checkpoint_resumes_exactly_and_reshards(cluster, tmp_path):
    out = cluster.run(_checkpoints, str(tmp_path / "ckpt"), timeout=120)[0]
    assert out["files"] == ["meta.json"] + [f"rank{r:05d}.pt" for r in range(4)]
    assert out["resumed"] == out["straight"]  # loading restores training exactly
    assert out["same_params"]
    for stage in (3, 2):  # saved at 4 ranks, loaded at 2 and at another stage
        two = out[f"two_ranks_stage{stage}"]
        assert two["params"] and two["state"]  # every weight and Adam state, exactly
        # training goes on from the same state; 2 ranks sum in another order
        assert two["losses"] == pytest.approx(out["straight"], rel=1e-5)


def test_bad_input_is_named(cluster):
    msgs = cluster.run(_bad_input, timeout=60)[0]
    assert "use 0, 1, 2 or 3" in msgs["stage"]
    assert "compute_dtype" in msgs["dtype"]
    assert "shared by two units" in msgs["tied"]
    assert "element-wise" in msgs["lbfgs"]
    assert "torch.optim.Optimizer class" in msgs["not_cls"]
    assert "needs ZeRO stage 0 or 1" in msgs["no_sync2"]
    assert "reduce_gradients()" in msgs["unreduced"]
    assert msgs["stepped"]


# ---- what the optimizer may not touch: frozen and unused parameters ------------------
# Bit for bit against one process, which is possible here: on 2 ranks the same-order
# reference (each rank's gradient computed on its own, halved, added: a + b has one
# order) does in one process exactly the sums ZeRO does, and element-wise optimizers
# compute on a piece of a parameter what they compute on the whole.
EXACT_STEPS = 4
EXACT_BATCH = 8
EXACT_OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
}


def _branchy_loss(model, step, rank, n, dtype=torch.float32):
    from dtlab.model import regression_batch, shard_batch

    x, y = shard_batch(*regression_batch(step, EXACT_BATCH, 6, 3), rank, n)
    return torch.nn.functional.mse_loss(model(x.to(dtype), step), y.to(dtype))


def _same_order_reference(opt_name, n=2):
    """One process adding the 2 ranks' halved gradients (``None`` where neither has
    one), then a plain torch optimizer step. Also the averaged gradients of step 0."""
    model = branchy_model()
    cls, options = EXACT_OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **options)
    first_grads = None
    for step in range(EXACT_STEPS):
        halves = []
        for r in range(n):
            model.zero_grad(set_to_none=True)
            _branchy_loss(model, step, r, n).backward()
            grads = {k: p.grad for k, p in model.named_parameters()}
            halves.append({k: g / n for k, g in grads.items() if g is not None})
        for name, p in model.named_parameters():
            p.grad = halves[0][name] + halves[1][name] if name in halves[0] else None
        if step == 0:
            first_grads = {k: p.grad for k, p in model.named_parameters()}
        opt.step()
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    state = {k: opt.state[p] for k, p in model.named_parameters() if p in opt.state}
    return params, state, first_grads


def _frozen_and_unused(opt_name):
    """On 2 ranks: every ZeRO stage (and offload) and ZeRO-1 as an optimizer behind
    dtlab's DDP train the branchy model with ``opt_name``; the final weights and
    (through the checkpoint module) the optimizer state, gathered whole."""
    from dtlab.checkpoint import gather_full_optimizer_state
    from dtlab.ddp import DistributedDataParallel
    from dtlab.zero import FullyShardedDataParallel, ShardedOptimizer

    g = _group(2)
    if g is None:
        return None
    r = torch.distributed.get_rank()
    cls, options = EXACT_OPTIMIZERS[opt_name]
    runs = {f"stage{s}": dict(stage=s) for s in (0, 1, 2, 3)}
    runs |= {f"offload{s}": dict(stage=s, offload=True) for s in (0, 1, 2, 3)}
    out = {}
    for name, kw in runs.items():
        model = FullyShardedDataParallel(branchy_model(), None, g, **kw)
        opt = cls(model.parameters(), **options)
        for step in range(EXACT_STEPS):
            _branchy_loss(model, step, r, 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = {
            "params": model.gather_full_params(),
            "state": gather_full_optimizer_state(model, opt),
        }
    net = branchy_model()
    ddp = DistributedDataParallel(net, process_group=g, find_unused_parameters=True)
    opt = ShardedOptimizer(net.parameters(), cls, process_group=g, **options)
    for step in range(EXACT_STEPS):
        _branchy_loss(ddp, step, r, 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["sharded_optimizer"] = {
        "params": {k: p.detach().clone() for k, p in net.named_parameters()}
    }
    return out


def _module_gradients(compute_dtype=None):
    """On 2 ranks, per stage: what ``model.module.named_parameters()`` shows after
    one backward (step 0, every trainable parameter used), and after the next
    forward; whether each shown gradient lives in a storage that the memory
    accounting already counts."""
    from dtlab.zero import FullyShardedDataParallel

    g = _group(2)
    if g is None:
        return None
    r = torch.distributed.get_rank()
    out = {}
    for stage in (0, 1, 2, 3):
        model = FullyShardedDataParallel(branchy_model(), compute_dtype, g, stage=stage)
        _branchy_loss(model, 0, r, 2, compute_dtype or torch.float32).backward()
        model.finish_gradient_synchronization()  # (idempotent: backward ran it)
        counted = {t.untyped_storage().data_ptr() for _, t in model.memory_tensors()}
        ours = {id(p) for p in model.parameters()}
        shards = {s.name: (s.start, s.stop) for s in model.local_shards()}
        shown = {}
        for name, p in model.module.named_parameters():
            grad = p.grad
            shown[name] = dict(
                shape=tuple(p.shape),
                dtype=p.dtype,
                grad=None if grad is None else grad.detach().clone(),
                grad_shape=None if grad is None else tuple(grad.shape),
                grad_dtype=None if grad is None else grad.dtype,
                stepped=id(p) in ours,
                counted=grad is None
                or not grad.numel()
                or grad.untyped_storage().data_ptr() in counted,
                piece=shards.get(name),
            )
        with torch.no_grad():
            model(
                torch.zeros(1, 6, dtype=compute_dtype), 0
            )  # a forward: the compute parameters are back
        own = model.compute_parameters()
        back = all(p is own[k] for k, p in model.module.named_parameters())
        out[stage] = {"shown": shown, "back": back}
    return out


def test_frozen_and_unused_parameters_never_move_nor_age(cluster):
    # Before dtlab.zero stepped per-parameter pieces, a frozen weight sharing a flat
    # shard with trained ones got a zero gradient, and weight decay moved it (2.0 ->
    # 1.8088 in 10 AdamW steps at lr 0.1, wd 0.1); an unused one aged Adam's step.
    initial = {k: p.detach().clone() for k, p in branchy_model().named_parameters()}
    for opt_name in EXACT_OPTIMIZERS:
        ref_params, ref_state, _ = _same_order_reference(opt_name)
        runs = cluster.run(_frozen_and_unused, opt_name, timeout=120)[0]
        for name in FROZEN:
            assert torch.equal(ref_params[name], initial[name])
            assert name not in ref_state
        for run_name, run in runs.items():
            where = (opt_name, run_name)
            _assert_params_equal(run["params"], ref_params)  # the frozen ones too
            if "state" not in run:
                continue  # ShardedOptimizer: its state is per piece, not gathered
            assert run["state"].keys() == ref_state.keys(), where
            for name, state in ref_state.items():
                for key, value in state.items():
                    assert torch.equal(run["state"][name][key], value), (where, key)
        # the branch taken on steps 0 and 2 stepped twice, the rest four times
        if opt_name == "adamw":
            assert float(runs["stage3"]["state"]["blocks.1.side.bias"]["step"]) == 2
            assert float(runs["stage3"]["state"]["head.bias"]["step"]) == 4
        moved = [k for k in ref_params if not torch.equal(ref_params[k], initial[k])]
        assert len(moved) == len(ref_params) - len(FROZEN)  # the rest did train


def _reshard_branchy(path):
    """The branchy model at stage 3 on 4 ranks, 3 AdamW steps (the side branches
    stepped twice, the frozen layers never), saved; then loaded on 2 ranks at stage
    1. The weights and the optimizer state, gathered whole, before and after."""
    import torch.distributed as dist

    from dtlab.checkpoint import gather_full_optimizer_state, load_sharded, save_sharded
    from dtlab.zero import FullyShardedDataParallel

    cls, options = EXACT_OPTIMIZERS["adamw"]
    model = FullyShardedDataParallel(branchy_model(), None, dist.group.WORLD, stage=3)
    opt = cls(model.parameters(), **options)
    for step in range(3):
        _branchy_loss(model, step, dist.get_rank(), 4).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_sharded(path, model, opt)
    saved = (model.gather_full_params(), gather_full_optimizer_state(model, opt))
    g2 = _group(2)
    if g2 is None:
        return None
    model = FullyShardedDataParallel(branchy_model(), None, g2, stage=1)
    opt = cls(model.parameters(), **options)
    load_sharded(path, model, opt)
    return saved, (model.gather_full_params(), gather_full_optimizer_state(model, opt))


def test_a_checkpoint_keeps_which_parameters_have_optimizer_state(cluster, tmp_path):
    out = cluster.run(_reshard_branchy, str(tmp_path / "ckpt"), timeout=120)[0]
    (saved_params, saved_state), (params, state) = out
    _assert_params_equal(params, saved_params)
    assert not set(FROZEN) & saved_state.keys()  # never had a gradient: no state
    assert state.keys() == saved_state.keys()
    for name, st in saved_state.items():
        for key, value in st.items():  # re-cut from 4 slices into 2, exactly
            assert torch.equal(state[name][key], value), (name, key)
    assert float(state["blocks.0.side.weight"]["step"]) == 2
    assert float(state["blocks.0.a.weight"]["step"]) == 3


@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16])
def test_the_module_shows_its_local_shards_and_their_gradients(cluster, compute_dtype):
    per_rank = cluster.run(_module_gradients, compute_dtype, timeout=120)[:2]
    _, _, averaged = _same_order_reference("sgd")  # step 0's averaged gradients
    initial = dict(branchy_model().named_parameters())
    for stage in (0, 1, 2, 3):
        for rank, runs in enumerate(per_rank):
            run = runs[stage]
            assert run["back"], (stage, rank)  # the next forward restores them
            for name, s in run["shown"].items():
                where = (stage, rank, name)
                # fp32 master data and gradients, also under bf16 compute
                assert s["dtype"] == torch.float32, where
                assert s["counted"], where  # views of what ZeRO holds: no new bytes
                if name in FROZEN:
                    assert s["grad"] is None, where
                    continue
                assert s["grad_shape"] == s["shape"], where
                assert s["grad_dtype"] == torch.float32, where
                full = averaged[name]
                if stage == 0:  # the whole parameter, as under DDP
                    assert s["shape"] == tuple(initial[name].shape), where
                    assert s["stepped"], where
                    want = full
                elif s["piece"] is None:  # this rank's slice misses it
                    assert s["shape"] == (0,), where
                    continue
                else:  # this rank's piece of it, what the optimizer steps
                    assert s["stepped"], where
                    start, stop = s["piece"]
                    want = full.reshape(-1)[start:stop]
                if compute_dtype is None:
                    assert torch.equal(s["grad"], want), where
        if stage == 0:  # replicated: every rank shows the same averaged gradient
            a, b = (runs[0]["shown"] for runs in per_rank)
            assert all(
                torch.equal(a[k]["grad"], b[k]["grad"]) for k in a if k not in FROZEN
            )
        else:  # the pieces of each parameter, over both ranks, are all of it
            for name in initial:
                if name in FROZEN:
                    continue
                pieces = [runs[stage]["shown"][name]["piece"] for runs in per_rank]
                numel = sum(b - a for a, b in filter(None, pieces))
                assert numel == initial[name].numel(), (stage, name)


# ---- exactness against one process ---------------------------------------------------
def _one_sgd_step(kind):
    """One SGD step of dtlab's TinyMLP on 2 ranks (4 rows of an 8-row batch each)
    through dtlab's DDP (``kind="ddp"``) or ZeRO at stage ``kind``; the weights."""
    from dtlab.ddp import DistributedDataParallel
    from dtlab.model import TinyMLP, regression_batch, shard_batch
    from dtlab.zero import FullyShardedDataParallel

    g = _group(2)
    if g is None:
        return None
    net = TinyMLP()
    if kind == "ddp":
        model = DistributedDataParallel(net, process_group=g)
    else:
        model = FullyShardedDataParallel(net, None, g, stage=kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = shard_batch(*regression_batch(0, 8), torch.distributed.get_rank(), 2)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if kind == "ddp":
        return {k: p.detach().clone() for k, p in net.named_parameters()}
    return model.gather_full_params()


def _one_sgd_step_in_one_process(same_order: bool):
    from dtlab.model import TinyMLP, regression_batch, shard_batch

    net = TinyMLP()
    x, y = regression_batch(0, 8)
    if same_order:  # each rank's 4 rows on their own, halved, added
        halves = []
        for r in range(2):
            net.zero_grad(set_to_none=True)
            xr, yr = shard_batch(x, y, r, 2)
            torch.nn.functional.mse_loss(net(xr), yr).backward()
            halves.append([p.grad / 2 for p in net.parameters()])
        for p, a, b in zip(net.parameters(), *halves):
            p.grad = a + b
    else:  # the whole batch in one backward
        torch.nn.functional.mse_loss(net(x), y).backward()
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    return {k: p.detach().clone() for k, p in net.named_parameters()}


def _row_magnitudes() -> dict:
    """``A = Σ_i |g_i|`` per element, in float64: the size of the 8 per-row terms
    that each parameter's gradient sums (the mean-squared error's 1/64 included)."""
    from dtlab.model import TinyMLP, regression_batch

    net = TinyMLP().double()
    x, y = regression_batch(0, 8)
    x, y = x.double(), y.double()
    total = {k: torch.zeros_like(p) for k, p in net.named_parameters()}
    for i in range(len(x)):
        net.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(
            net(x[i : i + 1]), y[i : i + 1], reduction="sum"
        )
        (loss / y.numel()).backward()
        for k, p in net.named_parameters():
            total[k] += p.grad.abs()
    return total


def test_fp32_zero_is_bit_exact_where_the_order_of_sums_allows(cluster):
    # ZeRO at every stage equals dtlab's DDP bit for bit, and both equal the
    # one-process reference that adds the ranks' halved gradients, on any CPU:
    # neither the flat-buffer views (the matmuls read the weights at any offset and
    # give the same bits), nor dividing after the sum ((a + b)/2 and a/2 + b/2 are
    # the same float for N = 2), nor gloo's reduce-scatter (a + b has one order)
    # round anything.
    runs = {
        k: cluster.run(_one_sgd_step, k, timeout=60)[0] for k in ("ddp", 0, 1, 2, 3)
    }
    same_order = _one_sgd_step_in_one_process(same_order=True)
    whole_batch = _one_sgd_step_in_one_process(same_order=False)
    for params in runs.values():
        _assert_params_equal(params, same_order)
        _assert_params_equal(params, runs["ddp"])
    # What differs is the whole-batch reference: its backward sums the 8 rows' terms
    # g_i of each gradient in one matmul, which 2 ranks sum as two groups of 4 added
    # afterwards. The terms themselves are the same bits in both (a row's forward
    # and input gradient never sum over other rows: batch rows are the matmuls' M
    # dimension, not their reduction; the losses' 1/32 and 1/64 are powers of two),
    # so only the order of 7 fp32 additions differs, each order within
    # γ_7·A of the exact sum, A = Σ|g_i| (Higham, Accuracy and Stability, §4.2, for
    # any order): |Δg| ≤ 2·γ_7·A. One SGD step rounds lr·g and w − lr·g once each
    # side: |Δw| ≤ lr·2γ_7·A + u·lr·(|g|+|g'|) + u·(|w|+|w'|). How many ulps that is
    # depends on the weight's size, not on the sum (proj.bias, near 3e-3, is 13 ulps
    # off on an AMD EPYC, 4 on the CPU where a 4-ulp bound was once measured): the
    # bound is in absolute terms. Measured on the EPYC with ATen's default, AVX2 and
    # AVX-512 kernels: |Δg| ≤ 1.96·u·A (the bound allows 14·u·A).
    u = 2.0**-24
    gamma7 = 7 * u / (1 - 7 * u)
    lr = 0.1
    magnitudes = _row_magnitudes()
    start = _initial_weights()
    for k, a in magnitudes.items():
        w_ours, w_whole = runs[3][k].double(), whole_batch[k].double()
        w0 = start[k].double()
        g_ours, g_whole = (w0 - w_ours) / lr, (w0 - w_whole) / lr  # the steps taken
        bound = lr * 2 * gamma7 * a
        bound += u * lr * (g_ours.abs() + g_whole.abs())
        bound += u * (w_ours.abs() + w_whole.abs())
        assert ((w_ours - w_whole).abs() <= bound).all(), k
        # no blanket: a step whose gradient is 1e-5 off (~170 ulps) breaks the bound
        w_off = w0 - (w0 - w_whole) * (1 + 1e-5)
        assert ((w_off - w_whole).abs() > bound).any(), k


def _initial_weights() -> dict:
    from dtlab.model import TinyMLP

    return {k: p.detach().clone() for k, p in TinyMLP().named_parameters()}

"""dtlab.tensor_parallel: every layer shard by shard against its unsharded layer, the
whole GPT under tp=2 and tp=4 against the single-process model and the reference
trainer, sequence parallelism against plain TP, a Column+Row pair against PyTorch's
DTensor tensor parallel, and the collectives each layer runs against
dtlab.estimate.

Tolerances. At tp=1 the TP model is the GPT bit for bit (``torch.equal``). At tp>1
two things change the order of fp32 sums, so results differ by rounding only:
a row-parallel layer adds t partial products ``Σ_i X_i·A_i`` instead of one long dot
product, and the matmul kernels tile a narrower shard differently. The error of a
sum of n fp32 terms is about ``n · eps · Σ|terms|`` with eps = 1.2e-7; our sums
have n <= 256 terms of magnitude <= ~1, so we allow ``atol=1e-6`` (and ``rtol=1e-5``)
on activations and gradients. Training is different: AdamW divides each gradient
element by its running RMS, so an element whose gradient is near rounding level
(k's bias has an exact gradient of zero: softmax ignores a constant per query) moves
by up to ``lr`` per step in a direction rounding decides. Losses and gradient norms
still agree to 1e-5 and 1e-4 relative; weights after 4 steps at lr=1e-3 are allowed
``atol=2e-4`` (= lr/5, well under the 2·lr·steps = 8e-3 a sign flip could cost;
measured: at most 4.3e-5).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtlab import comm, estimate, telemetry
from dtlab.model import GPT, MLP, CausalSelfAttention, GPTConfig, SyntheticTokens
from dtlab.tensor_parallel import (
    ColumnParallelLinear,
    ParallelDropout,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    TensorParallelStage,
    TPRandom,
    VocabParallelEmbedding,
    copy_to_tp,
    load_shards_,
    reduce_from_tp,
    tensor_parallel_gpt,
    tp_train_step,
    vocab_parallel_cross_entropy,
)
from dtlab.topology import Layout, Topology

TOL = dict(rtol=1e-5, atol=1e-6)  # see the module docstring
CFG = GPTConfig(vocab_size=50)  # 50 does not divide by 4: the vocab gets padded to 52


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _topo(tp):
    """All 4 ranks: dp = 4 / tp replicas of a tp group (rank order: tp fastest)."""
    import torch.distributed as dist

    return Topology(Layout(dp=dist.get_world_size() // tp, tp=tp))


def _close(a, b, **tol):
    """Max |a - b| if within tolerance, else raise with the numbers."""
    torch.testing.assert_close(a, b, **(tol or TOL))
    return float((a - b).abs().max()) if a.numel() else 0.0


# ---- run on every rank -------------------------------------------------------------
def _operators(tp):
    """f and g by themselves: what crosses ranks forward and backward."""
    axis = _topo(tp).axis("tp")
    r = float(axis.index + 1)
    x = torch.full((3,), r, requires_grad=True)
    y = copy_to_tp(x, axis)  # f
    (y * r).sum().backward()  # each rank's dL/dy = r
    f_out = (torch.equal(y, x), x.grad.tolist())
    x = torch.full((3,), r, requires_grad=True)
    y = reduce_from_tp(x, axis)  # g
    (y * r).sum().backward()
    return {"f": f_out, "g": (y.tolist(), x.grad.tolist())}


def _linear(tp):
    """Column and row parallel linears against one nn.Linear, shard by shard."""
    axis = _topo(tp).axis("tp")
    i, out = axis.index, {}
    mine = lambda t, dim: t.chunk(tp, dim)[i]  # noqa: E731

    def full(d_in, d_out, seed):
        lin = nn.Linear(d_in, d_out)
        with torch.no_grad():
            lin.weight.copy_(_rand(d_out, d_in, seed=seed))
            lin.bias.copy_(_rand(d_out, seed=seed + 1))
        x = _rand(3, 5, d_in, seed=seed + 2).requires_grad_()
        gy = _rand(3, 5, d_out, seed=seed + 3)
        lin(x).backward(gy)
        return lin, x, gy

    lin, x, gy = full(16, 24, 10)
    y_full = lin(x)
    for gather in (False, True):  # Y_i = X A_i, and gathered into the whole Y
        col = ColumnParallelLinear.from_linear(lin, axis, gather_output=gather)
        xl = x.detach().clone().requires_grad_()
        y = col(xl)
        y.backward(gy if gather else mine(gy, -1))
        out[f"column gather={gather}"] = [
            _close(y, y_full if gather else mine(y_full, -1)),
            _close(xl.grad, x.grad),  # f's all-reduce completed dL/dX
            _close(col.weight.grad, mine(lin.weight.grad, 0)),
            _close(col.bias.grad, mine(lin.bias.grad, 0)),
        ]
    lin, x, gy = full(24, 16, 20)
    y_full = lin(x)
    for parallel_in in (True, False):  # X already split, or split on entry
        row = RowParallelLinear.from_linear(lin, axis, input_is_parallel=parallel_in)
        xl = (mine(x.detach(), -1) if parallel_in else x.detach()).clone()
        xl.requires_grad_()
        y = row(xl)
        y.backward(gy)
        out[f"row parallel_in={parallel_in}"] = [
            _close(y, y_full),  # bias added once, after g
            _close(xl.grad, mine(x.grad, -1) if parallel_in else x.grad),
            _close(row.weight.grad, mine(lin.weight.grad, 1)),
            _close(row.bias.grad, lin.bias.grad),
        ]
    return out


def _blocks(tp, sp):
    """ParallelMLP and ParallelSelfAttention against dtlab.model's MLP and attention
    (same weights), plain TP and sequence parallel."""
    axis = _topo(tp).axis("tp")
    rng = TPRandom(0, axis)
    cfg = GPTConfig(d_model=32, n_heads=4, seq_len=8)
    out = {}
    torch.manual_seed(0)  # torch's default init: the same full layer on every rank
    for kind in ("mlp", "attn"):
        if kind == "mlp":
            full = MLP(cfg)
            par = ParallelMLP(32, cfg.d_ff, axis, rng, sequence_parallel=sp)
        else:
            full = CausalSelfAttention(cfg)
            with torch.no_grad():  # non-zero biases, so a bias added twice shows
                for p in full.parameters():
                    p.add_(0.1 * _rand(*p.shape, seed=p.numel()))
            par = ParallelSelfAttention(32, 4, axis, rng, sequence_parallel=sp)
        load_shards_(par, full, axis)
        x = _rand(2, 8, 32, seed=5).requires_grad_()
        gy = _rand(2, 8, 32, seed=6)
        y_full = full(x)
        y_full.backward(gy)
        xl = x.detach().clone()
        if sp:  # the input and output are this rank's sequence slice
            xl, gy, y_full = (t.chunk(tp, 1)[axis.index] for t in (xl, gy, y_full))
        xl.requires_grad_()
        y = par(xl)
        y.backward(gy)
        if sp:
            par_grads = {n: p.grad.clone() for n, p in par.named_parameters()}
            # the row-parallel bias saw only my tokens: sum its grad over tp
            b = par_grads["proj.bias"]
            comm.all_reduce(b, group=axis)
        else:
            par_grads = {n: p.grad for n, p in par.named_parameters()}
        want_dx = x.grad.chunk(tp, 1)[axis.index] if sp else x.grad
        diffs = [_close(y, y_full), _close(xl.grad, want_dx)]
        for name, p in full.named_parameters():
            q = dict(par.named_parameters())[name]
            dim = getattr(q, "tensor_parallel_dim", None)
            want = p.grad if dim is None else p.grad.chunk(tp, dim)[axis.index]
            diffs.append(_close(par_grads[name], want))
        out[kind] = diffs
    return out


def _vocab(tp):
    """VocabParallelEmbedding and the vocab-parallel cross-entropy against
    nn.Embedding and F.cross_entropy, with a vocabulary that needs padding."""
    axis = _topo(tp).axis("tp")
    V, C = 50, 8
    emb = nn.Embedding(V, C)
    with torch.no_grad():
        emb.weight.copy_(_rand(V, C, seed=1))
    idx = torch.randint(V, (3, 7), generator=torch.Generator().manual_seed(2))
    gy = _rand(3, 7, C, seed=3)
    emb(idx).backward(gy)
    par = VocabParallelEmbedding.from_embedding(emb, axis)
    y = par(idx)
    y.backward(gy)
    padded = torch.cat([emb.weight.grad, torch.zeros(par.padded_size - V, C)])
    want_dw = padded.chunk(tp, 0)[axis.index]
    out = {
        "padded_size": par.padded_size,
        "embedding": [_close(y, emb(idx)), _close(par.weight.grad, want_dw)],
    }
    logits = (3 * _rand(4, 6, V, seed=4)).requires_grad_()
    targets = torch.randint(V, (4, 6), generator=torch.Generator().manual_seed(5))
    targets[0, :4] = torch.tensor([0, V - 1, par.per_rank - 1, par.per_rank])  # edges
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
    loss.backward()
    pad = torch.full((4, 6, par.padded_size - V), 123.0)  # junk: must be masked
    local = torch.cat([logits.detach(), pad], -1).chunk(tp, -1)[axis.index]
    local.requires_grad_()
    tp_loss = vocab_parallel_cross_entropy(local, targets, axis, V)
    tp_loss.backward()
    grad_full = torch.cat([logits.grad, torch.zeros_like(pad)], -1)
    out["cross_entropy"] = [
        _close(tp_loss, loss),
        _close(local.grad, grad_full.chunk(tp, -1)[axis.index]),
    ]
    out["local_logits_width"] = local.shape[-1]
    return out


def _gpt(tp):
    """Loss and every gradient of the TP GPT (plain and SP) against the
    single-process GPT on the same batch; SP against plain TP."""
    topo = _topo(tp)
    model = GPT(CFG)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, 4)
    logits, loss = model(x, y)
    loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    out, grads = {"loss": loss.item()}, {}
    for sp in (False, True):
        tp_model = tensor_parallel_gpt(model, topo, sequence_parallel=sp)
        local_logits, tp_loss = tp_model(x, y)
        tp_loss.backward()
        tp_model.finish_gradient_synchronization()
        tp_model.finish_gradient_synchronization()  # idempotent
        got = tp_model.full_tensors(grads=True)
        assert got.keys() == want.keys()
        grads[sp] = got
        out[f"sp={sp}"] = {
            "loss": tp_loss.item(),
            "logits": _close(tp_model.gather_logits(local_logits), logits),
            "local_vocab": local_logits.shape[-1],
            "grads": {n: _close(got[n], want[n]) for n in want},
        }
    out["sp_vs_tp"] = max(_close(grads[True][n], grads[False][n]) for n in want)
    return out


def _train(tp, sp, steps, batch):
    """A few AdamW steps with the reference's optimizer settings."""
    from dtlab.reference import make_optimizer

    topo = _topo(tp)
    model = tensor_parallel_gpt(CFG, topo, sequence_parallel=sp)
    opt = make_optimizer(model.parameters())
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    records = [tp_train_step(model, opt, *data.batch(s, batch)) for s in range(steps)]
    return records, model.full_tensors()


def _counts(tp, sp):
    """Telemetry of one forward + backward of the TP GPT."""
    topo = _topo(tp)
    model = tensor_parallel_gpt(CFG, topo, sequence_parallel=sp)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, 4)
    rec = telemetry.Recorder(topo.rank)
    with telemetry.use(rec):
        _, loss = model(x, y)
        loss.backward()
        model.finish_gradient_synchronization()
    return [e for e in rec.events if e["kind"] == "comm"]


def _sp_sum_timings(tp):
    """The SP gradient sum once after backward (coalesced) and in backward (a hook
    per parameter): the same gradients, and what each sends."""
    topo = _topo(tp)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, 4)
    out = {}
    for mode in ("after", "in"):
        model = tensor_parallel_gpt(GPT(CFG), topo, sequence_parallel=True)
        if mode == "in":
            model.sum_sequence_parallel_grads_in_backward()
            model.sum_sequence_parallel_grads_in_backward()  # asked twice: once
        rec = telemetry.Recorder(topo.rank)
        with telemetry.use(rec):
            _, loss = model(x, y)
            loss.backward()
            model.finish_gradient_synchronization()  # nothing left in backward mode
        sums = [e for e in rec.events if e["kind"] == "comm" and e["tag"] == "sp_grads"]
        out[mode] = {
            "grads": model.full_tensors(grads=True),
            "calls": len(sums),
            "payload": sum(e["payload_bytes"] for e in sums),
            "params": len(model._sequence_parallel_params()),
        }
    return out


def _dropout(tp):
    """Masks: equal across the tp group where activations are replicated, different
    where they are sharded; the replicated residual stream stays equal."""
    topo = _topo(tp)
    axis = topo.axis("tp")
    rng = TPRandom(7, axis)
    ones = torch.ones(4, 64)
    masks = {s: ParallelDropout(0.5, rng, sharded=s)(ones) for s in (False, True)}
    cfg = GPTConfig(vocab_size=50, dropout=0.2)
    model = tensor_parallel_gpt(cfg, topo, seed=3)
    seen = []
    model.ln_f.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(0, 2)
    model(x, y)
    model.eval()
    model(x, y)  # eval: no dropout at all
    return masks, seen


def _dtensor(tp):
    """dtlab's Column+Row MLP against DTensor's ColwiseParallel/RowwiseParallel."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    topo = _topo(tp)
    axis = topo.axis("tp")
    cfg = GPTConfig(d_model=32, n_heads=4)
    torch.manual_seed(0)  # the same full MLP on every rank
    full = MLP(cfg)
    ours = load_shards_(ParallelMLP(32, 128, axis, TPRandom(0, axis)), full, axis)
    mesh = DeviceMesh.from_group(topo.group("tp"), "cpu")
    theirs = parallelize_module(
        full, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()}
    )
    x = _rand(2, 8, 32, seed=1)
    gy = _rand(2, 8, 32, seed=2)
    y_ours, y_theirs = ours(x), theirs(x)
    y_ours.backward(gy)
    y_theirs.backward(gy)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    out = {"y": _close(y_ours, local(y_theirs))}
    for name, p in ours.named_parameters():
        q = dict(theirs.named_parameters())[name]
        assert local(q).shape == p.shape, (name, local(q).shape, p.shape)
        out[name] = (
            _close(p.detach(), local(q).detach()),
            _close(p.grad, local(q.grad)),
        )
    return out


# ---- tests -------------------------------------------------------------------------
pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("tp", [2, 4])
def test_f_and_g_operators(lab_cluster, tp):
    for rank, res in enumerate(lab_cluster(4).run(_operators, tp)):
        group = [float(i + 1) for i in range(tp)]
        r = float(rank % tp + 1)
        # f: identity forward, sum of every rank's gradient backward
        assert res["f"] == (True, [sum(group)] * 3)
        # g: sum forward, the rank's own gradient unchanged backward
        assert res["g"] == ([sum(group)] * 3, [r] * 3)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_linear_shard_by_shard(lab_cluster, tp):
    results = lab_cluster(4).run(_linear, tp)
    for res in results:  # _close raised on any rank out of tolerance
        assert set(res) == {
            "column gather=False",
            "column gather=True",
            "row parallel_in=True",
            "row parallel_in=False",
        }
        assert all(len(v) == 4 for v in res.values())


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_parallel_mlp_and_attention_match_the_model(lab_cluster, tp, sp):
    for res in lab_cluster(4).run(_blocks, tp, sp):
        assert len(res["mlp"]) == 2 + 4 and len(res["attn"]) == 2 + 8


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy_with_padding(lab_cluster, tp):
    for res in lab_cluster(4).run(_vocab, tp):
        assert res["padded_size"] == (50 if tp == 2 else 52)
        # no rank ever held more than its V'/t columns of logits
        assert res["local_logits_width"] == res["padded_size"] // tp


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_loss_logits_and_grads_match_single_process(lab_cluster, tp):
    for res in lab_cluster(4).run(_gpt, tp):
        for sp in (False, True):
            got = res[f"sp={sp}"]
            assert got["loss"] == pytest.approx(res["loss"], rel=1e-6)
            assert got["local_vocab"] == (52 if tp == 4 else 50) // tp
            assert len(got["grads"]) == len(list(GPT(CFG).parameters()))
        assert res["sp_vs_tp"] < 1e-6  # sequence parallelism is plain TP, reordered


def test_tp1_is_the_gpt_bit_for_bit():
    topo = Topology(Layout(), 0)  # no process group needed: nothing to exchange
    for cfg in (CFG, GPTConfig(tied_head=False)):
        model = GPT(cfg)
        tp_model = tensor_parallel_gpt(model, topo)
        x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(1, 3)
        logits, loss = model(x, y)
        tp_logits, tp_loss = tp_model(x, y)
        loss.backward()
        tp_loss.backward()
        assert torch.equal(tp_logits, logits) and torch.equal(tp_loss, loss)
        got = tp_model.full_tensors(grads=True)
        for name, p in model.named_parameters():
            assert torch.equal(got[name], p.grad), name


def test_pipeline_stages_at_tp1_are_the_gpt_bit_for_bit():
    # the stage class the whole GPT is made of also splits pipeline stages: two
    # stages of a plain pipeline, each through from_stage, chained, are the GPT
    from dtlab.pipeline import build_stages

    axis = Topology(Layout(), 0).axis("tp")
    model = GPT(CFG)
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(1, 3)
    logits, loss = model(x, y)
    first, last = (
        TensorParallelStage.from_stage(build_stages(CFG, 2, r)[0], axis) for r in (0, 1)
    )
    assert (first.first, first.last, last.first, last.last) == (
        True,
        False,
        False,
        True,
    )
    assert list(last.blocks) == ["1"] and last.blocks[1] is last.blocks["1"]
    h = first(x)  # (B, T, C): activations, handed to the next stage
    assert h.shape == (3, CFG.seq_len, CFG.d_model)
    assert torch.equal(last(h), logits)  # no targets: the logits alone
    got_logits, got_loss = last(h, y)  # with targets: (logits, loss), as GPT
    assert torch.equal(got_logits, logits) and torch.equal(got_loss, loss)
    assert torch.equal(last.loss(got_logits, y), loss)
    # the tied head copy reports the GPT's name, as StageModule's does
    assert "wte.weight" in dict(last.global_named_parameters())


def test_the_old_public_names_still_work():
    import dtlab.tensor_parallel as package

    old = """copy_to_tp reduce_from_tp gather_from_tp scatter_to_tp gather_from_sp
    reduce_scatter_to_sp TPRandom ParallelDropout ColumnParallelLinear
    RowParallelLinear ParallelMLP ParallelSelfAttention VocabParallelEmbedding
    vocab_parallel_cross_entropy ParallelBlock TensorParallelGPT TensorParallelStage
    tensor_parallel_gpt load_shards_ tp_train_step tp_grad_norm""".split()
    assert set(old) <= set(package.__all__)
    assert all(hasattr(package, name) for name in package.__all__)
    # TensorParallelGPT(config, topo) builds the whole GPT as one stage
    model = package.TensorParallelGPT(CFG, Topology(Layout(tp=2), 0))
    assert isinstance(model, TensorParallelStage) and model.first and model.last
    assert len(model.blocks) == CFG.n_layers


@pytest.mark.parametrize("tp,sp", [(2, False), (4, True)])
def test_training_steps_match_the_reference(lab_cluster, tp, sp):
    from dtlab.reference import train_reference

    steps, batch = 4, 8
    ref = train_reference(CFG, steps=steps, global_batch_size=batch)
    results = lab_cluster(4).run(_train, tp, sp, steps, batch)
    for records, weights in results:
        assert [r["loss"] for r in records] == pytest.approx(ref.losses, rel=1e-5)
        norms = [r["grad_norm"] for r in ref.records]
        assert [r["grad_norm"] for r in records] == pytest.approx(norms, rel=1e-4)
        for name, p in ref.model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=2e-4)
    assert ref.losses[-1] < ref.losses[0]  # it learned something meanwhile


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_collectives_per_layer_match_the_estimate(lab_cluster, sp):
    tp, B, T, C = 4, 4, CFG.seq_len, CFG.d_model
    events = lab_cluster(4).run(_counts, tp, sp)
    expected = estimate.tp_collectives_per_layer(sp)
    predicted = estimate.tp_bytes_per_layer(
        B, T, C, tp, bytes_per_value=4, sequence_parallel=sp
    )
    for rank_events in events:
        assert all(e["axis"] == "tp" for e in rank_events)
        for layer in range(CFG.n_layers):
            mine = [e for e in rank_events if e["tag"].startswith(f"blocks.{layer}.")]
            for phase, passname in (("fwd", "forward"), ("bwd", "backward")):
                ops = {}
                for e in mine:
                    if e["tag"].endswith(":" + phase):
                        ops[e["op"]] = ops.get(e["op"], 0) + 1
                assert ops == expected[passname], (layer, phase, ops)
            assert {e["payload_bytes"] for e in mine} == {predicted["payload_bytes"]}
            assert sum(e["wire_bytes"] for e in mine) == pytest.approx(
                predicted["wire_bytes"]
            )
        # outside the layers: the embedding's g (or ḡ), the head's f (or SP gather),
        # three one-number-per-token all-reduces in the loss, and under SP one
        # coalesced all-reduce of the LayerNorm/bias/position gradients
        outside = [e for e in rank_events if not e["tag"].startswith("blocks.")]
        other = sorted((e["tag"], e["op"]) for e in outside)
        if sp:
            assert other == [
                ("head:bwd", "reduce_scatter"),
                ("head:fwd", "all_gather"),
                *[("loss:fwd", "all_reduce")] * 3,
                ("sp_grads", "all_reduce"),
                ("wte:bwd", "all_gather"),
                ("wte:fwd", "reduce_scatter"),
            ]
        else:
            assert other == [
                ("head:bwd", "all_reduce"),
                *[("loss:fwd", "all_reduce")] * 3,
                ("wte:fwd", "all_reduce"),
            ]


def test_sp_gradient_sum_after_or_in_backward_gives_the_same_gradients(lab_cluster):
    """parallelize moves the sum into backward (its wrappers take gradients there):
    the same sum, bit for bit (two addends commute), one all-reduce per parameter
    instead of one coalesced, the same bytes; never summed twice."""
    for res in lab_cluster(4).run(_sp_sum_timings, 2):
        after, inside = res["after"], res["in"]
        assert after["grads"].keys() == inside["grads"].keys()
        for name, g in after["grads"].items():
            assert torch.equal(g, inside["grads"][name]), name
        assert after["calls"] == 1 and inside["calls"] == inside["params"] > 1
        assert after["payload"] == inside["payload"] > 0


def test_dropout_masks_replicated_vs_sharded(lab_cluster):
    results = lab_cluster(4).run(_dropout, 2)
    for group in ([0, 1], [2, 3]):  # the tp groups of Layout(dp=2, tp=2)
        a, b = (results[r] for r in group)
        assert torch.equal(a[0][False], b[0][False])  # replicated: one mask
        assert not torch.equal(a[0][True], b[0][True])  # sharded: its own mask
        for x, y in zip(a[1], b[1]):  # the residual stream stays identical
            assert torch.equal(x, y)
    train, evaluation = results[0][1]
    assert not torch.equal(train, evaluation)  # dropout was on, then off


def test_column_row_pair_matches_dtensor_tensor_parallel(lab_cluster):
    for res in lab_cluster(4).run(_dtensor, 4):
        assert set(res) == {"y", "fc.weight", "fc.bias", "proj.weight", "proj.bias"}
        # the same split and the same shards (weights bit for bit), but DTensor
        # dispatches its own kernels and reductions, so outputs and gradients agree
        # to rounding (_close, TOL) rather than bitwise (measured: <= 6e-8)
        assert all(res[n][0] == 0.0 for n in res if n != "y"), res


def test_bench_compares_with_dtensor_on_the_same_blocks(lab_cluster):
    from dtlab.bench.tensor_parallel import time_blocks

    res = lab_cluster(4).run(time_blocks, 32, 4, 2, 16, 1, 0)
    for kind in ("mlp", "attention"):
        assert res[0][kind]["max_abs_diff"] < 1e-5  # same weights, same output
        assert res[0][kind]["dtlab_s"] > 0 and res[0][kind]["dtensor_s"] > 0


def test_standalone_layers_draw_one_consistent_full_matrix():
    # built without a full model, the shards of every rank still form one matrix:
    # each rank draws the whole matrix from (seed, name) and keeps its slice
    def shards(tp, cls, name):
        return [
            cls(8, 16, Topology(Layout(tp=tp), r).axis("tp"), name=name).weight
            for r in range(tp)
        ]

    whole = shards(1, ColumnParallelLinear, "fc")[0]
    assert torch.equal(torch.cat(shards(4, ColumnParallelLinear, "fc"), 0), whole)
    whole = shards(1, RowParallelLinear, "proj")[0]
    assert torch.equal(torch.cat(shards(4, RowParallelLinear, "proj"), 1), whole)
    axis = Topology(Layout(), 0).axis("tp")
    attn = ParallelSelfAttention(16, 4, axis, TPRandom(0, axis))
    assert not torch.equal(attn.q.weight, attn.k.weight)  # each layer its own draw


def test_bad_sizes_raise_clear_errors():
    axis = Topology(Layout(tp=4), 0).axis("tp")  # rank arithmetic only
    rng = TPRandom(0, axis)
    with pytest.raises(ValueError, match="tp=4 does not divide n_heads=6"):
        ParallelSelfAttention(48, 6, axis, rng)
    with pytest.raises(ValueError, match="does not divide out_features=10"):
        ColumnParallelLinear(8, 10, axis)
    with pytest.raises(ValueError, match="does not divide in_features=6"):
        RowParallelLinear(6, 8, axis)
    with pytest.raises(ValueError, match="seq_len=30"):
        TensorParallelStage(GPTConfig(seq_len=30), axis, sequence_parallel=True)
    with pytest.raises(ValueError, match="dropout"):
        ParallelDropout(1.0, rng, sharded=False)
    with pytest.raises(ValueError, match="do not match logits"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 4), axis)


def test_tp_estimates():
    # Megatron: 2 all-reduces forward and 2 backward; SP swaps each for AG + RS
    assert estimate.tp_collectives_per_layer() == {
        "forward": {"all_reduce": 2},
        "backward": {"all_reduce": 2},
    }
    b, s, h, t = 1, 2048, 12288, 8  # a GPT-3 175B layer on 8 GPUs, bf16
    S = b * s * h * 2
    plain = estimate.tp_bytes_per_layer(b, s, h, t)
    sp = estimate.tp_bytes_per_layer(b, s, h, t, sequence_parallel=True)
    assert plain["payload_bytes"] == S
    assert plain["wire_bytes"] == pytest.approx(4 * 2 * (t - 1) / t * S)
    assert sp["wire_bytes"] == pytest.approx(plain["wire_bytes"])  # same bytes
    # Narayanan et al.: 72·b·s·h²·(1 + s/6h) per layer
    assert estimate.tp_layer_flops(b, s, h) == pytest.approx(
        72 * b * s * h**2 * (1 + s / (6 * h))
    )
    times = {k: estimate.tp_step_time(96, b, s, h, t, link=k) for k in estimate.LINKS}
    assert (
        times["nvlink"]["comm_fraction"]
        < 0.25
        < times["infiniband"]["comm_fraction"]
        < times["ethernet"]["comm_fraction"]
    )
    assert times["nvlink"]["compute_s"] == times["ethernet"]["compute_s"]
    with pytest.raises(ValueError, match="unknown link"):
        estimate.tp_step_time(1, 1, 8, 8, 2, link="carrier pigeon")
    # parameters per rank: exact for dtlab's GPT, model_params at tp=1
    for cfg in (CFG, GPTConfig(tied_head=False, bias=False)):
        kw = dict(
            seq_len=cfg.seq_len,
            d_ff=cfg.d_ff,
            bias=cfg.bias,
            layernorm=True,
            tied_embeddings=cfg.tied_head,
        )
        assert (
            estimate.tp_params_per_rank(
                cfg.n_layers, cfg.d_model, cfg.vocab_size, 1, **kw
            )
            == cfg.n_params()
        )
        for tp in (2, 4):
            topo = Topology(Layout(tp=tp), 0)
            held = sum(p.numel() for p in tensor_parallel_gpt(cfg, topo).parameters())
            assert held == estimate.tp_params_per_rank(
                cfg.n_layers, cfg.d_model, cfg.vocab_size, tp, **kw
            )

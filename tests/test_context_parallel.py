"""dtlab.context_parallel: the load-balanced layout and the ring's schedule as data,
the online-softmax merge and one block's backward against autograd, ring attention
and Ulysses at cp = 2 and 4 against the single-process GPT (loss, logits, every
gradient), their bytes per rank against dtlab.estimate, and their saved
activations against Korthikanti's count.

Tolerances. Ulysses runs the model's own attention core on nh/cp heads of the
whole sequence: its logits are the single process's bit for bit (measured: 0.0).
Ring attention computes each query's softmax in up to 2·cp - 1 pieces, each
normalised by its own log-sum-exp and merged with ``exp(lse_b - lse)`` weights:
a few more roundings per element than one softmax, each of relative size eps =
1.2e-7 (measured: logits within 3e-7 of values of magnitude ~1). Both variants then
sum each weight's gradient in cp partial sums (one per rank, over its tokens) and
add them in the all-reduce, where the single process adds the same terms in one
order: the error of a sum of n fp32 terms is about ``n · eps · Σ|terms|``, n <= 64
here. As in tests/test_tensor_parallel.py we allow ``atol=1e-6`` and
``rtol=1e-5``. Measured: logits within 3.0e-7 (ring; Ulysses 0), gradients within
7.5e-8 absolute and 6.1e-7 relative to each tensor's largest entry (k's bias left
out: its exact gradient is zero, softmax ignores a constant per query), the mean of
the cp ranks' losses within 2.4e-7 of the single process's 4.2.

Bytes are integers (multiples of 4 bytes times (N-1)/N for N in {2, 4}), so the
measured sums equal the estimates exactly.
"""

import math

import pytest
import torch

from dtlab import estimate
from dtlab.context_parallel import (
    ContextParallelAttention,
    block_attention,
    block_attention_backward,
    context_parallel_gpt,
    local_positions,
    merge_attention_blocks,
    ring_schedule,
    sequence_chunks,
    shard_sequence,
)
from dtlab.model import GPT, CausalSelfAttention, GPTConfig, SyntheticTokens
from dtlab.topology import Axis, Layout, Topology

TOL = dict(rtol=1e-5, atol=1e-6)  # see the module docstring
CFG = GPTConfig(seq_len=32, n_heads=4, d_model=64, n_layers=2)
BATCH = 2


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _diff(a, b):
    """(max |a - b|, max |b|), after checking the tolerance."""
    torch.testing.assert_close(a, b, **TOL)
    return float((a - b).detach().abs().max()), float(b.detach().abs().max())


def _one_rank():
    """A cp group of one rank: no process group at all."""
    return Topology(Layout(), 0).axis("dp")


# ---- the layout and the schedule, no process group needed ------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_load_balanced_layout_pairs_an_early_and_a_late_chunk(cp):
    T = 8 * cp
    seen = []
    for i in range(cp):
        assert sequence_chunks(cp, i, True) == (i, 2 * cp - 1 - i)
        assert sequence_chunks(cp, i, False) == (i,)
        pos = local_positions(T, cp, i, True)
        c = T // (2 * cp)
        assert pos.tolist() == list(range(i * c, (i + 1) * c)) + list(
            range((2 * cp - 1 - i) * c, (2 * cp - i) * c)
        )
        seen += pos.tolist()
    assert sorted(seen) == list(range(T))  # every token on exactly one rank


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_schedule_computes_the_causal_mask_once_and_evenly(cp):
    c = 3  # tokens per chunk
    T = 2 * c * cp
    rows = {"both": slice(None), "early": slice(0, c), "late": slice(c, 2 * c)}
    work = []
    for i in range(cp):
        mine = local_positions(T, cp, i, True)
        pairs, scores = set(), 0
        steps = ring_schedule(cp, i)
        assert [s.source for s in steps] == [(i - s) % cp for s in range(cp)]
        for st in steps:
            theirs = local_positions(T, cp, st.source, True)
            qs, ks = mine[rows[st.queries]], theirs[rows[st.keys]]
            scores += len(qs) * len(ks)
            for q in qs.tolist():
                for k in ks.tolist():
                    if st.causal and k > q:
                        continue
                    assert k <= q, (i, st)  # an unmasked block is all visible
                    assert (q, k) not in pairs  # no pair computed twice
                    pairs.add((q, k))
        # every (query, key) pair the causal mask allows, and only those
        assert pairs == {(q, k) for q in mine.tolist() for k in range(q + 1)}
        work.append(scores)
    # the point of the zigzag: every rank computes the same number of scores,
    # its own block (2c)^2 and half a block 2c^2 per other rank
    assert work == [(2 * c) ** 2 + (cp - 1) * 2 * c * c] * cp


def test_merging_two_blocks_is_attention_over_both():
    q, k, v = (_rand(2, 3, 5, 4, seed=s) for s in range(3))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(4)
    want = torch.softmax(scores, -1) @ v
    out_a, lse_a = block_attention(q, k[..., :2, :], v[..., :2, :])
    out_b, lse_b = block_attention(q, k[..., 2:, :], v[..., 2:, :])
    out, lse = merge_attention_blocks(out_a, lse_a, out_b, lse_b)
    _diff(out, want)
    _diff(lse, torch.logsumexp(scores, -1))


def test_block_backward_matches_autograd():
    q, k, v = (_rand(2, 3, 6, 4, seed=s).requires_grad_() for s in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    out, lse = block_attention(q, k, v, mask)
    dout = _rand(2, 3, 6, 4, seed=9)
    out.backward(dout)
    delta = (dout * out.detach()).sum(-1)
    got = block_attention_backward(dout, q, k, v, lse.detach(), delta, mask)
    for mine, ref in zip(got, (q.grad, k.grad, v.grad)):
        _diff(mine, ref)


def test_cp1_ulysses_is_the_gpt_bit_for_bit_and_the_ring_within_rounding():
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    ref = GPT(CFG)
    logits, loss = ref(x, y)
    loss.backward()
    for variant in ("ulysses", "ring"):
        model = context_parallel_gpt(GPT(CFG), _one_rank(), variant)
        assert isinstance(model.module.blocks[0].attn, CausalSelfAttention)
        got_logits, got_loss = model(model.shard(x), model.shard(y))
        got_loss.backward()
        model.finish_gradient_synchronization()  # one rank: nothing to do
        grads = [p.grad for p in model.module.parameters()]
        if variant == "ulysses":
            assert torch.equal(got_logits, logits) and torch.equal(got_loss, loss)
            assert all(torch.equal(a, p.grad) for a, p in zip(grads, ref.parameters()))
        else:
            _diff(got_logits, logits)
            for a, p in zip(grads, ref.parameters()):
                _diff(a, p.grad)
    # same weights, same names: the CP model's state dict is the GPT's
    assert model.module.state_dict().keys() == ref.state_dict().keys()


def test_bad_input_is_refused_clearly():
    three = Axis("cp", (0, 1, 2), 0)  # no process group is needed to refuse
    with pytest.raises(ValueError, match="n_heads=4 is not a multiple"):
        context_parallel_gpt(GPT(CFG), three, "ulysses")
    with pytest.raises(ValueError, match="multiple of 6"):
        shard_sequence(torch.zeros(1, 32), three, "ring")  # 2·cp chunks
    with pytest.raises(ValueError, match="unknown context-parallel variant"):
        context_parallel_gpt(GPT(CFG), _one_rank(), "tree")
    attn = GPT(GPTConfig(dropout=0.1)).blocks[0].attn
    with pytest.raises(ValueError, match="no attention dropout"):
        ContextParallelAttention(attn, _one_rank(), "ring")
    model = context_parallel_gpt(GPT(CFG), _one_rank())
    with pytest.raises(ValueError, match="exceeds the model's seq_len=32"):
        model(torch.zeros(1, 34, dtype=torch.long))


def test_estimates_by_hand_and_the_planner_agrees():
    b, s, h, cp, L = 2, 32, 64, 4, 2
    block = 2 * b * (s // cp) * h * 4  # K and V of one rank, fp32
    ring = estimate.cp_bytes_per_layer(b, s, h, cp)
    assert ring["forward"] == 3 * block and ring["backward"] == 6 * block
    assert ring["ops"] == 9
    uly = estimate.cp_bytes_per_layer(b, s, h, cp, variant="ulysses")
    local = b * (s // cp) * h * 4
    assert uly["wire_bytes"] == 2 * (3 / 4) * (3 * local + local)
    # grouped-query attention shrinks only K and V
    gqa = estimate.cp_bytes_per_layer(b, s, h, cp, n_heads=8, n_kv_heads=2)
    assert gqa["wire_bytes"] == ring["wire_bytes"] / 4
    # the planner's ring term and its dp·cp gradient all-reduce are the same bytes
    step = estimate.cp_bytes_per_step(CFG, cp, micro_batch_size=b)
    traffic = estimate.layout_traffic(
        CFG, estimate.Parallelism(cp=cp), micro_batch_size=b
    )
    assert traffic["cp"] == step["attention"] == L * ring["wire_bytes"]
    assert traffic["dp"] == step["gradients"] == 2 * 3 / 4 * 4 * CFG.n_params()
    with pytest.raises(ValueError, match="does not split over cp=3"):
        estimate.cp_bytes_per_layer(b, 32, h, 3)


# ---- on the cluster -----------------------------------------------------------------
def _parity(variant, cp):
    """One training step of the GPT with its sequence over cp ranks against the
    single process on the same batch; bytes and saved activations as measured."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.memory import SavedBytes

    world = dist.get_world_size()
    axis = Topology(Layout(dp=cp, tp=world // cp)).axis("dp")  # cp ranks per group
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, BATCH)
    ref = GPT(CFG)
    ref_logits, ref_loss = ref(x, y)
    ref_loss.backward()

    model = context_parallel_gpt(GPT(CFG), axis, variant)
    rec = telemetry.Recorder(dist.get_rank())
    saved = SavedBytes(skip_params=True)
    with telemetry.use(rec):
        with saved:
            logits, loss = model(model.shard(x), model.shard(y))
        loss.backward()
        model.finish_gradient_synchronization()
    pos = model.positions(CFG.seq_len)
    out = {
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "logits": _diff(logits, ref_logits[:, pos]),
        "grads": {
            name: _diff(p.grad, q.grad)
            for (name, p), q in zip(model.module.named_parameters(), ref.parameters())
        },
        "saved_2_layers": saved.bytes,
    }
    wire = {"attention": 0.0, "gradients": 0.0}
    ops = {}
    for e in rec.events:
        if e["kind"] == "comm":
            key = "gradients" if e["tag"] == "cp/grads" else "attention"
            wire[key] += e["wire_bytes"]
            ops[e["op"]] = ops.get(e["op"], 0) + 1
    out["wire"], out["ops"] = wire, ops

    # one layer fewer: the difference is one block's saved activations
    one_layer = GPTConfig(**{**CFG.__dict__, "n_layers": 1})
    shallow = context_parallel_gpt(GPT(one_layer), axis, variant)
    saved = SavedBytes(skip_params=True)
    with saved:
        shallow(model.shard(x), model.shard(y))[1].backward()
    out["saved_1_layer"] = saved.bytes

    # the attention module alone: a drop-in for CausalSelfAttention, same weights
    attn = GPT(CFG).blocks[0].attn
    h = _rand(BATCH, CFG.seq_len, CFG.d_model, seed=5).requires_grad_()
    attn(h).backward(_rand(BATCH, CFG.seq_len, CFG.d_model, seed=6))  # grad_out
    cp_attn = ContextParallelAttention(GPT(CFG).blocks[0].attn, axis, variant)
    h_local = shard_sequence(h.detach(), axis, variant).requires_grad_()
    y_local = cp_attn(h_local)
    grad_out = _rand(BATCH, CFG.seq_len, CFG.d_model, seed=6)
    y_local.backward(shard_sequence(grad_out, axis, variant))
    with torch.no_grad():
        want = attn(h)
    out["module"] = (
        _diff(y_local, shard_sequence(want, axis, variant)),
        _diff(h_local.grad, shard_sequence(h.grad, axis, variant)),
    )
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
def test_gpt_with_its_sequence_over_cp_matches_the_single_process(
    lab_cluster, variant, cp
):
    results = lab_cluster(4).run(_parity, variant, cp)
    s, b, h, a = CFG.seq_len, BATCH, CFG.d_model, CFG.n_heads
    want = estimate.cp_bytes_per_step(CFG, cp, variant=variant, micro_batch_size=b)
    for res in results:
        assert len(res["grads"]) == len(list(GPT(CFG).parameters()))
        if variant == "ulysses":
            assert res["logits"][0] == 0.0  # the model's own core: bit for bit
        # measured bytes per rank per step are the estimate, exactly
        assert res["wire"] == {
            "attention": want["attention"],
            "gradients": want["gradients"],
        }
        if variant == "ring":
            # 3(cp-1) sends per layer, as many receives, one all-reduce
            sends = 3 * (cp - 1) * CFG.n_layers
            assert res["ops"] == {"send": sends, "recv": sends, "all_reduce": 1}
        else:  # 2 all-to-alls forward, 2 backward, per layer
            assert res["ops"] == {"all_to_all": 4 * CFG.n_layers, "all_reduce": 1}
        per_layer = res["saved_2_layers"] - res["saved_1_layer"]
        paper = estimate.cp_activation_bytes_per_layer(
            s, b, h, a, cp, variant=variant, bytes_per_value=4
        )
        sbh, sb = s * b * h, s * b
        if variant == "ring":
            # Korthikanti's linear part without dropout (32sbh at 2 bytes: 64sbh in
            # fp32), no score matrix, but the kept output (sbh) and lse (asb) in
            # fp32, and the LayerNorms' mean and 1/std (2 x 2sb fp32 values)
            exact = (2 * 32 * sbh + 4 * sbh + 4 * a * sb + 16 * sb) / cp
        else:
            # all of it split over cp, but the causal mask (s^2 bools) of the
            # whole sequence that each rank's core builds
            whole = 2 * (32 * sbh + 2 * a * s * s * b) + 16 * sb
            exact = whole / cp + s * s
        assert per_layer == exact
        assert per_layer <= paper  # the paper's count (dropout masks too) bounds it
    # losses: every cp group holds the whole batch; its ranks' mean is the loss
    tp, loss_err = 4 // cp, 0.0
    for g in range(tp):
        members = [results[d * tp + g] for d in range(cp)]
        mean = sum(r["loss"] for r in members) / cp
        assert mean == pytest.approx(members[0]["ref_loss"], rel=1e-6)
        loss_err = max(loss_err, abs(mean - members[0]["ref_loss"]))
    # the figures quoted in the module docstring (relative errors leave out the
    # gradients that are zero up to rounding: k's bias, which softmax ignores)
    grads = [d for r in results for d in r["grads"].values()]
    rel = max(err / size for err, size in grads if size > 1e-5)
    logits = max(r["logits"][0] for r in results)
    print(
        f"{variant} cp={cp}: loss {loss_err:.1e}, logits max abs {logits:.1e}; "
        f"grads max abs "
        f"{max(e for e, _ in grads):.1e}, max rel {rel:.1e}; module "
        f"{max(max(r['module'][0][0], r['module'][1][0]) for r in results):.1e}; "
        f"bytes/rank {results[0]['wire']} = estimate"
    )

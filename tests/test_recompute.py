"""dtlab.recompute: activation checkpointing changes memory, never the numbers.

Parity. Recomputation re-runs the very ops of the forward on the very inputs, and
``preserve_rng_state`` (plus the replay of tensor parallelism's explicit dropout
generators) gives dropout the same masks, so gradients must be ``torch.equal`` to
those of the same model without checkpointing, in fp32, with and without dropout:
on the GPT, on a pipeline stage (including the zero-bubble split of backward into
input and weight gradients), and on a tensor-parallel GPT across 4 ranks.

Memory. The saved bytes are counted with saved-tensor hooks and compared with
Korthikanti et al.'s s·b·h·(34 + 5as/h) (``estimate.activation_bytes_per_layer``).
That formula assumes 16-bit values (2 bytes) and 1-byte dropout masks; asked for
``bytes_per_value=4`` it doubles both, so its masks become 2 bytes each. What fp32 on
CPU actually keeps differs in three ways, which :func:`_predicted` puts back:

- dropout masks: CPU dropout (not the fused CUDA kernel, whose mask is bool) keeps
  its scaled noise as a float tensor, 4 bytes per element;
- with dropout 0 there is no mask at all, and the attention "dropout output" is the
  softmax output itself (one tensor, not two);
- small things the formula leaves out: each LayerNorm's mean and 1/std (2·s·b
  floats) and the (s, s) bool causal mask: < 1 % of a layer here, the margin
  asserted.

Time. The forward/backward times are reported (``-s``), never asserted.
"""

from __future__ import annotations

import pytest
import torch

from dtlab import estimate, recompute
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.pipeline import StageModule
from dtlab.recompute import apply_activation_checkpointing, measure_activation_memory
from dtlab.tensor_parallel import ParallelSelfAttention

# s=32, b=2, h=64, a=4: the s² scores are 5as/h = 10 of the 34 + 10 per-layer units
S, B, H, A = 32, 2, 64, 4
CFG = GPTConfig(vocab_size=64, seq_len=S, n_layers=2, n_heads=A, d_model=H)


def _batch(b=B, step=0):
    return SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(step, b)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_step(mode, dropout, seed=7):
    """Loss, gradients and the next global random numbers after one step."""
    model = GPT(CFG.__class__(**{**CFG.__dict__, "dropout": dropout}), seed=0)
    apply_activation_checkpointing(model, mode)
    x, y = _batch()
    torch.manual_seed(seed)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), _grads(model), torch.rand(4)


def _assert_same_grads(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ---- parity on one process ---------------------------------------------------------
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_gpt_gradients_are_bit_identical(mode, dropout):
    loss0, grads0, rand0 = _gpt_step("none", dropout)
    loss, grads, rand = _gpt_step(mode, dropout)
    assert torch.equal(loss, loss0)
    _assert_same_grads(grads, grads0)
    # the recompute replays the RNG and then puts it back: later draws are unchanged
    assert torch.equal(rand, rand0)


def test_dropout_parity_needs_the_preserved_rng():
    """The dropout test has teeth: recomputing without restoring the RNG draws new
    masks in backward, and the gradients are wrong."""
    from torch.utils.checkpoint import checkpoint

    _, grads0, _ = _gpt_step("none", 0.1)
    model = GPT(GPTConfig(**{**CFG.__dict__, "dropout": 0.1}), seed=0)
    for block in model.blocks:
        block.forward = lambda x, f=block.forward: checkpoint(
            f, x, use_reentrant=False, preserve_rng_state=False
        )
    x, y = _batch()
    torch.manual_seed(7)
    model(x, y)[1].backward()
    assert not torch.equal(
        model.blocks[0].mlp.fc.weight.grad, grads0["blocks.0.mlp.fc.weight"]
    )


def _stage_step(mode, split):
    """A middle pipeline stage (blocks 1 and 2 of 4) with dropout: the input and
    parameter gradients, backward in one call or split the zero-bubble way (input
    gradient first, keeping the graph; weight gradients later)."""
    cfg = GPTConfig(**{**CFG.__dict__, "n_layers": 4, "dropout": 0.1})
    stage = StageModule(cfg, range(1, 3), first=False, last=False, seed=0)
    apply_activation_checkpointing(stage, mode)
    gen = torch.Generator().manual_seed(3)
    inp = torch.randn(B, S, H, generator=gen).requires_grad_()  # (B, T, C)
    grad_out = torch.randn(B, S, H, generator=gen)  # from the next stage
    torch.manual_seed(11)
    out = stage(inp)
    if split:
        weights = [p for p in stage.parameters()]
        torch.autograd.backward(out, grad_out, inputs=[inp], retain_graph=True)
        torch.autograd.backward(out, grad_out, inputs=weights)
    else:
        torch.autograd.backward(out, grad_out)
    return inp.grad.clone(), _grads(stage)


@pytest.mark.parametrize("split", [False, True], ids=["one_backward", "zb_split"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_pipeline_stage_gradients_are_bit_identical(mode, split):
    dx0, grads0 = _stage_step("none", split=False)
    dx, grads = _stage_step(mode, split)
    assert torch.equal(dx, dx0)
    _assert_same_grads(grads, grads0)


def test_modes_switch_and_names_stay():
    model = GPT(CFG, seed=0)
    keys = list(model.state_dict())
    for mode in ("full", "selective", "full", "none", "selective"):
        apply_activation_checkpointing(model, mode)
        assert recompute.checkpointing_mode(model) == mode
        assert list(model.state_dict()) == keys  # optimizers and checkpoints unaffected
    apply_activation_checkpointing(model, "none")
    assert "forward" not in model.blocks[0].__dict__
    assert "core" not in model.blocks[0].attn.__dict__


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="must be one of"):
        apply_activation_checkpointing(GPT(CFG), "all")
    with pytest.raises(ValueError, match="no transformer blocks"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), "full")


def test_selective_without_a_separate_core_is_refused():
    class Attn(torch.nn.Module):
        def forward(self, x):
            return x

    class Blk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([Blk()])
    with pytest.raises(NotImplementedError, match="core"):
        apply_activation_checkpointing(holder, "selective")


# ---- memory against Korthikanti et al. ---------------------------------------------
MASK_BYTES = 4  # CPU dropout keeps its float noise; the fused CUDA kernel, a bool


def _predicted(mode, dropout):
    """Korthikanti et al. in fp32, with the mask and dropout differences of the
    module docstring put back (LayerNorm statistics and the causal mask left out)."""
    f = estimate.activation_bytes_per_layer(
        S, B, H, A, recompute=mode, bytes_per_value=4
    )
    if mode == "full":
        return f  # the block input only: s·b·h fp32 values
    sbh, scores = S * B * H, A * S * S * B
    masks = 2 * sbh + (scores if mode == "none" else 0)  # elements, 2 B in f
    f -= 2 * masks
    if dropout:
        return f + MASK_BYTES * masks
    # no dropout: no masks, and no separate dropout output of the softmax
    return f - (4 * scores if mode == "none" else 0)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_bytes_match_the_formula(dropout):
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": dropout})
    x, y = _batch()
    rows = {}
    for mode in recompute.MODES:
        torch.manual_seed(0)
        rows[mode] = measure_activation_memory(GPT(cfg, seed=0), x, y, mode)
    for mode, r in rows.items():
        want = _predicted(mode, dropout)
        paper = estimate.activation_bytes_per_layer(
            S, B, H, A, recompute=mode, bytes_per_value=4
        )
        print(
            f"dropout={dropout} {mode:9s} measured {r['block_bytes']:8.0f} B/layer, "
            f"adjusted formula {want:8.0f}, raw formula {paper:8.0f}; "
            f"fwd {r['forward_s'] * 1e3:.1f} ms, bwd {r['backward_s'] * 1e3:.1f} ms"
        )
        assert len(set(r["per_block"])) == 1  # every layer keeps the same
        # dtlab's own count, to the byte: on a CPU the masks are fp32 values
        exact = estimate.dtlab_saved_bytes_per_layer(
            S,
            B,
            H,
            A,
            recompute=mode,
            bytes_per_value=4,
            dropout=dropout > 0,
            dropout_mask_bytes=estimate.dropout_mask_bytes("cpu", 4),
        )
        assert r["block_bytes"] == exact, mode
        # the left-out LayerNorm statistics and causal mask: < 1 % (see docstring)
        assert want <= r["block_bytes"] <= want * 1.01, mode
        # embeddings, head and loss do not depend on the mode
        assert r["other_bytes"] == rows["none"]["other_bytes"]
    # the order the paper gives: full << selective < none
    assert rows["full"]["saved_bytes"] < rows["selective"]["saved_bytes"]
    assert rows["selective"]["saved_bytes"] < rows["none"]["saved_bytes"]


def test_measurement_leaves_the_mode_and_numbers_alone():
    model = GPT(CFG, seed=0)
    apply_activation_checkpointing(model, "selective")
    x, y = _batch()
    r = measure_activation_memory(model, x, y, "full")
    assert recompute.checkpointing_mode(model) == "selective"
    ref = GPT(CFG, seed=0)
    _, loss = ref(x, y)
    loss.backward()
    assert r["loss"] == loss.item()
    _assert_same_grads(_grads(model), _grads(ref))


# ---- tensor parallelism across ranks -----------------------------------------------
def _tp_grads(mode, dropout, replay=True):
    """On every rank of a dp=2 x tp=2 layout: this rank's gradient shards after one
    step of a TensorParallelGPT with ``mode`` (``replay=False``: without replaying
    TP's explicit dropout generators, to show that the replay matters)."""
    import torch.distributed as dist

    from dtlab import recompute as rc
    from dtlab.tensor_parallel import tensor_parallel_gpt
    from dtlab.topology import Layout, Topology

    topo = Topology(Layout(dp=dist.get_world_size() // 2, tp=2))
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": dropout})
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(0, B)
    model = tensor_parallel_gpt(GPT(cfg, seed=0), topo, seed=0)
    saved = rc._explicit_rngs
    if not replay:
        rc._explicit_rngs = lambda module: []
    try:
        apply_activation_checkpointing(model, mode)
    except NotImplementedError as e:
        return str(e)
    finally:
        rc._explicit_rngs = saved
    _, loss = model(x, y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_tensor_parallel_gradients_are_bit_identical(lab_cluster, mode):
    cluster = lab_cluster(4)
    want = cluster.run(_tp_grads, "none", 0.1)
    got = cluster.run(_tp_grads, mode, 0.1)
    if mode == "selective" and not hasattr(ParallelSelfAttention, "core"):
        # TP's attention computes softmax(QK^T)V inline: nothing separate to
        # recompute, and the refusal must say so on every rank
        assert all(isinstance(g, str) and "core(q, k, v)" in g for g in got)
        return
    for g, w in zip(got, want, strict=True):
        _assert_same_grads(g, w)


def test_tensor_parallel_dropout_needs_the_generator_replay(lab_cluster):
    cluster = lab_cluster(4)
    want = cluster.run(_tp_grads, "none", 0.1)
    got = cluster.run(_tp_grads, "full", 0.1, False)
    name = "blocks.0.mlp.fc.weight"
    assert not torch.equal(got[0][name], want[0][name])


# ---- the price: recomputed FLOPs and offload traffic ------------------------------
@pytest.mark.parametrize("mode", recompute.MODES)
def test_recomputed_flops_match_the_estimate(mode):
    """Matmul FLOPs of forward + backward over the blocks, counted by torch's
    FlopCounterMode (the recompute runs inside backward, so it is counted too),
    against ``estimate.recompute_overhead`` with torch's early stop."""
    from torch.utils.flop_counter import FlopCounterMode

    def step_flops(m):
        holder = torch.nn.Module()
        holder.blocks = GPT(CFG, seed=0).blocks
        apply_activation_checkpointing(holder, m)
        h = torch.randn(B, S, H, requires_grad=True)  # (B, T, C)
        with FlopCounterMode(display=False) as counter:
            out = h
            for block in holder.blocks:
                out = block(out)
            out.sum().backward()
        return counter.get_total_flops()

    extra = step_flops(mode) / step_flops("none") - 1
    want = estimate.recompute_overhead(mode, S, H, early_stop=True)
    assert extra == pytest.approx(want, rel=1e-12, abs=1e-12)
    # the paper's "one more forward" is the upper bound torch's early stop undercuts
    assert want <= estimate.recompute_overhead(mode, S, H) <= 1 / 3


def test_offload_traffic_formula():
    got = estimate.offload_bytes_per_step(1000, 4, grad_bytes=2, param_bytes=2)
    assert got == {"to_host": 500.0, "to_device": 500.0, "total": 1000.0}
    with pytest.raises(ValueError, match="dp"):
        estimate.offload_bytes_per_step(1000, 0)
    with pytest.raises(ValueError, match="recompute mode"):
        estimate.recompute_overhead("some", S, H)

"""dtlab.model: deterministic init, shapes, tied head, data determinism, sharding."""

import math

import pytest
import torch

from dtlab.estimate import model_params
from dtlab.model import (
    GPT,
    GPTConfig,
    SyntheticTokens,
    TinyMLP,
    regression_batch,
    shard_batch,
)

torch.set_num_threads(1)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_same_seed_gives_bit_identical_weights():
    assert _same_weights(GPT(GPTConfig(), seed=3), GPT(GPTConfig(), seed=3))
    assert _same_weights(TinyMLP(seed=3), TinyMLP(seed=3))


def test_different_seed_gives_different_weights():
    a, b = GPT(GPTConfig(), seed=0), GPT(GPTConfig(), seed=1)
    assert not torch.equal(a.wte.weight, b.wte.weight)
    assert not torch.equal(a.blocks[0].attn.q.weight, b.blocks[0].attn.q.weight)
    assert not torch.equal(TinyMLP(seed=0).fc.weight, TinyMLP(seed=1).fc.weight)


def test_init_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(5)
    torch.manual_seed(123)
    GPT(GPTConfig())
    TinyMLP()
    SyntheticTokens(64, 32).batch(0, 4)
    assert torch.equal(torch.rand(5), expected)


def test_init_is_per_parameter_name():
    # a deeper model shares its first blocks' weights with a shallower one: each
    # parameter's generator depends on its name only (pipeline stages rely on it),
    # except the residual projections whose std depends on the depth
    a = GPT(GPTConfig(n_layers=2))
    b = GPT(GPTConfig(n_layers=4))
    assert torch.equal(a.blocks[1].attn.q.weight, b.blocks[1].attn.q.weight)
    assert torch.equal(a.blocks[1].mlp.fc.weight, b.blocks[1].mlp.fc.weight)
    ratio = b.blocks[1].mlp.proj.weight / a.blocks[1].mlp.proj.weight
    assert torch.allclose(ratio, torch.full_like(ratio, math.sqrt(2 / 4)))


def test_init_statistics():
    model = GPT(GPTConfig(d_model=128, n_heads=4), seed=0)
    block = model.blocks[0]
    assert abs(block.attn.q.weight.std().item() - 0.02) < 0.002
    assert abs(block.attn.proj.weight.std().item() - 0.02 / 2) < 0.001
    assert torch.equal(block.ln_1.weight, torch.ones(128))
    assert torch.equal(block.mlp.fc.bias, torch.zeros(512))


def test_forward_shapes_and_initial_loss():
    cfg = GPTConfig()
    model = GPT(cfg)
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(0, 8)
    logits, loss = model(x, y)
    assert logits.shape == (8, cfg.seq_len, cfg.vocab_size)
    # an untrained model is close to uniform over the vocabulary
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    logits2, none = model(x[:, :10])
    assert logits2.shape == (8, 10, cfg.vocab_size) and none is None
    # causal: the first 10 positions do not see the rest of the sequence
    assert torch.allclose(logits2, logits[:, :10], atol=1e-6)


def test_too_long_sequence_is_rejected():
    model = GPT(GPTConfig(seq_len=8))
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_tied_head_shares_storage_untied_does_not():
    tied = GPT(GPTConfig(tied_head=True))
    assert tied.head.weight is tied.wte.weight
    assert tied.head.weight.data_ptr() == tied.wte.weight.data_ptr()
    untied = GPT(GPTConfig(tied_head=False))
    assert untied.head.weight.data_ptr() != untied.wte.weight.data_ptr()
    assert untied.n_params() == tied.n_params() + 64 * 64


@pytest.mark.parametrize(
    "cfg",
    [
        GPTConfig(),
        GPTConfig(tied_head=False, bias=False),
        GPTConfig(n_layers=3, d_model=48, n_heads=6, d_ff=100, vocab_size=50),
    ],
)
def test_parameter_count_matches_estimate(cfg):
    measured = sum(p.numel() for p in GPT(cfg).parameters())
    assert measured == cfg.n_params()
    assert measured == model_params(
        cfg.n_layers,
        cfg.d_model,
        cfg.vocab_size,
        seq_len=cfg.seq_len,
        d_ff=cfg.d_ff,
        bias=cfg.bias,
        layernorm=True,
        tied_embeddings=cfg.tied_head,
    )


def test_block_structure_for_tp_and_pp():
    model = GPT(GPTConfig(n_layers=3))
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 3
    for block in model.blocks:
        for name in ("q", "k", "v", "proj"):
            assert isinstance(getattr(block.attn, name), torch.nn.Linear)
        assert block.mlp.fc.out_features == 4 * 64 == block.mlp.proj.in_features


def test_stagewise_forward_equals_forward():
    model = GPT(GPTConfig())
    x, y = SyntheticTokens(64, 32).batch(1, 4)
    h = model.embed(x)
    for block in model.blocks:
        h = block(h)
    logits, loss = model.output(h, y)
    ref_logits, ref_loss = model(x, y)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)


def test_config_validation():
    assert GPTConfig(d_model=32, n_heads=4).d_ff == 128
    with pytest.raises(ValueError, match="n_heads"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="n_layers"):
        GPTConfig(n_layers=0)


def test_data_is_a_pure_function_of_step():
    data = SyntheticTokens(64, 32, seed=0)
    x5, y5 = data.batch(5, 8)
    data.batch(0, 8), data.batch(9, 16)  # other calls in between change nothing
    x5b, y5b = SyntheticTokens(64, 32, seed=0).batch(5, 8)
    assert torch.equal(x5, x5b) and torch.equal(y5, y5b)
    assert x5.shape == (8, 32) and x5.dtype == torch.long
    assert torch.equal(x5[:, 1:], y5[:, :-1])  # y is x shifted by one
    assert not torch.equal(x5, data.batch(6, 8)[0])
    assert not torch.equal(x5, SyntheticTokens(64, 32, seed=1).batch(5, 8)[0])


def test_data_follows_the_sparse_chain():
    data = SyntheticTokens(64, 32, seed=0, branching=3)
    x, y = data.batch(0, 16)
    allowed = data.successors[x]  # (B, T, k)
    assert (allowed == y.unsqueeze(-1)).any(-1).all()
    assert 0 < data.entropy_floor() < math.log(3)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_shards_concatenate_to_the_global_batch(world_size):
    x, y = SyntheticTokens(64, 32).batch(2, 8)
    shards = [shard_batch(x, y, r, world_size) for r in range(world_size)]
    assert all(s[0].shape == (8 // world_size, 32) for s in shards)
    assert torch.equal(torch.cat([s[0] for s in shards]), x)
    assert torch.equal(torch.cat([s[1] for s in shards]), y)
    assert torch.equal(
        SyntheticTokens(64, 32).shard(2, 8, 0, world_size)[0], shards[0][0]
    )


def test_shard_batch_errors():
    x, y = SyntheticTokens(64, 32).batch(0, 6)
    with pytest.raises(ValueError, match="not divisible"):
        shard_batch(x, y, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        shard_batch(x, y, 3, 3)


def test_tiny_mlp_learns_regression():
    model = TinyMLP(d_in=16, d_hidden=32, d_out=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        x, y = regression_batch(step, 32)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert torch.equal(regression_batch(3, 4)[0], regression_batch(3, 4)[0])


def test_tied_embedding_is_drawn_once_as_wte():
    tied, untied = GPT(GPTConfig(tied_head=True)), GPT(GPTConfig(tied_head=False))
    assert torch.equal(tied.wte.weight, untied.wte.weight)
    assert not torch.equal(untied.head.weight, untied.wte.weight)

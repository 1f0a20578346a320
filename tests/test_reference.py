"""dtlab.reference: the baseline trainer is deterministic and learns."""

import torch

from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.reference import grad_norm, make_optimizer, reference_step, train_reference

torch.set_num_threads(1)

CFG = GPTConfig()


def test_reference_reproduces_losses_bit_for_bit_and_learns():
    a = train_reference(CFG, steps=25, global_batch_size=8)
    b = train_reference(CFG, steps=25, global_batch_size=8)
    assert a.losses == b.losses  # python floats: exact equality
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert [r["step"] for r in a.records] == list(range(25))
    assert a.records[-1]["tokens"] == 25 * 8 * CFG.seq_len
    assert a.losses[-1] < 0.8 * a.losses[0]


def test_seeds_change_the_run():
    base = train_reference(CFG, steps=2, global_batch_size=4).losses
    assert train_reference(CFG, steps=2, global_batch_size=4, seed=1).losses != base
    assert (
        train_reference(CFG, steps=2, global_batch_size=4, data_seed=1).losses != base
    )


def test_reference_step_equals_a_hand_written_step():
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    x, y = data.batch(0, 4)
    model, hand = GPT(CFG), GPT(CFG)
    out = reference_step(model, make_optimizer(model.parameters()), x, y)

    opt = torch.optim.AdamW(
        hand.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0
    )
    _, loss = hand(x, y)
    loss.backward()
    expected_norm = grad_norm(hand.parameters())
    opt.step()
    assert out["loss"] == loss.item()
    assert out["grad_norm"] == expected_norm
    for p, q in zip(model.parameters(), hand.parameters()):
        assert torch.equal(p, q)


def test_grad_clip_bounds_the_update():
    model = GPT(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, 4)
    out = reference_step(model, opt, x, y, grad_clip=1e-3)
    assert out["grad_norm"] > 1e-3  # the norm reported is the one before clipping
    step = torch.cat([(p - b).flatten() for p, b in zip(model.parameters(), before)])
    assert abs(step.norm().item() - 1e-3) < 1e-6  # SGD lr=1: the update is the grad

"""Chapter 08's lesson helpers (``notebooks/08_memory_techniques.ipynb``): the
questions the chapter asks the learner to predict, the activation terms of
Korthikanti et al. next to what dtlab's GPT keeps, the bytes of an optimizer's
state, a block-wise 8-bit encoding of Adam's moments, and FSDP2's gradient
accumulation with and without communication.

The functions that take no cluster run on one process (the kernel, or an engine
the chapter ships them to); nothing here draws.
"""

from __future__ import annotations

import torch

from dtlab.lab.predictions import Question

__all__ = [
    "QUESTIONS",
    "activation_terms",
    "optimizer_state_bytes",
    "blockwise_int8",
    "fsdp2_accumulation",
]

QUESTIONS = [
    Question(
        "full_recompute_saving",
        "08",
        "activation bytes per layer that full recomputation saves for the chapter's "
        "GPT (s = 128, b = 4, h = 128, a = 4, fp32, no dropout): what a block keeps "
        "without recomputation minus what it keeps with full",
        "kB",
    ),
    Question(
        "accum_activation_ratio",
        "08",
        "the activations rank 0's forward keeps with k = 4 microbatches, as a "
        "multiple of what it keeps with k = 1 (global batch 16 on 4 ranks, DDP)",
        "x",
    ),
]


def activation_terms(s: int, b: int, h: int, a: int, *, bytes_per_value: int = 4):
    """Per layer and term, ``(paper bytes, dtlab bytes)`` for one block of
    dtlab's GPT (4h MLP, no dropout), both at ``bytes_per_value`` a value.

    The paper's (Korthikanti et al. 2022, §4.1) terms are its 2-byte counts
    rescaled; dtlab's are what :func:`dtlab.estimate.activations.
    dtlab_saved_bytes_per_layer` adds up, term by term."""
    v, sbh, scores = bytes_per_value, s * b * h, a * s * s * b
    r = v / 2  # the paper counts 2-byte values and 1-byte masks
    return {
        "LayerNorm inputs (2)": (4 * sbh * r, 2 * v * sbh),
        "inputs of q/k/v and of fc": (4 * sbh * r, 2 * v * sbh),
        "q, k, v, attention output": (8 * sbh * r, 4 * v * sbh),
        "GELU input and output": (16 * sbh * r, 8 * v * sbh),
        "dropout masks after attention and MLP": (2 * sbh * r, 0),
        "softmax output (scores)": (2 * scores * r, v * scores),
        "attention dropout: mask and output": (3 * scores * r, 0),
        "LayerNorm mean and 1/std": (0, v * 2 * 2 * s * b),
        "causal mask (s² bools)": (0, s * s),
    }


def optimizer_state_bytes(model: torch.nn.Module, optimizer) -> dict:
    """``{"bytes", "per_param", "keys"}`` of ``optimizer``'s state (every tensor
    it keeps, step counters included) after it stepped ``model``'s parameters
    once; ``keys`` are the state's names, ``shapes`` those of one weight matrix."""
    total, keys, shapes = 0, set(), {}
    for p, state in optimizer.state.items():
        keys.update(state)
        total += sum(t.numel() * t.element_size() for t in state.values())
        if p.dim() == 2 and not shapes:  # what it keeps for one weight matrix
            shapes = {k: tuple(t.shape) for k, t in state.items() if t.dim() > 0}
            shapes["weight"] = tuple(p.shape)
    n = sum(p.numel() for p in model.parameters())
    return {
        "bytes": total,
        "per_param": total / n,
        "keys": sorted(keys),
        "shapes": shapes,
    }


def blockwise_int8(t: torch.Tensor, block: int = 2048) -> dict:
    """Encode ``t`` as 8-bit codes with one fp32 scale per block of ``block``
    values (linear absmax quantization, the simplest block-wise scheme; Dettmers
    et al. 2022 use a non-linear "dynamic" code instead, which keeps small values
    more precisely). Returns the bytes of the encoding, the bytes of ``t`` and
    the largest error of the decoded values relative to the block's largest."""
    flat = t.detach().flatten().float()
    pad = (-flat.numel()) % block
    blocks = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)  # (n, block)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # (n, 1)
    codes = torch.round(blocks / scale * 127).to(torch.int8)  # (n, block)
    decoded = codes.float() / 127 * scale
    err = ((decoded - blocks).abs() / scale).max().item()
    return {
        "bytes": flat.numel() * 1 + scale.numel() * 4,  # the padding is not stored
        "original_bytes": t.numel() * t.element_size(),
        "max_error_of_block_max": err,
    }


def fsdp2_accumulation(micro_batches: int, sync_every: bool, seed: int = 0) -> dict:
    """On every rank: FSDP2 (``fully_shard`` per block and on the root) trains
    one step of dtlab's GPT over ``micro_batches`` microbatches of this rank's
    slice. ``sync_every=False`` calls ``set_requires_gradient_sync(False)`` on all
    but the last microbatch (FSDP1's ``no_sync``): the unsharded gradients add
    up locally and are reduce-scattered once. Returns the collectives of the
    backward passes (:class:`dtlab.frameworks.traffic.CollectiveCounter`) and
    the sharded gradient's sum, to compare the two ways."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dtlab.frameworks.traffic import CollectiveCounter
    from dtlab.model import GPT, GPTConfig, SyntheticTokens, shard_batch

    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig()
    mesh = init_device_mesh("cpu", (n,))
    model = GPT(cfg, seed=seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(0, 16)
    x, y = shard_batch(x, y, rank, n)  # (16/N, T)
    counter = CollectiveCounter()
    for m, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        last = m == micro_batches - 1
        model.set_requires_gradient_sync(sync_every or last)
        _, loss = model(xm, ym)  # all-gathers are not counted: forward is outside
        with counter:
            (loss / micro_batches).backward()
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    return {
        "traffic": counter.per_step(),
        "grad_sum": float(sum(g.double().sum() for g in grads)),
        "grads": [g.clone() for g in grads],
    }

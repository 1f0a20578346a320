"""Chapter 07's reference solutions: a 3D layout defended with numbers, and the
Megatron rank order. ``dtlab.exercises.solution(name)`` shows each;
:mod:`.ch07_layouts` checks a learner's against them."""

from __future__ import annotations

__all__ = ["defend_layout", "megatron_coords"]


def defend_layout():
    """LLaMA-2 70B (80 layers, h = 8192, 64 heads, 8 KV heads, d_ff = 28672, 32k
    vocabulary, 4096-token sequences) on 8 nodes of 8 H100-80GB, a global batch of
    256 sequences in bf16. The plan, and what the four questions imply for it, per
    GPU: memory by category (what is replicated, what is sharded), wire bytes per
    step on each axis (what is synchronized, how often), the bubble and the axis
    that dominates the traffic (what dominates the cost). GB = 1e9 bytes."""
    from dtlab.topology import Layout

    dp, tp, pp, micro = 1, 4, 16, 1  # TP inside a node (NVLink), PP across nodes
    L, h, h_kv, d_ff, V, s = 80, 8192, 1024, 28672, 32000, 4096
    m = 256 // (dp * micro)  # microbatches per step and replica
    per_layer = 2 * h * h + 2 * h * h_kv + 3 * h * d_ff  # attention + gated MLP
    # the first stage holds its L/pp layers and the embedding, all split by tp
    psi = ((L // pp) * per_layer + V * h) / tp
    params, grads = 2 * psi, 2 * psi  # bf16 weights and gradients (ZeRO §3)
    optimizer = 12 * psi  # fp32 master copy, momentum, variance: K = 12
    # selective recomputation drops the 5as² term; SP splits the 34sbh by tp
    per_layer_acts = 34 * s * micro * h / tp  # bytes (Korthikanti et al., §4)
    activations = pp * (L // pp) * per_layer_acts  # 1F1B: stage 0 holds p in flight
    activation = micro * s * h * 2  # b·s·h values of 2 bytes
    ring = 2 * (tp - 1) / tp  # an all-reduce's wire bytes per byte, on tp ranks
    # 2 all-reduces forward and 2 backward per layer (or SP's gather/scatter halves)
    tp_bytes = m * (L // pp) * 4 * ring * activation
    pp_bytes = m * 2 * activation / tp  # a middle stage: activation out, gradient back
    return {
        "layout": Layout(dp=dp, tp=tp, pp=pp),
        "zero_stage": 0,  # dp = 1: nothing to shard over
        "checkpointing": "selective",
        "sequence_parallel": True,
        "micro_batch_size": micro,
        "memory_GB": {
            "params": params / 1e9,
            "grads": grads / 1e9,
            "optimizer": optimizer / 1e9,
            "activations": activations / 1e9,
        },
        "wire_GB": {"dp": 0.0, "tp": tp_bytes / 1e9, "pp": pp_bytes / 1e9},
        "bubble": (pp - 1) / (m + pp - 1),
        "dominant": "tp",
    }


def megatron_coords(rank, dp, tp, pp):
    """The coordinates of a global rank in Megatron's order: tp varies fastest
    (a tp group is consecutive ranks, inside one node), then dp, then pp."""
    return {"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp)}

"""Chapter 10's reference solutions: the number every DDP answer needs, and model
answers to the graded drill's cards and their follow-ups.
``dtlab.exercises.solution(name)`` shows each; :mod:`.ch10_drill` grades a
learner's."""

from __future__ import annotations

__all__ = ["ddp_wire_bytes", "drill_answers"]


def ddp_wire_bytes(n_params, world_size, bytes_per_grad=4):
    """Bytes one rank sends in one DDP step: the ring all-reduce of every gradient,
    a reduce-scatter and an all-gather of (N−1)/N of the gradient bytes each."""
    return 2 * (world_size - 1) / world_size * n_params * bytes_per_grad


def drill_answers():
    """A strong answer to every card of the drill, and to each follow-up."""
    return {
        "ddp_traffic": (
            "DDP all-reduces the gradients once per step, in buckets that overlap "
            "with the backward pass. With the ring algorithm the all-reduce is a "
            "reduce-scatter followed by an all-gather, and each GPU sends "
            "2(N-1)/N · Ψ · bytes: about 2Ψ, independent of N, which is why the "
            "ring is bandwidth-optimal."
        ),
        "ddp_traffic/slower_network": (
            "Each all-reduce takes 4x as long. Less of it hides behind the backward, "
            "so the communication is exposed and the step slows down; I would "
            "accumulate gradients over more microbatches (fewer all-reduces per "
            "sample) and use bigger buckets."
        ),
        "zero_stages": (
            "Mixed-precision Adam keeps 16 bytes per parameter: 2 + 2 + 12 (bf16 "
            "weights, bf16 gradients, fp32 master weights and two moments). "
            "Stage 1 shards the optimizer states over the N data-parallel ranks; "
            "stage 2 also shards the gradients; stage 3 also shards the parameters, "
            "gathering each layer's weights before use. Stages 1 and 2 send what "
            "DDP sends (2Ψ); stage 3 gathers twice, 3Ψ: 1.5x DDP's traffic."
        ),
        "zero_stages/offload": (
            "ZeRO-Offload keeps the fp32 optimizer states and the gradients in CPU "
            "memory and runs the Adam step on the CPU, while forward and backward "
            "stay on the GPU. Ren et al. train a 13B model on a single V100."
        ),
        "one_f_one_b": (
            "Stage i of p warms up with p - i - 1 forwards, then alternates one "
            "forward and one backward (the steady state), then drains the "
            "remaining backwards. It holds at most p - i microbatches of "
            "activations instead of GPipe's m, and its bubble is the same as "
            "GPipe's: (p-1)/(m+p-1) of the step. Interleaving v chunks per rank "
            "divides the bubble by v."
        ),
        "one_f_one_b/more_microbatches": (
            "The bubble shrinks: (p-1)/(m+p-1) falls as m grows. Activation memory "
            "stays the same under 1F1B, at most p - i microbatches in flight; GPipe "
            "would hold twice as many activations."
        ),
        "mixed_precision": (
            "16 bytes per parameter, the same as fp32 Adam: 2 + 2 + 12, with fp32 "
            "master weights and moments. fp16 has 5 exponent bits, so small "
            "gradients underflow to zero: a dynamic loss scale lifts them. bf16 "
            "has fp32's 8 exponent bits and needs no loss scaling. The saving is "
            "in activations, traffic and matmul speed, not in model states."
        ),
        "mixed_precision/one_rank_overflows": (
            "All ranks must skip the step together: the found-inf flag is "
            "all-reduced with MAX, and every rank backs off the scale (halves it). "
            "Otherwise one rank skips while the others step and the replicas "
            "diverge, or, under ZeRO or TP, they call different collectives and hang."
        ),
        "long_context": (
            "Context parallelism splits the sequence of every sample over cp ranks, "
            "so activations divide by cp, while the weights stay replicated as over "
            "dp (their gradients are reduced over dp x cp). Attention reaches across: "
            "ring attention passes K/V blocks round the ring and merges the partial "
            "results with the online softmax (log-sum-exp), 3(cp - 1) blocks per "
            "layer; Ulysses trades the sequence shard for a head shard by "
            "all-to-all, so cp must divide the heads. Expert parallelism shards the "
            "experts of each MoE layer; the tokens travel to their experts by an "
            "all-to-all and come back by another. A capacity factor bounds each "
            "expert's buffer: tokens beyond it are dropped, and the rank of the "
            "hottest expert is the straggler (load imbalance)."
        ),
        "long_context/gqa_across_nodes": (
            "Ulysses is bounded by the heads: with only 8 K/V heads, cp = 16 cannot "
            "give each rank a head of its own. GQA makes the ring's K/V blocks small, "
            "16x fewer bytes than the queries, and the ring's sends overlap the "
            "block's attention compute once each rank holds a few thousand tokens. "
            "So I would run the ring across nodes, or Ulysses inside a node and the "
            "ring across them (USP)."
        ),
    }

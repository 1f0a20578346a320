"""Chapter 10's reference solutions: the number every DDP answer needs, and
structured answers to the drill exercise's cards.
``dtlab.exercises.solution(name)`` shows each; :mod:`.ch10_drill` grades a
learner's."""

from __future__ import annotations

__all__ = ["ddp_wire_bytes", "drill_answers"]


def ddp_wire_bytes(n_params, world_size, bytes_per_grad=4):
    """Bytes one rank sends in one DDP step: the ring all-reduce of every gradient,
    a reduce-scatter and an all-gather of (N−1)/N of the gradient bytes each."""
    return 2 * (world_size - 1) / world_size * n_params * bytes_per_grad


def drill_answers():
    """Answers to the drill exercise's five cards, as a whiteboard would have them:
    each number worked out from its scenario and written with its unit (any
    notation), each choice set picked from the options the card prints."""
    return {
        "ddp_traffic": {
            # 2(N-1)/N · Ψ · 2 bytes = 2 · 7/8 · 7e9 · 2
            "bytes_n8": "24.5 GB",
            # (N-1)/N is 0.999 at N = 1024: about 2Ψ·2 bytes, whatever N
            "bytes_n1024": "2.8e10",
            # 24.5 GB / 12.5 GB/s, plus 2(N-1) = 14 hops of 5 µs
            "slow_link": "1.96 s",
            "per_gpu": ["2(N-1)/N*Ψ values"],
            "ring": "a reduce-scatter, then an all-gather",
        },
        "zero_stages": {
            # 2Ψ + 2Ψ + 12Ψ/64 bytes, Ψ = 7.5e9
            "stage1": "31.4 GB",
            # 16Ψ/64 bytes = 1.875e9 B
            "stage3": "1.75 GiB",
            "stage1_shards": ["optimizer states"],
            "stage2_shards": ["Gradients", "Optimizer States"],
            "stage3_shards": ["weights", "gradients", "optimizer states"],
        },
        "one_f_one_b": {
            "held_1f1b": 4,  # min(p - stage, m) at stage 0
            "held_gpipe": "8 microbatches",  # every forward before any backward
            "warm_up": ["p - s - 1 forwards"],
            "changes": ["peak activation memory"],
        },
        "amp_loss_scaling": {
            "mixed_bytes": "16 bytes",  # 2 + 2 + 12
            "pure_bf16_bytes": 8,  # 2 + 2 + 4: bf16 weights, gradients, moments
            "fp32": "master weights | Adam's moments",
            "scaling": ["fp16"],
            "saves": ["matmul time", "activation memory", "communication bytes"],
        },
        "long_context_moe": {
            # 7 hops forward and 14 backward, each one K and V block of s/cp tokens
            "ring_bytes": "11.3 GB",
            "ep_bytes": "235 MB",
            "cp_sharded": ["the sequence and its activations"],
            "ep_sends": ["tokens to their experts and back (all-to-all)"],
        },
    }

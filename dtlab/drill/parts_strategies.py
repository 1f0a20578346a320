"""The graded parts of the drill's cards on the parallel strategies (chapter 10):
data parallelism, ZeRO/FSDP, tensor and pipeline parallelism, context and expert
parallelism. Vocabulary and constructors: :mod:`~dtlab.drill.parts`."""

from __future__ import annotations

from dtlab import estimate as est
from dtlab.drill.parts import (
    EVERY_LAYER,
    EVERY_STEP,
    NVLINK,
    OPT,
    START,
    A,
    B,
    C,
    G,
    L,
    N,
    W,
    states,
)

__all__ = ["PARTS"]


def _zero_ratio():
    w = {s: est.zero_comm_per_step(7e9, 8, s, 2)["wire"] for s in (0, 3)}
    return w[3] / w[0]


PARTS: dict[str, tuple] = {
    "dp_vs_mp": (
        N(
            "dp_weights",
            "Ψ = 7e9, bf16 weights, data parallelism over N = 8: "
            "bytes of weights each GPU holds",
            "GB",
            lambda: est.zero_memory_per_device(7e9, 8, 0)["params"],
        ),
        N(
            "tp_weights",
            "32 layers of d = 4096, a 32000-token vocabulary, tensor "
            "parallel over tp = 8: bytes of bf16 weights each GPU holds",
            "GB",
            lambda: 2 * est.tp_params_per_rank(32, 4096, 32000, 8),
        ),
        C("dp_sharded", "Data parallelism: what is sharded?", [B], [W, G, OPT, L]),
        C(
            "dp_synchronized",
            "Data parallelism: what is synchronized every step?",
            [G],
            [W, B],
            {
                A: "a data-parallel rank never sends those: each keeps "
                "its own microbatch's for its own backward"
            },
        ),
        C(
            "tp_synchronized",
            "Tensor parallelism: what is synchronized inside every layer?",
            ["activations and their gradients"],
            [W, OPT, B],
        ),
    ),
    "ddp_traffic": (
        N(
            "bytes_n8",
            "Ψ = 7e9, N = 8, bf16 gradients: bytes each GPU sends per DDP step",
            "GB",
            lambda: est.ddp_bytes_per_step(7e9, 8, 2),
        ),
        N(
            "bytes_n1024",
            "The same model on N = 1024 GPUs: bytes each GPU sends per step",
            "GB",
            lambda: est.ddp_bytes_per_step(7e9, 1024, 2),
        ),
        N(
            "slow_link",
            "N = 8, those 14 GB of gradients all-reduced at 12.5 GB/s "
            "with α = 5 µs (the α-β model): how long",
            "s",
            lambda: est.collective_time("all_reduce", 14e9, 8, 5e-6, 12.5e9),
        ),
        C(
            "per_gpu",
            "Per step, each GPU sends (Ψ gradient values):",
            ["2(N−1)/N·Ψ values"],
            ["Ψ/N values", "2Ψ·N values"],
            {
                "(N−1)·Ψ values": "the ring cuts the tensor into N chunks and passes "
                "chunks, never a whole copy to every peer"
            },
        ),
        C(
            "ring",
            "The ring all-reduce is:",
            ["a reduce-scatter, then an all-gather"],
            ["a reduce to rank 0, then a broadcast", "an all-to-all"],
        ),
    ),
    "dp_vs_ddp": (
        N(
            "ddp_bytes",
            "DDP on N = 4, Ψ = 1e9 fp32 gradients: bytes each rank sends per step",
            "GB",
            lambda: est.ddp_bytes_per_step(1e9, 4, 4),
        ),
        C(
            "dataparallel",
            "nn.DataParallel, every step: what goes through GPU 0?",
            [
                "inputs, scattered from it",
                "outputs, gathered to it",
                "gradients, summed on it",
                "weights, copied from it",
            ],
            ["nothing: each GPU works alone"],
        ),
        C(
            "ddp_cost",
            "DDP: what dominates its cost?",
            ["the gradient all-reduce's bandwidth"],
            ["one process's GIL", "GPU 0's extra memory"],
            {
                "a gather of every gradient on rank 0": "DDP has no primary: the ring "
                "spreads the reduction evenly over every rank"
            },
        ),
    ),
    "fsdp_shards": (
        N(
            "states",
            "Ψ = 7e9, N = 8, mixed-precision Adam, FSDP (full sharding): "
            "model-state bytes per GPU",
            "GB",
            lambda: states(7e9, 8, 3),
        ),
        C("sharded", "FSDP shards:", [W, G, OPT], ["the sequence", "attention heads"]),
        C(
            "travels",
            "FSDP, every step: what travels between ranks?",
            [
                "weights, all-gathered per layer for forward and for backward",
                "gradients, reduce-scattered as backward produces them",
            ],
            ["activations, all-reduced per layer"],
            {
                "optimizer states, all-gathered before the update": "each rank updates "
                "only its own slice: its Adam moments never leave it"
            },
        ),
    ),
    "zero_stages": (
        N(
            "stage1",
            "Ψ = 7.5e9, N = 64, mixed-precision Adam: model-state bytes "
            "per GPU under ZeRO-1",
            "GB",
            lambda: states(7.5e9, 64, 1),
        ),
        N("stage3", "The same under ZeRO-3", "GB", lambda: states(7.5e9, 64, 3)),
        C(
            "stage1_shards",
            "ZeRO-1 shards:",
            [OPT],
            [W, A, B],
            {G: "the gradients stay whole on every rank until stage 2"},
        ),
        C("stage2_shards", "ZeRO-2 shards:", [OPT, G], [W, A, B]),
        C("stage3_shards", "ZeRO-3 shards:", [OPT, G, W], [A, B]),
    ),
    "zero3_vs_fsdp": (
        N(
            "zero3_bytes",
            "Ψ = 7e9, N = 8, bf16: bytes each GPU sends per ZeRO-3 step",
            "GB",
            lambda: est.zero_comm_per_step(7e9, 8, 3, 2)["wire"],
        ),
        N("over_ddp", "Those bytes over DDP's on the same job", "x", _zero_ratio),
        C(
            "traffic",
            "ZeRO-3's traffic per step, against DDP's:",
            ["1.5×: weights gathered for forward and again for backward"],
            [
                "half: each rank sends only its shard",
                "N×: every rank gathers every shard",
            ],
            {
                "the same bytes as DDP (2Ψ)": "ZeRO-3 gathers the weights twice a step "
                "besides reduce-scattering the gradients: 3Ψ, not 2Ψ"
            },
        ),
        C(
            "differs",
            "What differs between DeepSpeed's ZeRO-3 and PyTorch FSDP?",
            [
                "offload to CPU and NVMe (ZeRO-Infinity)",
                "a config-driven engine that owns the loop",
                "native composition with torch",
            ],
            [],
            {
                "what they shard": "both shard the three model states the same way: "
                "one algorithm, two implementations",
                "the bytes they send": "both move 3Ψ a step",
            },
        ),
    ),
    "tp_in_node": (
        N(
            "layer_bytes",
            "One layer, micro-batch 1 × 4096 tokens, d = 8192, bf16, "
            "tp = 8, no sequence parallelism: bytes each rank sends per layer, "
            "forward and backward",
            "MB",
            lambda: est.tp_bytes_per_layer(1, 4096, 8192, 8)["wire_bytes"],
        ),
        N(
            "comm_share",
            "80 such layers at tp = 8 over 100 Gb/s Ethernet (sequence "
            "parallel, 50 % MFU of 989 TFLOP/s): the share of the time spent "
            "communicating",
            "%",
            lambda: est.tp_step_time(
                80, 1, 4096, 8192, 8, link="ethernet", sequence_parallel=True
            )["comm_fraction"],
        ),
        C(
            "how_often",
            "How often does a tp group communicate?",
            [EVERY_LAYER],
            [EVERY_STEP, START],
        ),
        C(
            "where",
            "Where does a tp group go?",
            [NVLINK],
            ["anywhere: the scheduler decides"],
            {
                "across nodes: its messages are small": "TP's "
                "collectives carry whole activations on the critical path of every "
                "layer: over inter-node links they dominate the step"
            },
        ),
    ),
    "pipeline_bubble": (
        N(
            "bubble",
            "p = 4 stages, m = 16 microbatches, 1F1B: the bubble's share of the step",
            "%",
            lambda: est.pipeline_bubble_fraction(4, 16),
        ),
        N(
            "interleaved",
            "The same with v = 2 interleaved chunks per rank",
            "%",
            lambda: est.pipeline_bubble_fraction(4, 16, 2),
        ),
        C(
            "shrink",
            "What shrinks the bubble?",
            [
                "more microbatches per step",
                "interleaving chunks per rank",
                "a zero-bubble schedule (split backward)",
            ],
            ["fewer microbatches", "more stages"],
            {
                "1F1B instead of GPipe": "1F1B changes memory, not idle time: with the "
                "same p and m both idle (p−1)/(m+p−1)"
            },
        ),
        C(
            "between_stages",
            "Between neighbouring stages, per microbatch, what travels?",
            ["activations, forward", "their gradients, backward"],
            [W, OPT],
        ),
    ),
    "one_f_one_b": (
        N(
            "held_1f1b",
            "p = 4, m = 8, 1F1B: microbatches of activations the first "
            "stage holds at its peak",
            "count",
            lambda: est.pipeline_in_flight(4, 0, 8, "1f1b"),
        ),
        N(
            "held_gpipe",
            "The same under GPipe",
            "count",
            lambda: est.pipeline_in_flight(4, 0, 8, "gpipe"),
        ),
        C(
            "warm_up",
            "Stage s (of p, counted from 0) warms up with:",
            ["p − s − 1 forwards"],
            ["m forwards", "one forward"],
            {
                "p − 1 forwards": "only the first stage warms up that long; each later "
                "stage starts its backwards one forward sooner"
            },
        ),
        C(
            "changes",
            "Against GPipe, 1F1B changes:",
            ["peak activation memory"],
            ["the bytes sent between stages"],
            {
                "the bubble": "with the same p and m the idle share is (p−1)/(m+p−1) "
                "in both: 1F1B reorders the work, it removes no idle time"
            },
        ),
    ),
    "long_context_moe": (
        N(
            "ring_bytes",
            "Ring attention, micro-batch 1 × 131072 tokens, d = 8192, "
            "bf16, cp = 8: bytes each rank sends per attention layer, forward and "
            "backward",
            "GB",
            lambda: est.cp_bytes_per_layer(1, 131072, 8192, 8, bytes_per_value=2)[
                "wire_bytes"
            ],
        ),
        N(
            "ep_bytes",
            "An MoE layer of 4096 tokens, d = 4096, 8 experts, top-2, "
            "ep = 8, bf16: bytes each rank sends per layer, forward and backward",
            "MB",
            lambda: est.ep_bytes_per_layer(
                4096, 4096, 8, n_experts=8, top_k=2, bytes_per_value=2
            )["wire_bytes"],
        ),
        C(
            "cp_sharded",
            "Context parallelism shards:",
            ["the sequence and its activations"],
            ["the experts", L],
            {
                "the weights": "context parallelism replicates them, as data "
                "parallelism does: their gradients are reduced over dp × cp"
            },
        ),
        C(
            "ep_sends",
            "Expert parallelism sends, per MoE layer:",
            ["tokens to their experts and back (all-to-all)"],
            ["expert weights, all-gathered", "activations, all-reduced"],
        ),
    ),
}

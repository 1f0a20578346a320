"""The graded parts of the drill's cards on systems, precision, memory and
planning (chapter 10). Vocabulary and constructors: :mod:`~dtlab.drill.parts`."""

from __future__ import annotations

from dtlab import estimate as est
from dtlab.drill.parts import (
    EVERY_LAYER,
    EVERY_MB,
    EVERY_STEP,
    OPT,
    START,
    WHITEBOARD,
    A,
    C,
    N,
    states,
)

__all__ = ["PARTS"]


def _layout_states():
    layout = est.Parallelism(tp=8, pp=8, dp=16)
    m = est.layout_memory(
        "70B", layout, zero_stage=1, precision="mixed", states="paper"
    )
    return m["params"] + m["grads"] + m["optimizer"]


def _bpp(precision):
    b = est.bytes_per_param(precision, "adam")
    return b.params + b.grads + b.optimizer


PARTS: dict[str, tuple] = {
    "why_distribute": (
        N(
            "model_states",
            "Ψ = 70e9, mixed-precision Adam on one GPU: bytes of "
            "model states (weights, gradients, Adam's states)",
            "GB",
            lambda: states(70e9, 1, 0),
        ),
        N(
            "one_gpu_days",
            "Ψ = 7e9 on 1e12 tokens (6·Ψ·D FLOPs), one GPU of 989 "
            "TFLOP/s at 40 % MFU: how long to train",
            "days",
            lambda: est.train_time(7e9, 1e12, 1, 989e12, 0.4),
            0.10,
            WHITEBOARD,
        ),
        C(
            "walls",
            "What stops one GPU from training a 70B model?",
            [
                "its memory: model states alone exceed it",
                "its throughput: years of FLOPs",
            ],
            ["the batch cannot be split", "PCIe bandwidth"],
            {
                "the weights alone: 2 bytes a parameter": "training also keeps "
                "gradients and Adam's moments and master copy: 16 bytes a parameter"
            },
        ),
    ),
    "amp_loss_scaling": (
        N(
            "mixed_bytes",
            "Mixed-precision Adam: model-state bytes per parameter",
            "B",
            lambda: _bpp("mixed"),
        ),
        N(
            "pure_bf16_bytes",
            "Pure bf16 Adam (no fp32 copy): model-state bytes per parameter",
            "B",
            lambda: _bpp("pure_bf16"),
        ),
        C(
            "fp32",
            "What stays in fp32?",
            ["master weights", "Adam's moments"],
            ["activations", "gradients on the wire"],
        ),
        C(
            "scaling",
            "Which format needs loss scaling?",
            ["fp16"],
            ["fp32"],
            {
                "bf16": "bf16 keeps fp32's 8 exponent bits: small gradients do not "
                "flush to zero"
            },
        ),
        C(
            "saves",
            "What does mixed precision save, against fp32 Adam?",
            ["activation memory", "communication bytes", "matmul time"],
            [],
            {
                "model-state memory": "mixed Adam keeps 16 bytes a parameter, as fp32 "
                "Adam does: the 16-bit copies sit beside an fp32 master"
            },
        ),
    ),
    "three_d": (
        N(
            "states",
            "The '70B' preset of dtlab.estimate.MODELS, tp = 8, pp = 8, "
            "dp = 16, ZeRO-1, mixed-precision Adam: model-state bytes per GPU "
            "(ZeRO §5.1's count)",
            "GB",
            _layout_states,
        ),
        C(
            "nvlink_axis",
            "Which axis goes on NVLink, inside a node?",
            ["tp"],
            ["dp", "pp"],
        ),
        C(
            "pp_when",
            "How often does pp communicate?",
            [EVERY_MB],
            [EVERY_STEP, EVERY_LAYER, START],
        ),
        C(
            "dp_when",
            "How often does dp communicate?",
            [EVERY_STEP],
            [EVERY_MB, EVERY_LAYER, START],
        ),
    ),
    "accelerate_vs_deepspeed": (
        N(
            "wrapped_bytes",
            "accelerate driving DDP on N = 8, Ψ = 1e9 fp32 "
            "gradients: bytes each rank sends per step",
            "GB",
            lambda: est.ddp_bytes_per_step(1e9, 8, 4),
        ),
        C(
            "adds",
            "What collectives does accelerate add on top of its backend?",
            ["none: the backend's own"],
            ["a broadcast of the weights every step"],
            {
                "a second gradient all-reduce of its own": "accelerate wraps the model "
                "in the backend's class and adds no maths and no traffic"
            },
        ),
        C(
            "deepspeed",
            "What does DeepSpeed bring that accelerate does not do itself?",
            [
                "ZeRO stages",
                "offload to CPU and NVMe",
                "a pipeline engine",
                "MoE support",
            ],
            ["one script for one GPU or many"],
        ),
    ),
    "offload": (
        N(
            "pcie",
            "ZeRO-3 with CPU offload, Ψ = 7e9, dp = 8, fp32 gradient and "
            "weight slices: bytes each rank moves over PCIe per step, both ways",
            "GB",
            lambda: est.offload_bytes_per_step(7e9, 8)["total"],
        ),
        C(
            "to_host",
            "What moves to the host?",
            [OPT, "fp32 master weights", "gradient slices"],
            ["16-bit weights used for compute"],
            {
                A: "they stay on the device for backward: moving them is another "
                "technique (activation offload)"
            },
        ),
        C(
            "cost",
            "What does offload cost?",
            ["PCIe bandwidth", "the CPU's optimizer step"],
            ["extra all-reduces between GPUs"],
        ),
    ),
    "comm_dominates": (
        N(
            "all_reduce",
            "Ψ = 70e9 bf16 gradients (140 GB) all-reduced over 64 GPUs "
            "at 50 GB/s, α = 5 µs: seconds",
            "s",
            lambda: est.collective_time("all_reduce", 140e9, 64, 5e-6, 50e9),
        ),
        N(
            "compute",
            "That step's compute: 64 × 4096 tokens of Ψ = 70e9 (6·Ψ FLOPs "
            "a token) on 64 GPUs of 989 TFLOP/s at 50 % MFU: seconds",
            "s",
            lambda: est.train_time(70e9, 64 * 4096, 64, 989e12, 0.5),
        ),
        C(
            "grows",
            "Gradient bytes per step grow with:",
            ["the number of parameters"],
            ["the sequence length"],
            {
                "the batch size": "there is "
                "one gradient per parameter whatever the batch: more tokens a step "
                "amortise the same bytes"
            },
        ),
        C(
            "hide",
            "What hides or cuts communication?",
            ["overlap with backward", "bucketing", "chatty axes on fast links"],
            ["a larger learning rate"],
        ),
    ),
    "training_vs_serving": (
        N(
            "serve",
            "The '70B' preset served with tp = 8, 32 sequences of 4096 "
            "tokens, bf16: bytes per GPU (weights and KV cache)",
            "GB",
            lambda: est.serving_memory("70B", tp=8, batch=32, context=4096)["total"],
        ),
        N(
            "kv",
            "Of which the KV cache",
            "GB",
            lambda: est.kv_cache_bytes("70B", 32, 4096, tp=8),
        ),
        C(
            "keeps",
            "Serving keeps per GPU:",
            ["16-bit weights", "KV cache"],
            ["fp32 master weights", "every layer's activations for backward"],
            {
                "gradients and Adam's moments": "a served model never updates: no "
                "backward and no optimizer step"
            },
        ),
    ),
    "processes": (
        N(
            "ring_steps",
            "A ring all-reduce over 8 processes: sequential message "
            "steps (what the α term pays)",
            "count",
            lambda: est.latency_steps("all_reduce", 8),
        ),
        C(
            "spawn",
            "mp.spawn starts:",
            ["one fresh interpreter per device"],
            ["one process with many CUDA streams"],
            {
                "threads in one interpreter": "spawn starts new processes, each with "
                "its own GIL; threads sharing one are nn.DataParallel's way"
            },
        ),
        C(
            "torchrun",
            "torchrun sets in each process's environment:",
            ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
            ["the learning rate", "the batch size"],
        ),
    ),
    "beyond_llms": (
        N(
            "a2a",
            "A recommender's batch of 65536 users × 100 ids looks up 128-dim "
            "fp32 rows of a table row-sharded over 64 GPUs: bytes each GPU sends in "
            "the all-to-all",
            "GB",
            lambda: est.wire_bytes("all_to_all", 65536 * 100 * 128 * 4, 64),
        ),
        C(
            "sharded",
            "A recommender: what is sharded?",
            ["embedding tables, by rows"],
            ["the dense towers"],
        ),
        C(
            "replicated",
            "A recommender: what is replicated?",
            ["the dense towers"],
            ["embedding tables, by rows"],
        ),
    ),
    "checkpointing": (
        N(
            "kept",
            "32 layers, 1 × 4096 tokens, d = 4096, 32 heads, bf16, no "
            "checkpointing: activation bytes kept for backward",
            "GB",
            lambda: est.activation_bytes(32, 4096, 1, 4096, 32),
        ),
        N(
            "kept_full",
            "The same with full checkpointing",
            "GB",
            lambda: est.activation_bytes(32, 4096, 1, 4096, 32, recompute="full"),
        ),
        N(
            "overhead",
            "Full checkpointing's extra compute, as a share of the step",
            "%",
            lambda: est.recompute_overhead("full", 4096, 4096),
        ),
        C(
            "trades",
            "Activation checkpointing trades:",
            ["activation memory for an extra forward"],
            ["model-state memory for communication", "accuracy for speed"],
            {
                "sharding activations across GPUs": "it "
                "recomputes, it does not shard: each rank keeps its own layers' inputs"
            },
        ),
    ),
}

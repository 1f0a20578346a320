"""Tensor parallelism: collectives and bytes per layer, step time, shards.

Megatron's collectives and bytes per layer, a layer's training FLOPs, the step
time over an interconnect (:data:`LINKS`), and the parameters one
tensor-parallel rank holds.

Taught in chapter 04 (tensor parallel); chapters 07 and 09 reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.estimate.collectives import collective_time, wire_bytes


# ---- tensor parallelism: collectives and bytes per layer, step time (chapter 04) ----
@dataclass(frozen=True)
class Link:
    """One interconnect as the α-β model sees it: ``bandwidth_Bps`` is what one GPU
    can push in one direction (the bus bandwidth a ring reaches at best), ``alpha_s``
    the latency of one ring step."""

    name: str
    bandwidth_Bps: float
    alpha_s: float


# Stated assumptions, per GPU. NVLink 4 on an H100 SXM: 900 GB/s both directions
# together, 450 GB/s each way. InfiniBand NDR: 400 Gb/s = 50 GB/s, one NIC per GPU as
# in a DGX H100. Ethernet: 100 Gb/s = 12.5 GB/s per GPU over TCP. Latencies are
# typical orders of magnitude of one hop, not datasheet figures.
LINKS: dict[str, Link] = {
    "nvlink": Link("NVLink 4, in a node (450 GB/s)", 450e9, 2e-6),
    "infiniband": Link("InfiniBand NDR, across nodes (50 GB/s)", 50e9, 5e-6),
    "ethernet": Link("Ethernet 100 Gb/s, across nodes (12.5 GB/s)", 12.5e9, 25e-6),
}


def tp_collectives_per_layer(
    sequence_parallel: bool = False,
) -> dict[str, dict[str, int]]:
    """Collectives one transformer layer runs on the tp group, per pass.

    Megatron-LM (Shoeybi et al. 2019, §3): attention and MLP each have one f
    (all-reduce backward) and one g (all-reduce forward): **2 all-reduces forward and
    2 backward**. Sequence parallelism (Korthikanti et al. 2022, §4.2.2) turns each
    all-reduce into an all-gather plus a reduce-scatter placed on either side of the
    LayerNorm/dropout region: 2 of each forward and 2 of each backward.
    """
    if sequence_parallel:
        both = {"all_gather": 2, "reduce_scatter": 2}
        return {"forward": dict(both), "backward": dict(both)}
    return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}


def tp_bytes_per_layer(
    micro_batch: int,
    seq_len: int,
    d_model: int,
    tp: int,
    *,
    bytes_per_value: float = 2,
    sequence_parallel: bool = False,
) -> dict:
    """Bytes one layer moves on the tp group per training step.

    Every collective is about the whole activation ``S = b·s·h·bytes_per_value``
    (all-gather output, reduce-scatter input, all-reduce buffer). Per rank, under
    the ring: 4 all-reduces send ``4 · 2(t-1)/t · S``; with sequence parallelism
    4 all-gathers and 4 reduce-scatters send ``8 · (t-1)/t · S``, the same bytes.
    Returns ``{"payload_bytes": S, "calls": {...}, "wire_bytes": per rank}``.
    """
    for name, value in (
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
        ("d_model", d_model),
        ("tp", tp),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    S = micro_batch * seq_len * d_model * bytes_per_value
    calls = tp_collectives_per_layer(sequence_parallel)
    wire = sum(
        count * wire_bytes(op, S, tp)
        for per_pass in calls.values()
        for op, count in per_pass.items()
    )
    return {"payload_bytes": S, "calls": calls, "wire_bytes": wire}


def tp_layer_flops(
    micro_batch: int, seq_len: int, d_model: int, d_ff: int | None = None
) -> float:
    """Training FLOPs (forward + backward = 3 × forward) of one GPT layer:
    ``3 · b·s · (8h² + 4·h·d_ff + 4·s·h)``; with ``d_ff = 4h`` this is Narayanan et
    al. 2021's ``72·b·s·h²·(1 + s/6h)`` (§5.1). Tensor parallelism divides it by t."""
    h, f = d_model, 4 * d_model if d_ff is None else d_ff
    return 3.0 * micro_batch * seq_len * (8 * h * h + 4 * h * f + 4 * seq_len * h)


def tp_step_time(
    n_layers: int,
    micro_batch: int,
    seq_len: int,
    d_model: int,
    tp: int,
    *,
    link: str | Link = "nvlink",
    peak_flops: float = 989e12,
    mfu: float = 0.5,
    d_ff: int | None = None,
    bytes_per_value: float = 2,
    sequence_parallel: bool = False,
) -> dict[str, float]:
    """Time of one microbatch through ``n_layers`` tensor-parallel layers when the
    tp group talks over ``link`` (a key of :data:`LINKS`, or a :class:`Link`).

    Compute: :func:`tp_layer_flops` ``/ t`` at ``mfu`` of ``peak_flops`` (default an
    H100's dense bf16). Communication: the collectives of
    :func:`tp_collectives_per_layer`, each timed by :func:`collective_time`. TP's
    collectives sit on the critical path (the next matmul needs their result), so
    the two add up. Returns ``{"compute_s", "comm_s", "total_s", "comm_fraction"}``.
    """
    if isinstance(link, str):
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}: expected one of {list(LINKS)}")
        link = LINKS[link]
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    per_layer = tp_bytes_per_layer(
        micro_batch,
        seq_len,
        d_model,
        tp,
        bytes_per_value=bytes_per_value,
        sequence_parallel=sequence_parallel,
    )
    S = per_layer["payload_bytes"]
    comm_layer = sum(
        count * collective_time(op, S, tp, link.alpha_s, link.bandwidth_Bps)
        for per_pass in per_layer["calls"].values()
        for op, count in per_pass.items()
    )
    flops = tp_layer_flops(micro_batch, seq_len, d_model, d_ff) / tp
    compute = n_layers * flops / (peak_flops * mfu)
    comm_s = n_layers * comm_layer
    total = compute + comm_s
    return {
        "compute_s": compute,
        "comm_s": comm_s,
        "total_s": total,
        "comm_fraction": comm_s / total if total else 0.0,
    }


def tp_params_per_rank(
    n_layers: int,
    d_model: int,
    vocab_size: int,
    tp: int,
    *,
    seq_len: int = 0,
    d_ff: int | None = None,
    bias: bool = False,
    layernorm: bool = False,
    tied_embeddings: bool = True,
) -> int:
    """Parameters one tensor-parallel rank holds (Megatron's split, dtlab's GPT).

    Sharded over t: q, k, v, the MLP's first matrix (columns) with their biases,
    the output projections (rows), and the vocabulary, padded to a multiple of t.
    Replicated: LayerNorms, position embeddings, and the row-parallel layers'
    biases (added once, after the all-reduce). Roughly ``12Lh²/t + Vh/t``; for
    ``tp=1`` it equals :func:`model_params`.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    h, f = d_model, 4 * d_model if d_ff is None else d_ff
    for what, n in (("d_model", h), ("d_ff", f)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what}={n}")
    per_layer = (4 * h * h + 2 * h * f) // tp
    if bias:
        per_layer += (3 * h + f) // tp + 2 * h  # column biases split, row ones whole
    if layernorm:
        per_layer += 4 * h
    v_local = -(-vocab_size // tp)  # padded_vocab(V, t) / t rows
    total = n_layers * per_layer + v_local * h + seq_len * h
    if not tied_embeddings:
        total += v_local * h
    if layernorm:
        total += 2 * h
    return total

"""Traffic of a layout: the bytes one rank sends per step, by axis.

:func:`layout_traffic` for a dp x tp x pp (x cp x ep) job, on the slice of the model
:func:`dtlab.estimate.layouts.stage_params` gives a rank.

Taught in chapter 09 (planning at scale); chapters 07 and 08 use it beside the
measured bytes.
"""

from __future__ import annotations

from dtlab.checks import one_of, positive_int
from dtlab.estimate.collectives import wire_bytes
from dtlab.estimate.context_parallel import cp_bytes_per_layer
from dtlab.estimate.layouts import (
    as_parallelism,
    padded_count,
    sharded_dense_count,
    stage_params,
    value_bytes,
)
from dtlab.estimate.models import layer_params, model_spec
from dtlab.estimate.moe import ep_bytes_per_layer
from dtlab.estimate.tensor_parallel import tp_bytes_per_layer
from dtlab.estimate.zero import zero_comm_per_step
from dtlab.events import CHECKPOINTING, schedule_name, state_precision


def _stage_traffic(
    spec, par, stage, *, zero_stage, precision, micro_batch_size, microbatches,
    sequence_parallel, chunks, seq_len, cp_variant, checkpointing,
) -> dict[str, float]:  # fmt: skip
    bpv = value_bytes(precision)
    k, b = microbatches, micro_batch_size
    s = seq_len or spec.seq_len
    h = spec.d_model
    sp = stage_params(spec, par, stage)
    group = par.dp * par.cp
    out = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    # full recomputation runs each block's forward again in backward, its
    # collectives included: the forward's share of every per-layer term, once more
    again = 1 if one_of("recompute mode", checkpointing, CHECKPOINTING) == "full" else 0
    # dp (and cp: the same weights): gradients, and ZeRO's gathers
    dense = sharded_dense_count(spec, par, sp, zero_stage)
    parts = [(dense, group, "dp")]
    if sp["experts"]:  # the experts: over the ranks that hold the same ones (edp)
        parts.append((sp["layers"] * sp["experts"], group // par.ep, "edp"))
    # ZeRO 2-3 reduce-scatter after every backward (microbatch, or pipeline
    # microbatch); DDP and ZeRO 0-1 accumulate full gradients, sync once per step
    per_mb = k if zero_stage >= 2 else 1
    for psi, n, axis in parts:
        if n == 1:
            continue
        one = zero_comm_per_step(psi, n, zero_stage, bpv)
        out[axis] = (
            out.get(axis, 0.0)
            + per_mb
            * (
                wire_bytes("all_reduce", one["all_reduce"], n)
                + wire_bytes("reduce_scatter", one["reduce_scatter"], n)
            )
            + (per_mb if zero_stage == 3 else 1)
            * wire_bytes("all_gather", one["all_gather"], n)
        )
    tokens = b * s // par.cp  # this rank's tokens of one microbatch
    first, last = stage == 0, stage == par.pp - 1
    # tp: Megatron's 2 + 2 collectives per block, the vocabulary-parallel
    # embedding (g) and head (f), and the loss's three small fp32 all-reduces
    if par.tp > 1:
        t = par.tp
        S = tokens * h * bpv
        one = tp_bytes_per_layer(
            b, s // par.cp, h, t, bytes_per_value=bpv,
            sequence_parallel=sequence_parallel,
        )  # fmt: skip
        # recomputed: the block's forward collectives but its last (the MLP's g),
        # whose output nothing in the block saves, so torch's checkpoint stops
        # before it: 1 all-reduce of 2, or 2 all-gathers and 1 reduce-scatter of 4
        rerun = (
            2 * wire_bytes("all_gather", S, t) + wire_bytes("reduce_scatter", S, t)
            if sequence_parallel
            else wire_bytes("all_reduce", S, t)
        )
        per_block = one["wire_bytes"] + again * rerun
        mb = sp["layers"] * per_block
        if first:  # embedding: g (SP: reduce-scatter forward, all-gather back)
            mb += wire_bytes("all_reduce", S, t)
        if last:
            mb += wire_bytes("all_reduce", S, t)  # head: f (SP: gather + scatter)
            # the loss's max, sum and target logit: fp32, whatever the precision
            mb += 3 * wire_bytes("all_reduce", tokens * 4, t)
        out["tp"] = k * mb
        if sequence_parallel:
            # the replicated weights of the sequence-split regions (norms,
            # row-parallel biases, positions) get their gradients summed over tp,
            # as each backward produces them (TensorParallelStage.sum_sequence_
            # parallel_grads_in_backward, which parallelize asks for): once per
            # microbatch, where Megatron sums once per step
            repl = sp["layers"] * layer_params(spec)["replicated"]
            if first and spec.learned_positions:
                repl += s * h
            if last and spec.layernorm:
                repl += 2 * h
            out["tp"] += k * wire_bytes("all_reduce", repl * bpv, t)
    # pp: activations forward and gradients backward at every chunk boundary
    if par.pp > 1:
        S = tokens * h * bpv / (par.tp if sequence_parallel else 1)
        v = chunks
        sends = (v - (1 if last else 0)) + (v - (1 if first else 0))
        out["pp"] = k * sends * S
        if spec.tied_embeddings and (first or last):
            # the embedding group sums the two copies' gradients: whole (in the
            # compute dtype) after DDP, or ZeRO's reduced slices (master dtype)
            rows = -(-spec.vocab_size // par.tp) * h
            payload = rows * bpv
            if zero_stage >= 1:
                master = 2 if state_precision(precision) == "pure_bf16" else 4
                payload = padded_count(rows, group) / group * master
            out["pp"] += wire_bytes("all_reduce", payload, 2)
    if par.cp > 1:
        # ring: K and V blocks go round the ring (cp-1 hops) forward, and again
        # with their gradients backward; Ulysses: two all-to-alls each way
        ring = cp_bytes_per_layer(
            b, s, h // par.tp, par.cp, variant=cp_variant,
            n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, bytes_per_value=bpv,
        )  # fmt: skip
        out["cp"] = k * sp["layers"] * (ring["wire_bytes"] + again * ring["forward"])
    if par.ep > 1 and spec.n_experts > 1:
        # dispatch and combine forward, their transposes backward (4 all-to-alls
        # of the kept rows, uniform routing), and the all-gather of row counts
        a2a = ep_bytes_per_layer(
            tokens, h, par.ep, n_experts=spec.n_experts, top_k=spec.top_k,
            bytes_per_value=bpv,
        )  # fmt: skip
        forward = a2a["dispatch"] + a2a["combine"] + a2a["counts"]
        out["ep"] = k * sp["layers"] * (a2a["wire_bytes"] + again * forward)
    return out


def layout_traffic(
    model,
    layout,
    *,
    zero_stage: int = 0,
    precision: str = "fp32",
    micro_batch_size: int = 1,
    microbatches: int = 1,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    chunks: int = 1,
    stage: int | None = None,
    seq_len: int | None = None,
    cp_variant: str = "ring",
    checkpointing: str = "none",
) -> dict[str, float]:
    """Wire bytes one rank sends per optimizer step, by axis: ``{"dp", "tp", "pp"}``
    (plus ``"cp"`` and ``"ep"`` when those axes are used), for pipeline stage
    ``stage`` or, by default, the busiest rank on each axis.

    - dp: :func:`zero_comm_per_step` on the stage's Ψ over the ``dp·cp`` replicas
      (a mixture of experts' experts: over the ``dp·cp/ep`` ranks holding the same
      ones, key ``"edp"``)
      (2Ψ, ZeRO-3 3Ψ, times the ring's (N-1)/N). ZeRO-2 and -3 do not keep the
      full gradient, so with several microbatches (gradient accumulation, or a
      pipeline's) they pay their reduce-scatter (and ZeRO-3 its gathers) per
      microbatch; DDP and ZeRO-0/1 accumulate and pay once per step.
    - tp: :func:`tp_bytes_per_layer` per block and microbatch (2 + 2 all-reduces,
      or their all-gather/reduce-scatter halves under sequence parallelism), plus
      the vocabulary-parallel embedding and head and the loss's three all-reduces
      of ``b·s`` values.
    - pp: one activation forward and one gradient backward per microbatch at
      every stage boundary the rank owns (``chunks`` per rank when interleaved),
      plus the tied-embedding all-reduce between the first and the last stage
      (under ZeRO, of the reduced fp32 slices).
    - cp (:func:`cp_bytes_per_layer`): ring attention's K/V, ``3·(cp-1)/cp ·
      2·b·s·h_kv·bytes`` per layer (``cp_variant="ring"``), or Ulysses' four
      all-to-alls of q, k, v and the output.
    - ep (:func:`ep_bytes_per_layer`): 4 all-to-alls of ``b·s/cp·top_k·h·bytes``
      per MoE layer under uniform routing, and the all-gather of the row counts.

    ``checkpointing="full"`` recomputes each block's forward in backward, and with it
    the forward's collectives (Korthikanti et al. 2022, §5, count the extra
    all-reduce): the ring's or Ulysses' forward, the dispatch, combine and counts,
    and tp's forward collectives but the block's last. torch's non-reentrant
    checkpoint stops recomputing once every tensor backward needs is rebuilt, and
    nothing in the block saves the output of the MLP's g: one all-reduce of two is
    sent again (under sequence parallelism, three collectives of four). Selective
    recomputation reruns only the attention core, which sends nothing on tp.

    Gradients and 16-bit activations travel in the compute dtype (2 bytes under
    "bf16"/"fp16", 4 under "fp32").
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {zero_stage!r}: expected 0, 1, 2 or 3")
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("microbatches", microbatches),
        ("chunks", chunks),
    ):
        positive_int(name, value)
    value_bytes(precision)
    if par.pp > 1:
        schedule_name(schedule)  # every schedule moves the same bytes
    kw = dict(
        zero_stage=zero_stage, precision=precision,
        micro_batch_size=micro_batch_size, microbatches=microbatches,
        sequence_parallel=sequence_parallel, chunks=chunks, seq_len=seq_len,
        cp_variant=cp_variant, checkpointing=checkpointing,
    )  # fmt: skip
    if stage is not None:
        return _stage_traffic(spec, par, stage, **kw)
    # the first (most layers, the embedding), a middle one (sends both ways) and the
    # last (the head) bound every stage on every axis
    stages = sorted({0, min(1, par.pp - 1), par.pp - 1})
    per_stage = [_stage_traffic(spec, par, s, **kw) for s in stages]
    return {k: max(t[k] for t in per_stage) for k in per_stage[0]}

"""Layouts: memory and traffic of a dp x tp x pp (x cp x ep) job.

:class:`Parallelism` (a layout with context and expert parallelism),
:func:`stage_params` (the slice of the model one rank holds), and
:func:`layout_memory` and :func:`layout_traffic`, built from the formulas of the
lower modules (states, activations, pipeline, tensor_parallel, zero).

Taught in chapter 09 (planning at scale); chapters 07 and 08 use
:func:`layout_memory` and :func:`layout_traffic`.
"""

from __future__ import annotations

import math

from dtlab.checks import one_of, positive_int
from dtlab.estimate.activations import (
    RECOMPUTE,
    activation_bytes_per_layer,
    dtlab_saved_bytes_outside_layers,
    dtlab_saved_bytes_per_layer,
)
from dtlab.estimate.collectives import wire_bytes
from dtlab.estimate.context_parallel import cp_bytes_per_layer
from dtlab.estimate.models import layer_params, model_spec
from dtlab.estimate.moe import ep_bytes_per_layer
from dtlab.estimate.pipeline import pipeline_in_flight
from dtlab.estimate.states import zero_memory_per_device
from dtlab.estimate.tensor_parallel import tp_bytes_per_layer
from dtlab.estimate.zero import zero_comm_per_step, zero_states_per_rank
from dtlab.events import schedule_name, state_precision
from dtlab.topology import Layout

# ---- layouts: memory and traffic of a dp x tp x pp (x cp x ep) job (chapter 09) ------
# The planner's building blocks. Every number below is one of the formulas above,
# applied to the slice of the model one rank holds: tp_params_per_rank's split,
# pipeline_in_flight's count, Korthikanti's activations, ZeRO's states and traffic.


# ``Parallelism`` was this module's own dp x tp x pp x cp x ep layout; it is now
# dtlab.topology's Layout, the one definition (rank order, validation, groups).
Parallelism = Layout


def as_parallelism(layout) -> Parallelism:
    """A :class:`Parallelism` from a ``Layout``, a Parallelism, or a dict."""
    if isinstance(layout, Parallelism):
        return layout
    if isinstance(layout, dict):
        return Parallelism(**layout)
    try:
        return Parallelism(
            layout.dp,
            layout.tp,
            layout.pp,
            getattr(layout, "cp", 1),
            getattr(layout, "ep", 1),
        )
    except AttributeError:
        raise ValueError(
            f"layout must be a Layout, a Parallelism or a dict of degrees, "
            f"got {layout!r}"
        ) from None


def stage_layers(n_layers: int, pp: int, stage: int) -> int:
    """Blocks on pipeline rank ``stage``: ``L/pp``, the first ``L mod pp`` ranks one
    more when pp does not divide L (Llama 3's 126 layers)."""
    return n_layers // pp + (1 if stage < n_layers % pp else 0)


def stage_params(model, layout, stage: int = 0) -> dict[str, float]:
    """Parameters one rank of pipeline stage ``stage`` holds, before ZeRO.

    Tensor parallelism splits every block as :func:`tp_params_per_rank` does
    (everything but LayerNorms and row-parallel biases) and the vocabulary, padded
    to a multiple of tp; experts are split over ep (and tp); the embedding sits on
    the first stage, the final norm and the head on the last, and a tied head on a
    last stage that is not the first is a copy (dtlab.pipeline's StageModule).

    Returns ``{"blocks": per-block count, "experts": per-block expert count,
    "layers": blocks on this rank, "root": the rest, "vocab": the embedding and
    head rows within root, "total"}``.
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if not 0 <= stage < par.pp:
        raise ValueError(f"stage {stage} is outside 0..{par.pp - 1}")
    t, h = par.tp, spec.d_model
    per = layer_params(spec)
    block = (per["dense"] - per["replicated"]) / t + per["replicated"]
    experts = per["experts"] / (t * par.ep)
    layers = stage_layers(spec.n_layers, par.pp, stage)
    first, last = stage == 0, stage == par.pp - 1
    vocab_rows = -(-spec.vocab_size // t) * h  # padded_vocab(V, t) / t rows
    root, vocab = 0.0, 0.0
    if first:
        vocab += vocab_rows
        root += spec.seq_len * h if spec.learned_positions else 0
    if last:
        root += 2 * h if spec.layernorm else 0
        if not spec.tied_embeddings or par.pp > 1:
            vocab += vocab_rows
    root += vocab
    return {
        "blocks": block,
        "experts": experts,
        "layers": layers,
        "root": root,
        "vocab": vocab,
        "total": root + layers * (block + experts),
    }


def sharded_dense_count(spec, par, sp, zero_stage: int) -> float:
    """Ψ of the stage's dense weights as dtlab shards them: under ZeRO every unit
    (each block, the rest; with a tied embedding across stages, the embedding or
    the head on its own, so the two copies' slices line up) padded to a multiple
    of the ``dp·cp`` group (dtlab.zero, dtlab.parallelize)."""
    if zero_stage == 0:
        return sp["root"] + sp["layers"] * sp["blocks"]
    group = par.dp * par.cp
    units = [sp["root"]]
    if par.pp > 1 and spec.tied_embeddings and sp["vocab"]:
        units = [sp["vocab"], sp["root"] - sp["vocab"]]
    pad = sum(_padded_count(u, group) for u in units)
    return pad + sp["layers"] * _padded_count(sp["blocks"], group)


def _padded_count(n: float, group: int) -> float:
    """ZeRO pads each unit to a multiple of the group (dtlab.zero)."""
    return math.ceil(n / group) * group


def value_bytes(precision: str) -> int:
    """Bytes of an activation, a gathered weight, a reduced gradient: 4 under fp32,
    2 under any 16-bit precision (:func:`dtlab.events.state_precision`)."""
    return 4 if state_precision(precision) == "fp32" else 2


def _stage_memory(
    spec, par, stage, *, zero_stage, precision, micro_batch_size, microbatches,
    schedule, chunks, checkpointing, sequence_parallel, optimizer, offload, states,
    seq_len, activations, dropout, cp_variant, dropout_mask_bytes, zero_shard_size,
) -> dict[str, float]:  # fmt: skip
    sp = stage_params(spec, par, stage)
    # the replicas of every weight ZeRO shards over: all of them, or HSDP's group
    group = zero_shard_size or par.dp * par.cp
    expert_group = group // par.ep
    policy = state_precision(precision)
    dense = sharded_dense_count(spec, par, sp, zero_stage)
    out = dict.fromkeys(("params", "grads", "optimizer"), 0.0)
    host = 0.0
    parts = [(dense, group)]
    if sp["experts"]:
        parts.append((sp["layers"] * sp["experts"], expert_group))
    for psi, n in parts:
        # DDP (stage 0) keeps 16-bit gradients; its optimizer's fp32 copy of them
        # lives only during the step, so the paper's count is what it holds
        if states == "paper" or (zero_stage == 0 and not offload):
            st = zero_memory_per_device(psi, n, zero_stage, policy, optimizer)
        else:
            st = zero_states_per_rank(
                psi, n, zero_stage, policy, optimizer, offload=offload
            )
            host += st["host"]
        for k in out:
            out[k] += st[k]
    # activations: per layer (Korthikanti's, or what dtlab's GPT saves), for every
    # microbatch (chunk) in flight
    s = seq_len or spec.seq_len
    b, bpv = micro_batch_size, value_bytes(precision)
    layer_kw = dict(tp=par.tp, sequence_parallel=sequence_parallel)
    if activations == "dtlab":
        per_layer = dtlab_saved_bytes_per_layer(
            s, b, spec.d_model, spec.n_heads, d_ff=spec.d_ff, recompute=checkpointing,
            bytes_per_value=bpv, dropout=dropout, cp=par.cp, cp_variant=cp_variant,
            dropout_mask_bytes=dropout_mask_bytes, **layer_kw,
        )  # fmt: skip
    else:
        per_layer = activation_bytes_per_layer(
            s, b, spec.d_model, spec.n_heads, recompute=checkpointing,
            bytes_per_value=bpv, **layer_kw,
        ) / par.cp  # fmt: skip
    if spec.n_experts > 1 and checkpointing != "full":
        # each token runs top_k experts: the MLP's 19sbh of the 34, k times
        per_layer += (
            (spec.top_k - 1) * 19 * s * b * spec.d_model * bpv / 2 / (par.tp * par.cp)
        )
    if par.pp > 1:
        key = schedule_name(schedule)
        v = chunks if key == "interleaved" else 1
        in_flight = pipeline_in_flight(par.pp, stage, microbatches, key, v)
        layers_in_flight = in_flight * sp["layers"] / v
        last_in_flight = 1 if key != "gpipe" else microbatches
        first_in_flight = in_flight
    else:
        layers_in_flight, last_in_flight, first_in_flight = sp["layers"], 1, 1
    acts = layers_in_flight * per_layer
    if activations == "dtlab":
        # what the embeddings and the head save (tp = 1; the forward's count, so
        # no recomputation transient)
        first, last = stage == 0, stage == par.pp - 1
        kw = dict(
            tp=par.tp,
            sequence_parallel=sequence_parallel,
            bytes_per_value=bpv,
            logits_bytes=4,  # the loss is computed in fp32 (dtlab.model.GPT.output)
        )
        local = s // par.cp  # this rank's tokens of each sequence
        if first:
            acts += first_in_flight * dtlab_saved_bytes_outside_layers(
                local, b, spec.d_model, spec.vocab_size, first=True, last=False, **kw
            )
        if last:
            acts += last_in_flight * dtlab_saved_bytes_outside_layers(
                local, b, spec.d_model, spec.vocab_size, first=False, last=True, **kw
            )
    else:
        if checkpointing == "full" and sp["layers"]:
            # backward recomputes one layer at a time: its whole activations, once
            acts += activation_bytes_per_layer(
                s, b, spec.d_model, spec.n_heads, bytes_per_value=bpv, **layer_kw
            ) / par.cp  # fmt: skip
        if stage == par.pp - 1:
            # beyond Korthikanti's blocks: the final norm's and the head's inputs
            # (2sbh) and the fp32 log-softmax of the cross-entropy (4·sb·V/t bytes)
            tokens = s * b / par.cp
            vocab = -(-spec.vocab_size // par.tp)
            acts += last_in_flight * tokens * (2 * spec.d_model * bpv + 4 * vocab)
    out["activations"] = acts
    out["total"] = sum(out.values())
    if offload:
        out["host"] = host
    return out


def layout_memory(
    model,
    layout,
    *,
    zero_stage: int = 0,
    precision: str = "fp32",
    micro_batch_size: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    chunks: int = 1,
    checkpointing: str = "none",
    sequence_parallel: bool = False,
    stage: int | None = None,
    optimizer: str = "adam",
    offload: bool = False,
    states: str = "dtlab",
    seq_len: int | None = None,
    activations: str = "paper",
    cp_variant: str = "ring",
    dropout_mask_bytes: int = 1,
    zero_shard_size: int | None = None,
) -> dict[str, float]:
    """Bytes one device holds under ``layout``, by category:
    ``{"params", "grads", "optimizer", "activations", "total"}`` (and ``"host"``
    with ``offload``), for pipeline stage ``stage`` or, by default, the most loaded.

    - Model states: the stage's slice of the model (:func:`stage_params`: tp and
      pp split it, ep splits the experts), then ZeRO ``zero_stage`` over the
      ``dp·cp`` ranks that replicate it. ``states="dtlab"`` counts what dtlab's
      implementation holds (:func:`zero_states_per_rank`: exact against
      dtlab.memory's measurement, units padded to the group); ``states="paper"``
      is ZeRO §5.1's ``2Ψ + 2Ψ + KΨ`` split (:func:`zero_memory_per_device`).
      The two differ only for ZeRO under 16-bit precision, by the fp32 gradient
      slice (``4Ψ/N``) the optimizer reads; DDP (stage 0) holds the paper's
      count. Adam's per-tensor step counter (4 bytes a tensor) is left out.
    - Activations: Korthikanti et al. 2022 per layer
      (:func:`activation_bytes_per_layer`: ``sbh(34 + 5as/h)``, tp and sequence
      parallelism, ``checkpointing`` "none" | "selective" | "full"), divided by cp,
      times the layers of every microbatch the stage holds at its peak
      (:func:`pipeline_in_flight`; one microbatch without pipelining: gradient
      accumulation runs each backward right after its forward). Full
      checkpointing adds one layer's activations (the one being recomputed, live
      during its backward only); the last stage adds the head's inputs and the
      fp32 log-softmax. An upper bound for dtlab's GPT, which has no dropout
      (the paper counts dropout masks). ``activations="dtlab"`` counts instead
      what dtlab's GPT saves in its forward, exactly
      (:func:`dtlab_saved_bytes_per_layer`, plus the embeddings' and the head's
      saved tensors): what dtlab.memory measures. ``dropout_mask_bytes``: what a
      dropout mask costs per value with dropout on (1 on a GPU; on a CPU the
      values' size: :func:`dropout_mask_bytes`). ``zero_shard_size``: HSDP's shard
      group (chapter 11): ZeRO shards the states over that many replicas and
      replicates them across the groups (:func:`hsdp_states_per_rank`).

    ``precision``: "fp32", or "bf16"/"fp16" (16-bit compute, fp32 master weights,
    2-byte activations), or "pure_bf16". ``microbatches``: per optimizer step and
    dp rank (pipeline microbatches, or gradient accumulation without pp).
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {zero_stage!r}: expected 0, 1, 2 or 3")
    replicas = par.dp * par.cp
    if zero_shard_size is not None and replicas % positive_int(
        "zero_shard_size", zero_shard_size
    ):
        raise ValueError(
            f"zero_shard_size={zero_shard_size} does not divide the {replicas} "
            "data-parallel ranks: HSDP cuts them into equal shard groups"
        )
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("microbatches", microbatches),
        ("chunks", chunks),
    ):
        positive_int(name, value)
    if states not in ("dtlab", "paper"):
        raise ValueError(f"states must be 'dtlab' or 'paper', got {states!r}")
    if offload and states == "paper":
        raise ValueError("offload is modelled with states='dtlab' only")
    checkpointing = one_of("checkpointing", checkpointing, RECOMPUTE)
    activations = one_of("activations", activations, ("paper", "dtlab"))
    if par.pp > 1:
        schedule_name(schedule)
    kw = dict(
        zero_stage=zero_stage, precision=precision,
        micro_batch_size=micro_batch_size, microbatches=microbatches,
        schedule=schedule, chunks=chunks, checkpointing=checkpointing,
        sequence_parallel=sequence_parallel, optimizer=optimizer, offload=offload,
        states=states, seq_len=seq_len, activations=activations,
        dropout=getattr(model, "dropout", 0.0) > 0,  # a dtlab GPTConfig's
        cp_variant=cp_variant, dropout_mask_bytes=dropout_mask_bytes,
        zero_shard_size=zero_shard_size,
    )  # fmt: skip
    if stage is not None:
        return _stage_memory(spec, par, stage, **kw)
    # the most loaded is the first (most layers and microbatches in flight) or the
    # last (the head); the stages between hold no more than the first
    per_stage = [_stage_memory(spec, par, s, **kw) for s in sorted({0, par.pp - 1})]
    return max(per_stage, key=lambda m: m["total"])


def _stage_traffic(
    spec, par, stage, *, zero_stage, precision, micro_batch_size, microbatches,
    sequence_parallel, chunks, seq_len, cp_variant,
) -> dict[str, float]:  # fmt: skip
    bpv = value_bytes(precision)
    k, b = microbatches, micro_batch_size
    s = seq_len or spec.seq_len
    h = spec.d_model
    sp = stage_params(spec, par, stage)
    group = par.dp * par.cp
    out = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
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
        per_block = tp_bytes_per_layer(
            b, s // par.cp, h, t, bytes_per_value=bpv,
            sequence_parallel=sequence_parallel,
        )["wire_bytes"]  # fmt: skip
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
            # row-parallel biases, positions) get their gradients summed over tp
            repl = sp["layers"] * layer_params(spec)["replicated"]
            if first and spec.learned_positions:
                repl += s * h
            if last and spec.layernorm:
                repl += 2 * h
            out["tp"] += wire_bytes("all_reduce", repl * bpv, t)
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
                payload = _padded_count(rows, group) / group * master
            out["pp"] += wire_bytes("all_reduce", payload, 2)
    if par.cp > 1:
        # ring: K and V blocks go round the ring (cp-1 hops) forward, and again
        # with their gradients backward; Ulysses: two all-to-alls each way
        per_layer = cp_bytes_per_layer(
            b, s, h // par.tp, par.cp, variant=cp_variant,
            n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, bytes_per_value=bpv,
        )["wire_bytes"]  # fmt: skip
        out["cp"] = k * sp["layers"] * per_layer
    if par.ep > 1 and spec.n_experts > 1:
        # dispatch and combine forward, their transposes backward (4 all-to-alls
        # of the kept rows, uniform routing), and the all-gather of row counts
        per_layer = ep_bytes_per_layer(
            tokens, h, par.ep, n_experts=spec.n_experts, top_k=spec.top_k,
            bytes_per_value=bpv,
        )["wire_bytes"]  # fmt: skip
        out["ep"] = k * sp["layers"] * per_layer
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
        cp_variant=cp_variant,
    )  # fmt: skip
    if stage is not None:
        return _stage_traffic(spec, par, stage, **kw)
    # the first (most layers, the embedding), a middle one (sends both ways) and the
    # last (the head) bound every stage on every axis
    stages = sorted({0, min(1, par.pp - 1), par.pp - 1})
    per_stage = [_stage_traffic(spec, par, s, **kw) for s in stages]
    return {k: max(t[k] for t in per_stage) for k in per_stage[0]}

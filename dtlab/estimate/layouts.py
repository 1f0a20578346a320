"""Layouts: the slice of the model a rank holds, and its memory, in a dp x tp x pp
(x cp x ep) job.

:class:`Parallelism` (a layout with context and expert parallelism),
:func:`stage_params` (the slice of the model one rank holds) and
:func:`layout_memory`, built from the formulas of the lower modules (states,
activations, context_parallel, pipeline, zero); :mod:`.traffic` has
:func:`layout_traffic`, the bytes the same layout sends.

Taught in chapter 09 (planning at scale); chapters 07 and 08 use
:func:`layout_memory` and :func:`layout_traffic`.
"""

from __future__ import annotations

import math

from dtlab.checks import one_of, positive_int
from dtlab.estimate.activations import (
    activation_bytes_per_layer,
    dtlab_saved_bytes_outside_layers,
    dtlab_saved_bytes_per_layer,
)
from dtlab.estimate.context_parallel import cp_activation_bytes_per_layer
from dtlab.estimate.models import layer_params, model_spec
from dtlab.estimate.pipeline import pipeline_in_flight
from dtlab.estimate.states import zero_memory_per_device
from dtlab.estimate.zero import zero_states_per_rank
from dtlab.events import CHECKPOINTING, schedule_name, state_precision
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
    pad = sum(padded_count(u, group) for u in units)
    return pad + sp["layers"] * padded_count(sp["blocks"], group)


def padded_count(n: float, group: int) -> float:
    """``n`` rounded up to a multiple of ``group``, as ZeRO pads each unit."""
    return math.ceil(n / group) * group


def value_bytes(precision: str) -> int:
    """Bytes of an activation, a gathered weight, a reduced gradient: 4 under fp32,
    2 under any 16-bit precision (:func:`dtlab.events.state_precision`)."""
    return 4 if state_precision(precision) == "fp32" else 2


def layer_shape(spec) -> dict:
    """A preset's keywords of :func:`activation_bytes_per_layer` (the MLP's width
    and gate, grouped-query attention, dropout)."""
    return dict(
        d_ff=spec.d_ff,
        n_kv_heads=spec.n_kv_heads,
        gated_mlp=spec.gated_mlp,
        dropout=spec.dropout,
    )


def paper_layer_bytes(spec, s, b, par, *, cp_variant="ring", **kw) -> float:
    """Korthikanti's activation bytes of one of ``spec``'s layers on one rank of
    ``par``: :func:`activation_bytes_per_layer`, or under cp
    :func:`cp_activation_bytes_per_layer` (ring: no score matrix)."""
    args = (s, b, spec.d_model, spec.n_heads)
    if par.cp > 1:
        return cp_activation_bytes_per_layer(
            *args, par.cp, variant=cp_variant, **layer_shape(spec), **kw
        )
    return activation_bytes_per_layer(*args, **layer_shape(spec), **kw)


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
        per_layer = paper_layer_bytes(
            spec, s, b, par, recompute=checkpointing, bytes_per_value=bpv,
            cp_variant=cp_variant, **layer_kw,
        )  # fmt: skip
    if spec.n_experts > 1 and checkpointing != "full":
        # each token runs top_k experts: the MLP's share of the count (its input,
        # 4 or 6 d_ff/h, a dropout mask; 19sbh of Korthikanti's 34), k times
        f = spec.d_ff / spec.d_model
        mlp = 2 + (6 if spec.gated_mlp else 4) * f + (1 if spec.dropout else 0)
        per_layer += (
            (spec.top_k - 1) * mlp * s * b * spec.d_model * bpv / 2 / (par.tp * par.cp)
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
            # backward recomputes one layer at a time: its whole activations,
            # once (under ring cp, without a score matrix)
            acts += paper_layer_bytes(
                spec, s, b, par, recompute="none", bytes_per_value=bpv,
                cp_variant=cp_variant, **layer_kw,
            )  # fmt: skip
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
      parallelism, ``checkpointing`` "none" | "selective" | "full"; a Llama-style
      preset's own terms: SwiGLU's width, grouped-query K and V, no dropout), under
      cp :func:`cp_activation_bytes_per_layer` (``cp_variant``: the ring keeps no
      score matrix, Ulysses divides it by cp),
      times the layers of every microbatch the stage holds at its peak
      (:func:`pipeline_in_flight`; one microbatch without pipelining: gradient
      accumulation runs each backward right after its forward). Full
      checkpointing adds one layer's activations (the one being recomputed, live
      during its backward only; its score matrix divided by tp and, under
      Ulysses, cp; none under the ring); the last stage adds the head's inputs
      and the fp32 log-softmax. An upper bound for dtlab's GPT, which has no dropout
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
    checkpointing = one_of("checkpointing", checkpointing, CHECKPOINTING)
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

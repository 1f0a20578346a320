"""Chapter 09's reference solutions: the planner's step-time model, and the model
states one rank holds under each ZeRO stage. ``dtlab.exercises.solution(name)``
shows each; :mod:`.ch09_planning` checks a learner's against them."""

from __future__ import annotations

__all__ = ["step_time", "zero_states"]


def step_time(
    model,
    layout,
    *,
    gpu,
    cluster,
    zero_stage,
    micro_batch_size,
    microbatches,
    sequence_parallel,
    mfu=0.5,
    dp_overlap=0.8,
):
    """Seconds of one training step of ``model`` (a ``dtlab.estimate.ModelPreset``)
    on ``layout`` (dp × tp × pp, 1F1B, bf16, no recomputation), split into compute,
    the communication of each axis that is not hidden, and the pipeline's bubble.

    Per microbatch through the most loaded stage (its ceil(L/pp) layers): compute
    is Narayanan's 3·b·s·(8h² + 4h·d_ff + 4sh) FLOPs per layer (a gated MLP's third
    matrix counted as a 1.5× wider d_ff) plus the head's 6·b·s·h·V spread over the
    stages, ÷ tp, at ``mfu`` of the GPU's peak. TP adds 4 all-reduces of b·s·h
    values per layer (SP: 4 all-gathers and 4 reduce-scatters, the same bytes) on
    the critical path; PP an activation forward and a gradient backward (÷ tp under
    SP). A forward is a third of it, a backward two thirds. 1F1B takes
    (m + p − 1)(t_f + t_b): the p − 1 extra is the bubble. DP's collectives (ZeRO-2
    reduce-scatters every microbatch, ZeRO-3 gathers too) hide behind the last
    backward up to ``dp_overlap`` of them. Every collective is timed α-β."""
    from dtlab import estimate as est

    dp, tp, pp = layout.dp, layout.tp, layout.pp
    b, m, s, h = micro_batch_size, microbatches, model.seq_len, model.d_model
    layers = -(-model.n_layers // pp)  # the first stage holds the most
    d_ff = model.d_ff * (1.5 if model.gated_mlp else 1.0)
    flops = layers * est.tp_layer_flops(b, s, h, d_ff) / tp
    flops += 6 * b * s * h * model.vocab_size / tp / pp  # the head, spread
    compute = flops / (gpu.peak_bf16_flops * mfu)  # one microbatch, one stage
    act = b * s * h * 2  # one activation: b·s·h bf16 values

    def timed(op, payload, n, span):
        link = cluster.link(span)  # NVLink inside a node, else the slower link
        return est.collective_time(op, payload, n, link.alpha_s, link.bandwidth_Bps)

    tp_mb = 0.0
    if tp > 1:
        ops = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
        tp_mb = layers * 4 * sum(timed(op, act, tp, tp) for op in ops)
    p2p = 0.0
    if pp > 1:
        link = cluster.link(tp * dp + 1)  # the next stage is tp·dp ranks away
        sent = act / (tp if sequence_parallel else 1)
        p2p = 2 * (link.alpha_s + sent / link.bandwidth_Bps)
    t_f = (compute + tp_mb) / 3 + p2p / 2
    t_b = 2 * (compute + tp_mb) / 3 + p2p / 2
    bubble = (pp - 1) * (t_f + t_b)
    dp_s = 0.0
    if dp > 1:
        psi = est.stage_params(model, layout, 0)["total"]
        ops = est.zero_comm_per_step(psi, dp, zero_stage, 2)
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            every_mb = zero_stage == 3 or (zero_stage == 2 and op == "reduce_scatter")
            if ops[op]:
                dp_s += (m if every_mb else 1) * timed(op, ops[op], dp, tp * dp)
    exposed = dp_s - min(dp_overlap * dp_s, t_b)  # hidden behind the last backward
    return {
        "compute_s": m * compute,
        "tp_s": m * tp_mb,
        "pp_s": m * p2p,
        "dp_s": exposed,
        "bubble_s": bubble,
        "step_s": m * (t_f + t_b) + bubble + exposed,
    }


def zero_states(psi, n, stage):
    """Bytes of fp32 AdamW's model states one of ``n`` data-parallel ranks holds
    under ZeRO ``stage`` for ``psi`` parameters (padded to a multiple of n): 4 of
    weights, 4 of gradient and 8 of moments per parameter; stage 1 shards the
    moments, stage 2 the gradients as well, stage 3 the weights too (ZeRO §5)."""
    return {
        "params": 4 * psi // (n if stage >= 3 else 1),
        "grads": 4 * psi // (n if stage >= 2 else 1),
        "optimizer": 8 * psi // (n if stage >= 1 else 1),
    }

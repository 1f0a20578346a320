"""Right answers written differently from the reference are accepted, chapters 09
to 11: the step time and the states per rank of chapter 09's planning, DDP's wire
bytes, the online-softmax merge, the MoE dispatch permutation and the all-to-all's
splits. Each answer was written from what the learner sees (the stub cell, the
exercise's markdown, the checker's ``measures=``) before the reference or the
checker's body was read; the wrong answers are slips a learner makes that the
catalogues did not hold, each proven rejected with a message that names its
cause. Answers that run on the engines travel by value and import what they
use."""

import pytest
import torch

from dtlab.exercises import (
    ExerciseFailed,
    check_all_to_all_splits,
    check_ddp_wire_bytes,
    check_merge_attention,
    check_moe_dispatch,
    check_step_time,
    check_zero_states,
)
from dtlab.lab.kernel.shipping import ship_by_value


# ---- ch09 step_time: the planner's step-time model -----------------------------------
def step_time_part_by_part(
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
    _sharded_every_microbatch=True,
):
    """Each part timed per microbatch with est.collective_time, then scaled.
    (``_sharded_every_microbatch=False`` is the wrong answer below.)"""
    import math

    from dtlab import estimate as est

    b, s, h, m = micro_batch_size, model.seq_len, model.d_model, microbatches
    dp, tp, pp = layout.dp, layout.tp, layout.pp
    d_ff = 1.5 * model.d_ff if model.gated_mlp else model.d_ff
    layers = math.ceil(model.n_layers / pp)
    flops = (
        layers * est.tp_layer_flops(b, s, h, d_ff) + 6 * b * s * h * model.vocab_size
    )
    t_compute = flops / tp / (mfu * gpu.peak_bf16_flops)  # one microbatch
    act = b * s * h * 2  # bf16 bytes
    t_tp = 0.0
    if tp > 1:
        link = cluster.link(tp)
        ops = (
            {"all_gather": 4, "reduce_scatter": 4}
            if sequence_parallel
            else {"all_reduce": 4}
        )
        for op, count in ops.items():
            t = est.collective_time(op, act, tp, link.alpha_s, link.bandwidth_Bps)
            t_tp += layers * count * t
    t_p2p = 0.0
    if pp > 1:
        link = cluster.link(tp * dp + 1)
        size = act / tp if sequence_parallel else act
        t_p2p = 2 * (link.alpha_s + size / link.bandwidth_Bps)
    t_f = (t_compute + t_tp) / 3 + t_p2p / 2
    t_b = 2 * (t_compute + t_tp) / 3 + t_p2p / 2
    bubble = (pp - 1) * (t_f + t_b)
    dp_time = 0.0
    if dp > 1:
        psi = max(est.stage_params(model, layout, st)["total"] for st in (0, pp - 1))
        comm = est.zero_comm_per_step(psi, dp, zero_stage, bytes_per_value=2)
        link = cluster.link(tp * dp)
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            if not comm.get(op):
                continue
            per_mb = zero_stage == 3 or (zero_stage == 2 and op == "reduce_scatter")
            calls = m if per_mb and _sharded_every_microbatch else 1
            t = est.collective_time(op, comm[op], dp, link.alpha_s, link.bandwidth_Bps)
            dp_time += calls * t
        dp_time -= min(dp_overlap * dp_time, t_b)
    parts = {
        "compute_s": m * t_compute,
        "tp_s": m * t_tp,
        "pp_s": m * t_p2p,
        "dp_s": dp_time,
        "bubble_s": bubble,
    }
    parts["step_s"] = sum(parts.values())
    return parts


def step_time_from_wire_bytes(
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
    """The α-β model written out: wire bytes over the bandwidth plus α per ring
    step (est.tp_bytes_per_layer for tp), the bubble as pipeline_step_time's
    excess over m·(t_f + t_b), and the ZeRO traffic from its wire total."""
    from dtlab import estimate as est

    b, s, h, m = micro_batch_size, model.seq_len, model.d_model, microbatches
    dp, tp, pp = layout.dp, layout.tp, layout.pp
    layers = -(-model.n_layers // pp)
    d_ff = model.d_ff * (1.5 if model.gated_mlp else 1.0)
    per_layer = 3 * b * s * (8 * h * h + 4 * h * d_ff + 4 * s * h)
    head = 6 * b * s * h * model.vocab_size
    compute = (layers * per_layer + head) / tp / (gpu.peak_bf16_flops * mfu)

    tp_time = 0.0
    if tp > 1:
        link = cluster.link(tp)
        wire = est.tp_bytes_per_layer(b, s, h, tp, sequence_parallel=sequence_parallel)
        steps = (8 if sequence_parallel else 4 * 2) * (tp - 1)  # ring steps a layer
        tp_time = layers * (
            wire["wire_bytes"] / link.bandwidth_Bps + steps * link.alpha_s
        )

    p2p = 0.0
    if pp > 1:
        link = cluster.link(tp * dp + 1)
        p2p = (
            2 * link.alpha_s
            + 2
            * (b * s * h * 2 / (tp if sequence_parallel else 1))
            / link.bandwidth_Bps
        )

    work = compute + tp_time
    t_f, t_b = work / 3 + p2p / 2, 2 * work / 3 + p2p / 2
    bubble = est.pipeline_step_time(pp, m, t_f, t_b) - m * (t_f + t_b)

    exposed = 0.0
    if dp > 1:
        psi = max(est.stage_params(model, layout, q)["total"] for q in {0, pp - 1})
        c = est.zero_comm_per_step(psi, dp, zero_stage, bytes_per_value=2)
        link, ring = cluster.link(tp * dp), (dp - 1) / dp

        def timed(op, payload, calls):
            steps = 2 * (dp - 1) if op == "all_reduce" else dp - 1
            wire = payload * ring * (2 if op == "all_reduce" else 1)
            return calls * (steps * link.alpha_s + wire / link.bandwidth_Bps)

        every = {3: ("all_gather", "reduce_scatter"), 2: ("reduce_scatter",)}
        total = sum(
            timed(op, c[op], m if op in every.get(zero_stage, ()) else 1)
            for op in ("all_reduce", "reduce_scatter", "all_gather")
            if c.get(op)
        )
        exposed = total - min(dp_overlap * total, t_b)

    out = dict(compute_s=m * compute, tp_s=m * tp_time, pp_s=m * p2p)
    out.update(dp_s=exposed, bubble_s=bubble)
    out["step_s"] = sum(out.values())
    return out


# ---- ch09 zero_states: fp32 AdamW's states per rank ----------------------------------
def zero_states_from_a_table(psi, n, stage):
    """What each stage shards, as a table; the full bytes divided where sharded."""
    full = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}
    sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads")}
    shard = sharded.get(stage, tuple(full))
    return {k: v / n if k in shard else v for k, v in full.items()}


def zero_states_in_whole_bytes(psi, n, stage):
    """Integer bytes: a category is split n ways from the stage that shards it on."""
    first_sharded = {"optimizer": 1, "grads": 2, "params": 3}
    per_value = {"params": 4, "grads": 4, "optimizer": 2 * 4}
    return {
        k: per_value[k] * psi // (n if stage >= first_sharded[k] else 1)
        for k in ("params", "grads", "optimizer")
    }


def _sharded_once_per_step(model, layout, **knobs):
    """Wrong: ZeRO-2's reduce-scatter and ZeRO-3's gathers paid once a step, as
    DDP's all-reduce is, though with several microbatches they recur for each."""
    return step_time_part_by_part(
        model, layout, _sharded_every_microbatch=False, **knobs
    )


@pytest.mark.parametrize("answer", [step_time_part_by_part, step_time_from_wire_bytes])
def test_step_time_accepts_other_right_answers(answer):
    assert check_step_time(answer).passed


def test_step_time_names_sharded_collectives_paid_once():
    with pytest.raises(ExerciseFailed, match="dp_s is .*every microbatch"):
        check_step_time(_sharded_once_per_step)


for _answer in (zero_states_from_a_table, zero_states_in_whole_bytes):
    ship_by_value(_answer)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "answer", [zero_states_from_a_table, zero_states_in_whole_bytes]
)
def test_zero_states_accepts_other_right_answers(answer, lab_cluster):
    assert check_zero_states(answer, lab_cluster(4)).passed


# ---- ch10 ddp_wire_bytes: the ring all-reduce's bytes --------------------------------
def wire_as_its_two_halves(n_params, world_size, bytes_per_grad=4):
    """Reduce-scatter then all-gather: N−1 chunks of Ψ/N each, twice."""
    chunk = n_params * bytes_per_grad / world_size
    reduce_scatter = (world_size - 1) * chunk
    all_gather = (world_size - 1) * chunk
    return reduce_scatter + all_gather


def wire_in_whole_bytes(n_params, world_size, bytes_per_grad=4):
    """Integer arithmetic, multiplied out before the one division."""
    return 2 * (world_size - 1) * n_params * bytes_per_grad // world_size


for _answer in (wire_as_its_two_halves, wire_in_whole_bytes):
    ship_by_value(_answer)


@pytest.mark.cluster
@pytest.mark.parametrize("answer", [wire_as_its_two_halves, wire_in_whole_bytes])
def test_ddp_wire_bytes_accepts_other_right_answers(answer, lab_cluster):
    assert check_ddp_wire_bytes(answer, lab_cluster(4)).passed


# ---- ch11 merge_attention: the online-softmax merge ----------------------------------
def merge_by_the_larger(out_a, lse_a, out_b, lse_b):
    """The larger lse subtracted before exp, as FlashAttention keeps a running max."""
    top = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = wa + wb
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / total[..., None]
    return out, top + torch.log(total)


def merge_as_a_sigmoid(out_a, lse_a, out_b, lse_b):
    """The share of block a is sigmoid(lse_a − lse_b); the lse grows by softplus."""
    gap = lse_a - lse_b
    out = out_b + torch.sigmoid(gap)[..., None] * (out_a - out_b)
    return out, lse_b + torch.nn.functional.softplus(gap)


def merge_by_softmax_over_blocks(out_a, lse_a, out_b, lse_b):
    """The two blocks stacked: softmax of their lses is each one's share."""
    lses = torch.stack([lse_a, lse_b])
    shares = torch.softmax(lses, dim=0).unsqueeze(-1)
    return (shares * torch.stack([out_a, out_b])).sum(0), torch.logsumexp(lses, 0)


@pytest.mark.parametrize(
    "answer",
    [
        merge_by_the_larger,
        merge_as_a_sigmoid,
        merge_by_softmax_over_blocks,
    ],
)
def test_merge_attention_accepts_other_right_answers(answer):
    assert check_merge_attention(answer).passed


# ---- ch11 moe_dispatch: the dispatch permutation -------------------------------------
def dispatch_vectorised(expert, n_experts, capacity):
    """Assignments in serving order; each one's place in its expert's queue a
    cumulative count; the kept ones sorted stably by expert."""
    n, k = expert.shape
    served = expert.t().reshape(-1)  # every first choice, then every second
    tokens = torch.arange(n).repeat(k)
    onehot = torch.nn.functional.one_hot(served, n_experts)
    place = (onehot.cumsum(0) * onehot).sum(1) - 1  # 0-based place in its queue
    keep = place < capacity
    order = torch.sort(served[keep], stable=True).indices
    counts = torch.bincount(served[keep], minlength=n_experts)
    return tokens[keep][order], counts


def dispatch_per_expert(expert, n_experts, capacity):
    """Expert by expert: its assignments in serving order, the first capacity."""
    n, k = expert.shape
    served = expert.t().flatten()
    tokens = torch.arange(n).repeat(k)
    kept = [tokens[served == e][:capacity] for e in range(n_experts)]
    return torch.cat(kept), torch.tensor([len(t) for t in kept])


def dispatch_as_python_lists(expert, n_experts, capacity):
    """Plain Python: the choices as nested lists, served by a sort on (choice,
    token) priority, lists returned."""
    rows = expert.tolist()
    served = sorted(
        ((c, t, e) for t, row in enumerate(rows) for c, e in enumerate(row)),
    )
    queues = {e: [] for e in range(n_experts)}
    for _, t, e in served:
        if len(queues[e]) < capacity:
            queues[e].append(t)
    return sum(queues.values(), []), [len(queues[e]) for e in range(n_experts)]


@pytest.mark.parametrize(
    "answer", [dispatch_vectorised, dispatch_per_expert, dispatch_as_python_lists]
)
def test_moe_dispatch_accepts_other_right_answers(answer):
    assert check_moe_dispatch(answer).passed


def counts_the_routed_not_the_kept(expert, n_experts, capacity):
    """Wrong: the right rows, but counts of every assignment routed to each
    expert, the dropped ones included."""
    token, _ = dispatch_per_expert(expert, n_experts, capacity)
    return token, torch.bincount(expert.flatten(), minlength=n_experts)


def test_moe_dispatch_names_counts_of_the_routed():
    with pytest.raises(ExerciseFailed, match="count the kept assignments"):
        check_moe_dispatch(counts_the_routed_not_the_kept)


# ---- ch11 all_to_all_splits: what each rank sends and receives -----------------------
def splits_from_a_rank_matrix(counts, rank):
    """The (ep, E) matrix folded to (ep, ep) rank to rank: a row sent, a column
    received."""
    c = torch.tensor(counts)
    ep = c.shape[0]
    by_rank = c.reshape(ep, ep, -1).sum(-1)  # [source, destination]
    return by_rank[rank].tolist(), by_rank[:, rank].tolist()


def splits_as_tensors(counts, rank):
    """Slices of a tensor, summed; the splits handed back as tensors."""
    c = torch.as_tensor(counts)
    per = c.shape[1] // c.shape[0]
    mine = slice(rank * per, (rank + 1) * per)
    return c[rank].view(-1, per).sum(1), c[:, mine].sum(1)


def splits_expert_by_expert(counts, rank):
    """One loop over the experts, each added to its owner's entry."""
    ep, n_experts = len(counts), len(counts[0])
    send, recv = [0] * ep, [0] * ep
    for e in range(n_experts):
        owner = e * ep // n_experts
        send[owner] += counts[rank][e]
        if owner == rank:
            for source in range(ep):
                recv[source] += counts[source][e]
    return send, recv


@pytest.mark.parametrize(
    "answer",
    [splits_from_a_rank_matrix, splits_expert_by_expert, splits_as_tensors],
)
def test_all_to_all_splits_accepts_other_right_answers(answer):
    assert check_all_to_all_splits(answer).passed

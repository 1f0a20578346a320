"""dtlab.moe and comm's all-to-all: routing by hand (top-1 and top-2 gates, the
capacity in priority order, dropped assignments, Switch's load-balancing loss), the
MoE layer against a loop over tokens, the GPT with MoE layers, comm.all_to_all_single
and all_to_all against torch.distributed, and expert parallelism at ep = 2 and 4
against the same MoE on one process (same routing, same drops): outputs, loss,
every gradient, bytes per rank against dtlab.estimate, the telemetry it records.

Tolerances. The reference for an ep group is the single-process MoE run on each
rank's tokens in turn (each rank routes its own microbatch with its own capacity,
as data parallelism does), so routing and drops are identical, and asserted equal.
What differs is the order of fp32 sums: under expert parallelism an expert runs once
over the rows of every rank (one matmul of all of them) and its weight gradient is
one sum over all those rows, where the reference sums each rank's rows apart and
adds the results; the replicated weights' gradients add ep partial sums in the
all-reduce. A sum of n fp32 terms errs by about ``n · eps · Σ|terms|`` (eps =
1.2e-7, n <= 64 here), so we allow ``atol=1e-6``, ``rtol=1e-5`` as
tests/test_tensor_parallel.py does. Measured: one layer (loss Σ y·g) outputs within
2.4e-7, input gradients within 4.1e-8, weight gradients within 6.0e-7 (inside
atol + rtol·|g|); the GPT's losses equal, logits within 7.5e-8, gradients within
3.4e-8.

Bytes are integers, so the measured sums equal the estimates exactly.
"""

import math

import pytest
import torch

from dtlab import estimate, telemetry
from dtlab.events import Kind
from dtlab.model import GPT, MLP, GPTConfig, SyntheticTokens
from dtlab.moe import (
    MoE,
    average_gradients,
    dispatch_order,
    expert_capacity,
    expert_parallel,
    expert_parallel_gpt,
    load_balancing_loss,
    moe_aux_loss,
    top_k_routing,
)
from dtlab.topology import Axis, Layout, Topology

TOL = dict(rtol=1e-5, atol=1e-6)  # see the module docstring
MOE = GPTConfig(seq_len=16, d_model=32, n_heads=4, n_experts=4, capacity_factor=1.0)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _diff(a, b):
    torch.testing.assert_close(a, b, **TOL)
    return float((a - b).detach().abs().max())


def _logits(rows):
    """Router logits that make each token's preference order the given row."""
    E = len(rows[0])
    out = torch.zeros(len(rows), E)
    for n, order in enumerate(rows):
        for rank, e in enumerate(order):
            out[n, e] = float(E - rank)  # best first
    return out


# ---- routing, by hand --------------------------------------------------------------
def test_expert_capacity_is_switch_times_k():
    assert expert_capacity(64, 4, 1, 1.25) == 20  # ceil(1.25 * 64 / 4)
    assert expert_capacity(64, 4, 2, 1.0) == 32  # GShard: k assignments per token
    assert expert_capacity(10, 4, 1, 1.0) == 3  # rounded up
    assert expert_capacity(10, 4, 2, None) == 10  # None: drop nothing


def test_top1_keeps_the_earliest_tokens_and_gates_by_the_probability():
    logits = _logits([[0, 1, 2], [0, 2, 1], [0, 1, 2], [1, 0, 2]])
    r = top_k_routing(logits, 1, capacity=2)
    assert r.expert[:, 0].tolist() == [0, 0, 0, 1]
    assert r.slot[:, 0].tolist() == [0, 1, 2, 0]
    assert r.keep[:, 0].tolist() == [True, True, False, True]  # third in line for 0
    assert r.routed.tolist() == [3, 1, 0] and r.kept.tolist() == [2, 1, 0]
    assert r.dropped == 1 == estimate.dropped_assignments(r.routed, 2)
    # Switch keeps the probability as the gate, so the router gets a gradient
    torch.testing.assert_close(r.gate[:, 0], torch.softmax(logits, -1).max(-1).values)


def test_top2_serves_every_first_choice_before_any_second():
    # token 0's second choice (expert 1) competes with tokens 1 and 2's first
    logits = _logits([[0, 1, 2], [1, 0, 2], [1, 2, 0]])
    r = top_k_routing(logits, 2, capacity=2)
    assert r.expert.tolist() == [[0, 1], [1, 0], [1, 2]]
    # expert 1: first choices of tokens 1 and 2 fill it; token 0's second is dropped
    assert r.keep.tolist() == [[True, False], [True, True], [True, True]]
    assert r.slot.tolist() == [[0, 2], [0, 1], [1, 0]]
    assert r.dropped == 1
    torch.testing.assert_close(r.gate.sum(-1), torch.ones(3))  # renormalised (GShard)


def test_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed():
    E = 4
    uniform = torch.full((8, E), 1.0 / E)
    first = torch.arange(8) % E
    assert float(load_balancing_loss(uniform, first)) == pytest.approx(1.0)
    collapsed = torch.zeros(8, E)
    collapsed[:, 2] = 1.0
    assert float(load_balancing_loss(collapsed, torch.full((8,), 2))) == E


def test_dispatch_order_groups_rows_by_expert_in_queue_order():
    logits = torch.tensor([[0.0, 0, 3], [3, 0, 0], [0, 0, 3], [3, 2, 0]])
    r = top_k_routing(logits, 2, capacity=4)
    token, gate, counts = dispatch_order(r)
    experts = r.expert.t().reshape(-1)  # priority order
    order = [(int(experts[i]), i) for i in range(8)]
    # expert by expert; inside one, first choices (tokens in order) then seconds
    want = [i % 4 for _, i in sorted(order)]
    assert token.tolist() == want
    assert counts.tolist() == r.kept.tolist() and int(counts.sum()) == len(token)
    flat_gate = r.gate.t().reshape(-1)
    assert torch.equal(gate, flat_gate[[i for _, i in sorted(order)]])


@pytest.mark.parametrize("k", [1, 2])
def test_moe_layer_is_the_gated_sum_of_its_tokens_experts(k):
    cfg = GPTConfig(**{**MOE.__dict__, "top_k": k})
    torch.manual_seed(0)
    moe = MoE(cfg)
    x = _rand(2, 8, cfg.d_model, seed=1).requires_grad_()
    y = moe(x)
    # the same thing, one token at a time
    tokens = x.reshape(-1, cfg.d_model)
    routing = top_k_routing(moe.router(tokens), k, moe.stats["capacity"])
    want = []
    for n in range(tokens.shape[0]):
        out = torch.zeros(cfg.d_model)
        for j in range(k):
            if routing.keep[n, j]:
                e = str(int(routing.expert[n, j]))
                out = out + routing.gate[n, j] * moe.experts[e](tokens[n : n + 1])[0]
        want.append(out)
    want = torch.stack(want).view_as(y)
    _diff(y, want)
    g = _rand(*y.shape, seed=2)
    (dx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    (dx_want,) = torch.autograd.grad(want, x, g)
    _diff(dx, dx_want)
    assert moe.stats["dropped"] == routing.dropped
    assert moe.stats["tokens_per_expert"] == routing.kept.tolist()


def test_gpt_config_defaults_keep_the_dense_mlp_and_moe_is_one_option():
    dense = GPT(GPTConfig())
    assert all(isinstance(b.mlp, MLP) for b in dense.blocks)
    model = GPT(MOE)
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)
    assert MOE.n_params() == model.n_params()  # experts and router counted
    names = dict(model.named_parameters())
    assert "blocks.1.mlp.experts.3.fc.weight" in names
    assert "blocks.1.mlp.router.weight" in names
    # the experts' output projections get GPT-2's residual scaling, as mlp.proj
    std = names["blocks.0.mlp.experts.2.proj.weight"].detach().std()
    assert float(std) == pytest.approx(0.02 / math.sqrt(2 * MOE.n_layers), rel=0.05)
    # the loss adds every layer's load-balancing loss
    x, y = SyntheticTokens(MOE.vocab_size, MOE.seq_len).batch(0, 2)
    logits, loss = model(x, y)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, MOE.vocab_size), y.view(-1))
    aux = moe_aux_loss(model)
    assert float(aux.detach()) > 0 and torch.equal(loss, ce + aux)
    for bad, match in (
        (dict(top_k=3), "top_k must be 1"),
        (dict(n_experts=1, top_k=2), None),  # one expert: the plain MLP, top_k unused
        (dict(n_experts=2, top_k=2, capacity_factor=0.0), "capacity_factor"),
        (dict(n_experts=2, aux_loss_coef=-1.0), "aux_loss_coef"),
        (dict(n_experts=0), "n_experts"),
    ):
        if match is None:
            GPTConfig(**bad)
            continue
        with pytest.raises(ValueError, match=match):
            GPTConfig(**bad)


def test_each_forward_records_its_routing():
    torch.manual_seed(0)
    moe = MoE(MOE, name="blocks.0.mlp")
    rec = telemetry.Recorder(0)
    with telemetry.use(rec):
        moe(_rand(2, 8, MOE.d_model, seed=3))
    (event,) = [e for e in rec.events if e["kind"] == Kind.MOE]
    assert event["layer"] == "blocks.0.mlp"
    assert event["capacity"] == expert_capacity(16, 4, 1, 1.0) == 4
    assert sum(event["tokens_per_expert"]) == 16 - event["dropped"]
    assert event["dropped"] == estimate.dropped_assignments(event["routed"], 4)


def test_expert_parallel_keeps_its_experts_by_name_and_refuses_bad_input():
    second_of_two = Axis("ep", (0, 1), 1)  # no process group is needed to shard
    moe = expert_parallel(MoE(MOE), second_of_two)
    assert sorted(moe.experts) == ["2", "3"]  # experts E/ep .. of rank 1
    assert all(p.expert_parallel for p in moe.experts.parameters())
    assert not hasattr(moe.router.weight, "expert_parallel")  # replicated
    with pytest.raises(ValueError, match="n_experts=4 is not a multiple of 3"):
        expert_parallel(MoE(MOE), Axis("ep", (0, 1, 2), 0))
    with pytest.raises(ValueError, match="needs a dtlab.moe.MoE"):
        expert_parallel(MLP(MOE), second_of_two)
    with pytest.raises(ValueError, match="no MoE layers"):
        expert_parallel_gpt(GPT(GPTConfig()), second_of_two)


def test_ep_estimates_by_hand_and_the_planner_agrees():
    tokens, h, ep, E, k = 64, 32, 4, 8, 2
    uniform = estimate.ep_bytes_per_layer(tokens, h, ep, n_experts=E, top_k=k)
    one = 3 / 4 * k * tokens * h * 4  # what leaves the rank, one all-to-all
    assert uniform["dispatch"] == uniform["combine"] == one
    assert uniform["counts"] == 3 * E * 8  # (ep-1)/ep of the (ep, E) int64 matrix
    assert uniform["wire_bytes"] == 4 * one + 3 * E * 8
    # from a routing: rank 1 keeps what goes to its experts 2, 3; its experts
    # receive 3 + 4 rows from each of the 3 other ranks
    counts = [[1, 2, 3, 4, 0, 0, 0, 0]] * 4
    exact = estimate.ep_traffic_from_counts(counts, 1, h)
    assert exact["dispatch"] == (1 + 2) * h * 4
    assert exact["combine"] == 3 * (3 + 4) * h * 4
    assert estimate.ep_imbalance([10, 10, 10, 10]) == 1.0
    assert estimate.ep_imbalance([40, 0, 0, 0, 0, 0, 0, 0], ep=4) == 4.0
    assert estimate.ep_imbalance([3, 1, 2, 2], ep=2) == 1.0
    # chapter 09's planner counts the same four all-to-alls and the counts' gather
    spec = dict(layers=2, hidden=h, heads=4, vocab=64, sequence=32)
    spec.update(experts=E, top_k=k)
    traffic = estimate.layout_traffic(
        spec, estimate.Parallelism(dp=ep, ep=ep), micro_batch_size=2
    )
    assert traffic["ep"] == 2 * uniform["wire_bytes"]
    with pytest.raises(ValueError, match="do not split over ep=3"):
        estimate.ep_imbalance([1, 2, 3, 4], ep=3)


# ---- on the cluster --------------------------------------------------------------
def _all_to_all():
    """comm's all-to-alls against torch.distributed's, and what they record."""
    import torch.distributed as dist

    from dtlab import comm

    r, n = dist.get_rank(), dist.get_world_size()
    rec = telemetry.Recorder(r)
    out = {}
    with telemetry.use(rec):
        x = torch.arange(4 * n * 3, dtype=torch.float32).view(4 * n, 3) + 1000 * r
        got, want = torch.empty_like(x), torch.empty_like(x)
        comm.all_to_all_single(got, x, tag="equal")
        dist.all_to_all_single(want, x)
        out["equal"] = torch.equal(got, want)
        # uneven pieces: rank r sends (r + j) % 3 rows to rank j
        send = [(r + j) % 3 for j in range(n)]
        recv = [(j + r) % 3 for j in range(n)]
        x = _rand(sum(send), 2, seed=r)
        got, want = x.new_empty(sum(recv), 2), x.new_empty(sum(recv), 2)
        comm.all_to_all_single(got, x, recv, send, tag="uneven")
        dist.all_to_all_single(want, x, recv, send)
        out["uneven"], out["send"] = torch.equal(got, want), send
        # the list form: rank r sends [r, j] to rank j
        ins = [torch.tensor([float(r), float(j)]) for j in range(n)]
        outs = [torch.empty(2) for _ in range(n)]
        comm.all_to_all(outs, ins, tag="list")
        out["list"] = [o.tolist() for o in outs]
        # on a 2-rank axis, asynchronous
        axis = Topology(Layout(dp=2, tp=2)).axis("tp")
        got = torch.empty(4)
        y = torch.arange(4.0) + 10 * r
        comm.all_to_all_single(got, y, group=axis, async_op=True, tag="axis").wait()
        out["axis"] = got.tolist()
    try:
        comm.all_to_all_single(torch.empty(3), torch.empty(5))
    except ValueError as exc:
        out["bad"] = str(exc)
    out["events"] = [e for e in rec.events if e["kind"] == Kind.COMM]
    return out


@pytest.mark.cluster
def test_comm_all_to_all_matches_torch_and_records_its_row(lab_cluster):
    results = lab_cluster(4).run(_all_to_all)
    for r, res in enumerate(results):
        assert res["equal"] and res["uneven"]
        assert res["list"] == [[float(i), float(r)] for i in range(4)]
        g, base = r % 2, 2 * (r // 2)  # place in its tp pair, the pair's first rank
        # piece g of each pair member's arange(4) + 10 * rank, in member order
        pieces = [10.0 * (base + src) + 2 * g + i for src in (0, 1) for i in (0, 1)]
        assert res["axis"] == pieces
        assert "cannot cut 5 input rows into 4 pieces equally" in res["bad"]
        ev = {e["tag"]: e for e in res["events"]}
        S = 16 * 3 * 4
        assert ev["equal"]["send_bytes"] == [S // 4] * 4
        assert ev["equal"]["wire_bytes"] == estimate.wire_bytes("all_to_all", S, 4)
        row = [rows * 2 * 4 for rows in res["send"]]
        assert ev["uneven"]["send_bytes"] == row
        assert ev["uneven"]["wire_bytes"] == sum(row) - row[r]  # all but its own
        assert ev["list"]["send_bytes"] == [8] * 4
        assert ev["list"]["payload_bytes"] == 32 and ev["list"]["wire_bytes"] == 24
        assert ev["axis"]["axis"] == "tp" and ev["axis"]["wire_bytes"] == 8.0


def _layer(cfg, balanced):
    """The same MoE layer on every rank (torch's init, seeded); ``balanced``: a
    router that sends a token whose first 8 features are e_i to expert i."""
    torch.manual_seed(0)
    moe = MoE(cfg, name="moe")
    if balanced:
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[:, :8] = 10 * torch.eye(8)
    return moe


def _routing(moe):
    """A layer's last routing, without the ep-only all-to-all row."""
    return {key: v for key, v in moe.stats.items() if key != "send_bytes"}


def _ep_block(ep):
    """One MoE layer under expert parallelism against the same layer on one
    process, run over every ep rank's tokens in turn; k = 1 and 2, and a routing
    made perfectly balanced."""
    import torch.distributed as dist

    world = dist.get_world_size()
    axis = Topology(Layout(dp=ep, tp=world // ep)).axis("dp")  # ep ranks per group
    me, out = axis.index, {}
    for case in ("top1", "top2", "balanced"):
        k = 2 if case == "top2" else 1
        cfg = GPTConfig(**{**MOE.__dict__, "top_k": k, "n_experts": 8})
        xs = [_rand(2, 8, cfg.d_model, seed=10 + s) for s in range(ep)]
        gs = [_rand(2, 8, cfg.d_model, seed=20 + s) for s in range(ep)]  # dL/dy

        if case == "balanced":  # token n prefers expert n mod 8: 2 tokens each
            for x in xs:
                x[..., :8] = torch.eye(8).repeat(2, 1).view(2, 8, 8)
        xs = [x.requires_grad_() for x in xs]  # activations, as in a GPT
        ref = _layer(cfg, case == "balanced")
        ref_y, ref_stats, loss = [], [], 0.0
        for x, g in zip(xs, gs):
            y = ref(x)
            ref_y.append(y.detach())
            ref_stats.append(ref.stats)
            loss = loss + (y * g).sum() + ref.aux_loss
        (loss / ep).backward()  # the mean of the ranks' losses
        moe = expert_parallel(_layer(cfg, case == "balanced"), axis)
        rec = telemetry.Recorder(dist.get_rank())
        x = xs[me].detach().clone().requires_grad_()
        with telemetry.use(rec):
            y = moe(x)
            ((y * gs[me]).sum() + moe.aux_loss).backward()
            average_gradients(moe, axis)
        ref_params = dict(ref.named_parameters())
        wire = {}
        for e in rec.events:
            if e["kind"] == Kind.COMM:
                wire[e["tag"]] = wire.get(e["tag"], 0.0) + e["wire_bytes"]
        (moe_event,) = [e for e in rec.events if e["kind"] == Kind.MOE]
        dispatch = [e for e in rec.events if e.get("tag") == "moe.dispatch:fwd"]
        stats = _routing(moe)
        out[case] = {
            "same_routing": stats == ref_stats[me],
            "y": _diff(y, ref_y[me]),
            # the reference's loss is the mean over ep: its dL/dx is 1/ep of ours
            "dx": _diff(x.grad / ep, xs[me].grad),
            "grads": {
                name: _diff(p.grad, ref_params[name].grad)
                for name, p in moe.named_parameters()
            },
            "experts": sorted(moe.experts),
            "tokens_per_expert": moe.stats["tokens_per_expert"],
            "event_row": moe_event["send_bytes"],
            "comm_row": dispatch[0]["send_bytes"],
            "wire": wire,
        }
    return out


@pytest.mark.cluster
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_layer_matches_one_process(lab_cluster, ep):
    results = lab_cluster(4).run(_ep_block, ep)
    h, E, tokens = MOE.d_model, 8, 16
    groups = [[results[d * (4 // ep) + g] for d in range(ep)] for g in range(4 // ep)]
    for group in groups:
        for case in ("top1", "top2", "balanced"):
            rows = [res[case] for res in group]
            counts = [r["tokens_per_expert"] for r in rows]  # the (ep, E) matrix
            for i, r in enumerate(rows):
                assert r["same_routing"]  # same routing, same drops
                assert r["experts"] == [
                    str(e) for e in range(i * E // ep, (i + 1) * E // ep)
                ]
                assert len(r["grads"]) == 1 + 4 * E // ep  # router + its experts
                # the all-to-all matrix: the MoE event's row is the comm event's
                assert r["event_row"] == r["comm_row"]
                want = estimate.ep_traffic_from_counts(counts, i, h)
                w = r["wire"]
                assert w["moe.counts"] == want["counts"]
                # what it dispatched goes out again as the combine's gradient;
                # what its experts received goes back, and so does its gradient
                for tag in ("moe.dispatch:fwd", "moe.combine:bwd"):
                    assert w[tag] == want["dispatch"]
                for tag in ("moe.combine:fwd", "moe.dispatch:bwd"):
                    assert w[tag] == want["combine"]
                grads = w.pop("ep/grads")
                assert grads == estimate.wire_bytes("all_reduce", h * E * 4, ep)
                assert sum(w.values()) == want["wire_bytes"]
                if case == "balanced":
                    uniform = estimate.ep_bytes_per_layer(tokens, h, ep, n_experts=E)
                    assert want == uniform
            # the imbalance factor: the busiest rank's rows received over the mean,
            # read off the all-to-all matrix the ranks recorded
            matrix = [r["event_row"] for r in rows]
            received = [sum(row[j] for row in matrix) for j in range(ep)]
            load = [sum(c[e] for c in counts) for e in range(E)]
            imbalance = estimate.ep_imbalance(load, ep)
            assert imbalance == pytest.approx(max(received) / (sum(received) / ep))
            if case == "balanced":
                assert imbalance == 1.0
    cases = [r[c] for r in results for c in r]
    print(
        f"ep={ep}: max abs error: outputs {max(c['y'] for c in cases):.1e}, input "
        f"grads {max(c['dx'] for c in cases):.1e}, weight grads "
        f"{max(max(c['grads'].values()) for c in cases):.1e}"
    )


def _ep_gpt(ep, k):
    """The GPT with MoE layers under expert parallelism against the single-process
    GPT run over every ep rank's microbatch in turn."""
    import torch.distributed as dist

    world = dist.get_world_size()
    axis = Topology(Layout(dp=ep, tp=world // ep)).axis("dp")
    me = axis.index
    cfg = GPTConfig(**{**MOE.__dict__, "top_k": k})
    x, y = SyntheticTokens(cfg.vocab_size, cfg.seq_len).batch(0, 2 * ep)
    ref = GPT(cfg)
    losses = []
    for s in range(ep):
        logits, loss = ref(x[2 * s : 2 * s + 2], y[2 * s : 2 * s + 2])
        losses.append(loss)
        if s == me:
            ref_logits = logits.detach()
            ref_stats = [b.mlp.stats for b in ref.blocks]
    torch.stack(losses).mean().backward()
    model = expert_parallel_gpt(GPT(cfg), axis)
    rec = telemetry.Recorder(dist.get_rank())
    with telemetry.use(rec):
        logits, loss = model(x[2 * me : 2 * me + 2], y[2 * me : 2 * me + 2])
        loss.backward()
        average_gradients(model, axis)
    ref_params = dict(ref.named_parameters())
    stats = [_routing(b.mlp) for b in model.blocks]
    comm_events = [e for e in rec.events if e["kind"] == Kind.COMM]
    return {
        "same_routing": stats == ref_stats,
        "loss": (float(loss), float(losses[me])),
        "logits": _diff(logits, ref_logits),
        "grads": {
            name: _diff(p.grad, ref_params[name].grad)
            for name, p in model.named_parameters()
        },
        "layers": [e["tokens_per_expert"] for e in rec.events if e["kind"] == Kind.MOE],
        "ep_wire": sum(e["wire_bytes"] for e in comm_events if e["tag"] != "ep/grads"),
        "grad_wire": sum(
            e["wire_bytes"] for e in comm_events if e["tag"] == "ep/grads"
        ),
    }


@pytest.mark.cluster
@pytest.mark.parametrize("ep, k", [(2, 1), (4, 2)])
def test_expert_parallel_gpt_matches_one_process(lab_cluster, ep, k):
    results = lab_cluster(4).run(_ep_gpt, ep, k)
    h, E, L = MOE.d_model, MOE.n_experts, MOE.n_layers
    cfg = GPTConfig(**{**MOE.__dict__, "top_k": k})
    expert = 2 * h * cfg.d_ff + cfg.d_ff + h  # one expert's MLP, biases included
    replicated = cfg.n_params() - L * E * expert
    for g in range(4 // ep):
        group = [results[d * (4 // ep) + g] for d in range(ep)]
        for i, res in enumerate(group):
            assert res["same_routing"]
            mine, ref = res["loss"]
            assert mine == pytest.approx(ref, rel=1e-6)
            # every replicated parameter and this rank's experts, by their names
            assert len(res["grads"]) == len(list(GPT(cfg).parameters())) - L * 4 * (
                E - E // ep
            )
            want = sum(
                estimate.ep_traffic_from_counts(
                    [r["layers"][layer] for r in group], i, h
                )["wire_bytes"]
                for layer in range(L)
            )
            assert res["ep_wire"] == want
            assert res["grad_wire"] == estimate.wire_bytes(
                "all_reduce", replicated * 4, ep
            )
            # the planner's dp term reduces the same replicated weights over dp
            traffic = estimate.layout_traffic(
                cfg, estimate.Parallelism(dp=ep, ep=ep), micro_batch_size=2
            )
            assert traffic["dp"] == res["grad_wire"]
    print(
        f"ep={ep} k={k} GPT: loss max abs "
        f"{max(abs(a - b) for a, b in (r['loss'] for r in results)):.1e}, logits "
        f"{max(r['logits'] for r in results):.1e}, grads "
        f"{max(max(r['grads'].values()) for r in results):.1e}; bytes/rank "
        f"{results[0]['ep_wire']:.0f} all-to-all + counts, "
        f"{results[0]['grad_wire']:.0f} gradients = estimate"
    )

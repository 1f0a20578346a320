"""Pipeline parallelism: schedules checked as data, then executed across ranks and
compared with one process, with dtlab.reference, and with torch.distributed.pipelining.

Exactness. A pipeline runs, stage by stage, the very ops the single-process model
runs on each microbatch, so its gradients equal those of one process that
accumulates ``L_i / m`` over the same microbatches in the same order (1F1B and the
interleaved schedule keep microbatch order per chunk) bit for bit. Two things
change the order of float sums and get a tolerance instead, each explained where
it is used: one big batch instead of microbatches (dtlab.reference), and a tied
embedding whose two copies are summed once per step instead of once per microbatch.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from dtlab import estimate as est
from dtlab import events
from dtlab.model import GPT, GPTConfig, SyntheticTokens, shard_batch
from dtlab.pipeline import (
    BUILDERS,
    Action,
    Pipeline,
    Schedule,
    ScheduleError,
    bubble,
    build_stages,
    from_compute_orders,
    gpipe,
    in_flight,
    interleaved_1f1b,
    make_schedule,
    measured_timeline,
    one_f_one_b,
    partition,
    schedules,
    simulate,
    simulator,
    validate,
    zb_h1,
)
from dtlab.reference import accumulated_gradients
from dtlab.topology import Layout, Topology

# 8 layers: 2 per stage on p=4, one per virtual stage with v=2
CFG = GPTConfig(
    vocab_size=64, seq_len=16, n_layers=8, n_heads=2, d_model=32, tied_head=False
)
BATCH = 8


def _batch(step=0):
    return SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(step, BATCH)


# ---- schedules as data, no process group ---------------------------------------------
GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8)]


def _all_schedules():
    for p, m in GRID:
        yield gpipe(p, m)
        if m >= p:
            yield one_f_one_b(p, m)
            yield zb_h1(p, m)
        if m % p == 0:
            for v in (2, 3):
                yield interleaved_1f1b(p, m, v)


def test_every_generated_schedule_is_complete_ordered_and_deadlock_free():
    n = 0
    for s in _all_schedules():
        validate(s)
        for r, acts in enumerate(s.actions):
            ops = [a.op for a in acts]
            assert ops.count("F") == ops.count("B") == s.m * s.v
            assert ops.count("W") == (s.m if s.split_backward else 0)
            first = r == 0  # holds virtual stage 0 (chunk 0)
            last = r == s.p - 1  # holds the last virtual stage (last chunk)
            sends = s.m * (s.v - last)  # activations leave every chunk but the last
            assert ops.count("send_act") == ops.count("recv_grad") == sends
            assert (
                ops.count("recv_act") == ops.count("send_grad") == s.m * (s.v - first)
            )
        n += 1
    assert n > 80


def test_one_f_one_b_has_warm_up_steady_state_and_cool_down():
    s = one_f_one_b(4, 6)
    order = [str(a) for a in s.compute_order(1)]
    # rank 1: p - 1 - 1 = 2 warm-up forwards, 4 F/B pairs, 2 cool-down backwards
    assert order == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5".split()
    assert [str(a) for a in s.compute_order(3)][:4] == ["F0", "B0", "F1", "B1"]
    # messages sit right around the compute that needs or makes them
    assert [str(a) for a in s.actions[1][:3]] == ["a0←0", "F0", "a0→2"]


def test_interleaved_follows_megatron_order():
    s = interleaved_1f1b(2, 4, 2)
    # rank 0 forwards: chunk 0 for mb 0,1, chunk 1 for mb 0,1, then mb 2,3 likewise;
    # warm-up 2(p-1) + (v-1)p = 4 forwards before the first backward (of chunk 1)
    order = [str(a) for a in s.compute_order(0)]
    assert order[:6] == ["F0", "F1", "F0.1", "F1.1", "F2", "B0.1"]
    # the last rank's chunk 0 hands its activations to rank 0's chunk 1
    assert Action("send_act", 0, 0, 0) in s.actions[1]


def test_validator_rejects_a_deadlocking_schedule():
    # stage 0 waits for microbatch 0's gradient before sending microbatch 1, while
    # stage 1 (GPipe order) wants microbatch 1's activations before any backward
    orders = [
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)],
        [("F", 0), ("F", 1), ("B", 0), ("B", 1)],
    ]
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(from_compute_orders("bad", 2, 2, orders))


def test_validator_rejects_messages_out_of_order():
    # stage 0 sends microbatch 1 first; the link delivers in order, so stage 1 would
    # take microbatch 1's activations for microbatch 0's
    orders = [
        [("F", 1), ("F", 0), ("B", 0), ("B", 1)],
        [("F", 0), ("F", 1), ("B", 0), ("B", 1)],
    ]
    with pytest.raises(ScheduleError, match="in the order they were sent"):
        validate(from_compute_orders("swap", 2, 2, orders))


def test_validator_rejects_incomplete_and_misordered_schedules():
    good = one_f_one_b(2, 2)
    missing = good.actions[0][:-1]
    with pytest.raises(ScheduleError, match="never runs"):
        validate(Schedule("x", 2, 2, 1, (missing, good.actions[1])))
    twice = good.actions[1] + good.actions[1][-1:]
    with pytest.raises(ScheduleError, match="2 times"):
        validate(Schedule("x", 2, 2, 1, (good.actions[0], twice)))
    backward_first = [[("B", 0), ("F", 0), ("F", 1), ("B", 1)]] * 1
    with pytest.raises(ScheduleError, match="before its F"):
        validate(from_compute_orders("x", 1, 2, backward_first))
    with pytest.raises(ValueError, match="multiple of p"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("pipedream-async", 2, 4)
    with pytest.raises(ValueError, match="chunks=2 needs 'interleaved'"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="m must be a positive integer"):
        one_f_one_b(2, 0)


def test_schedule_names_are_dtlab_events_vocabulary():
    # one spelling: the builders are keyed by dtlab.events.SCHEDULES, and the
    # spellings older code and notebooks use are aliases of it
    assert tuple(BUILDERS) == events.SCHEDULES
    for name in events.SCHEDULES:
        assert make_schedule(name, 2, 4).name == name
    for alias, name in (("zb-h1", "zb_h1"), ("ZB-H1", "zb_h1"), ("zbh1", "zb_h1")):
        assert make_schedule(alias, 2, 4) == make_schedule(name, 2, 4)
    for alias in ("interleaved-1f1b", "interleaved_1f1b"):
        assert make_schedule(alias, 2, 4, 2) == interleaved_1f1b(2, 4, 2)


def test_schedules_and_simulator_need_no_process_group():
    # schedules as data: the builders, the validator and the simulator import
    # neither torch nor anything that starts a process group
    allowed = {"__future__", "collections", "dataclasses", "dtlab.checks"}
    allowed |= {"dtlab.events", "dtlab.pipeline.schedules"}
    for module in (schedules, simulator):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        assert imported <= allowed, (module.__name__, imported - allowed)


def test_the_executor_loop_fits_on_a_page():
    # chapter 05 shows Pipeline.step with inspect: the schedule's actions, in order
    source = inspect.getsource(Pipeline.step)
    assert len(source.splitlines()) <= 60
    for op in ("recv_act", "recv_grad", '"F"', "send_act", "send_grad", "last_pass"):
        assert op in source, op


def test_simulated_bubble_matches_the_formulas():
    for p, m in GRID:
        for s in (gpipe(p, m), one_f_one_b(p, m) if m >= p else None):
            if s is None:
                continue
            spans = simulate(s, t_f=1.0, t_b=2.0)
            assert bubble(spans) == pytest.approx(est.pipeline_bubble_fraction(p, m))
            t = max(e["t_end"] for e in spans)
            assert t == pytest.approx(est.pipeline_step_time(p, m, 1.0, 2.0))
        if m % p == 0 and p > 1:
            # interleaving divides the bubble time by v
            for v in (2, 3):
                spans = simulate(interleaved_1f1b(p, m, v), t_f=1.0, t_b=2.0)
                assert bubble(spans) == pytest.approx(
                    est.pipeline_bubble_fraction(p, m, v)
                )
        if m >= p:
            # ZB-H1 with t_f = t_B = t_W: a third of 1F1B's bubble time
            spans = simulate(zb_h1(p, m), t_f=1.0, t_b=2.0, t_w=1.0)
            t = max(e["t_end"] for e in spans)
            assert t == pytest.approx(3 * m + (p - 1))
            assert t == pytest.approx(
                est.pipeline_step_time(p, m, 1.0, 2.0, schedule="zb_h1", t_w=1.0)
            )


def test_in_flight_bounds():
    for p, m in GRID:
        for name in ("gpipe", "1f1b", "zb_h1"):
            if name != "gpipe" and m < p:
                continue
            peaks = [max(t) for t in in_flight(make_schedule(name, p, m))]
            assert peaks == [est.pipeline_in_flight(p, r, m, name) for r in range(p)]
        if m >= p:  # GPipe holds all m; 1F1B at most p - stage
            assert [max(t) for t in in_flight(one_f_one_b(p, m))] == [
                p - r for r in range(p)
            ]
        if m % p == 0:
            s = interleaved_1f1b(p, m, 2)
            peaks = [max(t) for t in in_flight(s)]
            assert peaks == [
                est.pipeline_in_flight(p, r, m, "interleaved", 2) for r in range(p)
            ]


# ---- stages of the GPT ---------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_stages_hold_the_full_models_weights(tied):
    cfg = GPTConfig(**{**CFG.__dict__, "tied_head": tied})
    full = dict(GPT(cfg, seed=3).named_parameters())
    seen = set()
    for p, v in ((4, 1), (2, 2), (4, 2)):
        names = []
        for r in range(p):
            for stage in build_stages(cfg, p, r, v, seed=3):
                for name, param in stage.global_named_parameters():
                    assert torch.equal(param, full[name]), name
                    names.append(name)
        # every weight once, except a tied embedding: copies on first and last stage
        assert sorted(set(names)) == sorted(full)
        assert len(names) == len(full) + (1 if tied else 0)
        seen.add(tuple(sorted(names)))
    assert partition(cfg, 4, 2)[1] == [range(1, 2), range(5, 6)]
    with pytest.raises(ValueError, match="does not divide n_layers"):
        partition(cfg, 3)


def test_one_stage_pipeline_is_the_model():
    # pp=1 without any process group: every schedule reduces to gradient accumulation
    x, y = _batch()
    loss, ref = accumulated_gradients(CFG, x, y, 4)
    for name in ("gpipe", "1f1b", "zb_h1"):
        pipe = Pipeline(CFG, Topology(Layout(), 0), name, microbatches=4)
        out = pipe.step(x, y)
        assert out["loss"] == loss
        for n, q in pipe.named_parameters():
            assert torch.equal(q.grad, ref[n]), (name, n)


# ---- across ranks --------------------------------------------------------------------
# (schedule, pp, m, v, tied head); dp = 4 // pp, every case on the 4-engine cluster
CASES = [
    ("gpipe", 4, 4, 1, False),
    ("1f1b", 4, 4, 1, False),
    ("interleaved", 4, 4, 2, False),
    ("zb_h1", 4, 4, 1, False),
    ("gpipe", 2, 4, 1, False),
    ("1f1b", 2, 4, 1, False),
    ("interleaved", 2, 4, 2, False),
    ("1f1b", 4, 4, 1, True),
]


def _run_cases(cases):
    import torch.distributed as dist

    from dtlab import telemetry

    topos, out = {}, []
    for name, pp, m, v, tied in cases:
        cfg = GPTConfig(**{**CFG.__dict__, "tied_head": tied})
        layout = Layout(pp=pp, dp=dist.get_world_size() // pp)
        if layout not in topos:  # building one creates groups: once per layout
            topos[layout] = Topology(layout)
        topo = topos[layout]
        x, y = shard_batch(*_batch(), topo.coords["dp"], layout.dp)
        pipe = Pipeline(cfg, topo, name, microbatches=m, chunks=v)
        # epoch 0: every rank stamps absolute wall-clock time, one clock on one host
        rec = telemetry.Recorder(dist.get_rank(), epoch=0.0)
        with telemetry.use(rec):
            stats = pipe.step(x, y)
        out.append(
            {
                "coords": topo.coords,
                "stats": stats,
                "grads": {n: q.grad.clone() for n, q in pipe.named_parameters()},
                "events": [e for e in rec.events if e["kind"] in ("span", "memory")],
                "comm": [
                    (e["op"], e["tag"], e["payload_bytes"])
                    for e in rec.events
                    if e["kind"] == "comm"
                ],
            }
        )
    return out


@pytest.fixture(scope="module")
def cases(lab_cluster):
    per_rank = lab_cluster(4).run(_run_cases, CASES, timeout=240)
    return [[per_rank[r][i] for r in range(4)] for i in range(len(CASES))]


def _expected(case):
    """Loss per dp replica and gradients, from one process on the same microbatches:
    each replica accumulates over its half of the batch, then the replicas' sums
    are averaged, which is what the pipeline's one dp all-reduce does
    ((a + b) / 2 in fp32 is the same on every rank and here)."""
    name, pp, m, v, tied = case
    cfg = GPTConfig(**{**CFG.__dict__, "tied_head": tied})
    dp = 4 // pp
    losses, grads = [], []
    for d in range(dp):
        loss, g = accumulated_gradients(cfg, *shard_batch(*_batch(), d, dp), m)
        losses.append(loss)
        grads.append(g)
    avg = {
        n: sum(g[n] for g in grads) / dp if dp > 1 else grads[0][n] for n in grads[0]
    }
    return losses, avg


@pytest.mark.cluster
@pytest.mark.parametrize(
    "i", range(len(CASES)), ids=[f"{c[0]}-pp{c[1]}" + "-tied" * c[4] for c in CASES]
)
def test_pipeline_matches_one_process(cases, i):
    name, pp, m, v, tied = CASES[i]
    losses, ref = _expected(CASES[i])
    got = {}
    for res in cases[i]:
        c = res["coords"]
        if c["pp"] == pp - 1:  # the stage with the head reports its replica's loss
            assert res["stats"]["loss"] == losses[c["dp"]]
        else:
            assert res["stats"]["loss"] is None
        for n, g in res["grads"].items():
            if n in got and n != "wte.weight":  # dp replicas agree exactly
                assert torch.equal(got[n], g), n
            got.setdefault(n, g)
    assert sorted(got) == sorted(ref)
    for n in ref:
        if tied and n == "wte.weight":
            # the tied embedding's two copies are summed once per step (sum over
            # microbatches of head grads + sum of embedding grads) where one process
            # adds head + embedding once per microbatch: same terms, another order,
            # so fp32 rounding differs by a few ulps of the largest term
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(got[n], ref[n]), n


@pytest.mark.cluster
def test_pipeline_gradients_close_to_full_batch_reference(cases):
    # dtlab.reference: one backward over the whole global batch. Its matmuls sum over
    # all 8 rows at once where microbatches sum 2 rows at a time and then add the m
    # partial sums, so the results agree to fp32 rounding, not bits (measured: at
    # most 2e-8 apart; atol 1e-6 leaves room for other CPUs' kernels).
    from dtlab.reference import make_optimizer, reference_step

    model = GPT(CFG)
    out = reference_step(model, make_optimizer(model.parameters()), *_batch())
    ref = {n: q.grad for n, q in model.named_parameters()}
    for i in (1, 2):  # 1F1B and interleaved on 4 stages
        got = {n: g for res in cases[i] for n, g in res["grads"].items()}
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6)
        last = cases[i][3]["stats"]["loss"]
        assert last == pytest.approx(out["loss"], rel=1e-6)


@pytest.mark.cluster
def test_measured_in_flight_equals_the_schedule_bound(cases):
    for i, (name, pp, m, v, _) in enumerate(CASES):
        s = make_schedule(name, pp, m, v)
        bound = [max(t) for t in in_flight(s)]
        for res in cases[i]:
            stage = res["coords"]["pp"]
            assert res["stats"]["peak_in_flight"] == bound[stage]
            samples = [e for e in res["events"] if e["kind"] == "memory"]
            assert max(e["in_flight"] for e in samples) == bound[stage]
            assert samples[-1]["in_flight"] == 0  # everything released at the end
            assert samples[-1]["activations"] == 0
    # GPipe holds all m microbatches; 1F1B at most p - stage
    gp = [res["stats"]["peak_in_flight"] for res in cases[0]]
    fb = [res["stats"]["peak_in_flight"] for res in cases[1]]
    assert gp == [4, 4, 4, 4] and fb == [4, 3, 2, 1]
    # activation bytes follow: stage 0 of 1F1B holds 4 microbatches, stage 2 only 2
    peak = [res["stats"]["peak_activation_bytes"] for res in cases[1]]
    assert peak[0] > peak[1] > peak[2]
    assert peak[2] == pytest.approx(peak[1] * 2 / 3, rel=0.01)


@pytest.mark.cluster
def test_sent_activations_are_freed_and_messages_have_the_right_size(cases):
    act_bytes = (BATCH // 4) * CFG.seq_len * CFG.d_model * 4  # one microbatch, fp32
    for res in cases[1]:  # 1F1B, 4 stages, m = 4
        stage = res["coords"]["pp"]
        sends = [c for c in res["comm"] if c[0] == "send"]
        # Megatron's trick: every stage output but the last stage's is freed once sent
        assert res["stats"]["freed_bytes"] == (4 * act_bytes if stage < 3 else 0)
        assert sorted(c[1] for c in sends) == sorted(
            ["act"] * 4 * (stage < 3) + ["grad"] * 4 * (stage > 0)
        )
        assert all(c[2] == act_bytes for c in sends)


@pytest.mark.cluster
def test_telemetry_spans_per_stage_and_microbatch(cases):
    events = [e for res in cases[2] for e in res["events"]]  # interleaved, 4 stages
    timeline = measured_timeline(events)
    for stage in range(4):
        mine = [e for e in timeline if e["stage"] == stage]
        fwd = sorted((e["chunk"], e["microbatch"]) for e in mine if e["name"] == "F")
        bwd = sorted((e["chunk"], e["microbatch"]) for e in mine if e["name"] == "B")
        assert fwd == bwd == [(c, i) for c in range(2) for i in range(4)]
        # spans on one rank never overlap and follow the schedule's order
        order = [f"{e['name']}{e['microbatch']}.{e['chunk']}" for e in mine]
        expected = [
            f"{a.op}{a.microbatch}.{a.chunk}"
            for a in interleaved_1f1b(4, 4, 2).compute_order(stage)
        ]
        assert [o for o in order if not o.startswith("idle")] == expected
        mine.sort(key=lambda e: e["t_start"])
        assert all(a["t_end"] <= b["t_start"] for a, b in zip(mine, mine[1:]))
    # data dependencies hold in real time: the ranks share one clock (absolute
    # wall-clock stamps), so stage 1 starts a microbatch only after stage 0 ended it
    f = {
        (e["stage"], e["chunk"], e["microbatch"]): e
        for e in events
        if e["kind"] == "span" and e["name"] == "F" and e.get("replica", 0) == 0
    }
    for i in range(4):
        assert f[1, 0, i]["t_start"] >= f[0, 0, i]["t_end"] - 1e-3


def _train(steps, schedule, m, v):
    import torch.distributed as dist

    from dtlab.pipeline import train_pipeline

    topo = Topology(Layout(pp=4, dp=dist.get_world_size() // 4))
    return train_pipeline(
        CFG,
        topo,
        steps=steps,
        global_batch_size=BATCH,
        schedule=schedule,
        microbatches=m,
        chunks=v,
    )


@pytest.mark.cluster
def test_training_steps_match_the_reference(lab_cluster):
    from dtlab.reference import make_optimizer, train_reference

    steps = 3
    records = lab_cluster(4).run(_train, steps, "interleaved", 4, 2, timeout=120)
    losses = [r["loss"] for r in records[0]]
    # every rank got the loss (sent from the last stage)
    assert all([r["loss"] for r in rank] == losses for rank in records)
    # the same microbatches through one process, AdamW in between: bit for bit
    model = GPT(CFG)
    opt = make_optimizer(model.parameters())
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    exact = []
    for n in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = data.batch(n, BATCH)
        parts = []
        for xi, yi in zip(x.tensor_split(4), y.tensor_split(4)):
            _, loss = model(xi, yi)
            (loss / 4).backward()
            parts.append(loss.detach())
        opt.step()
        exact.append(torch.stack(parts).mean().item())
    assert losses == exact
    # dtlab.reference's full-batch steps: fp32 rounding of the larger sums (see
    # above), carried through AdamW for 3 steps, stays far below 1e-5 relative
    ref = train_reference(CFG, steps=steps, global_batch_size=BATCH).losses
    assert losses == pytest.approx(ref, rel=1e-5)
    assert losses[-1] < losses[0]


def _vs_torch(schedule, m):
    import torch.distributed as dist

    from dtlab.bench.pipeline import torch_pipeline

    topo = Topology(Layout(pp=dist.get_world_size()))
    x, y = _batch()
    pipe = Pipeline(CFG, topo, schedule, microbatches=m)
    ours = pipe.step(x, y)["loss"]
    stage = build_stages(CFG, 4, topo.coords["pp"])[0]
    theirs = torch_pipeline(stage, topo, schedule, m)(x, y)
    return (
        ours,
        theirs,
        {n: q.grad for n, q in pipe.named_parameters()},
        {n: q.grad for n, q in stage.global_named_parameters()},
    )


@pytest.mark.cluster
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_matches_torch_distributed_pipelining(lab_cluster, schedule):
    for ours, theirs, g_ours, g_theirs in lab_cluster(4).run(
        _vs_torch, schedule, 4, timeout=120
    ):
        assert ours == theirs
        assert sorted(g_ours) == sorted(g_theirs)
        for n in g_ours:
            # torch back-propagates L_i and divides the summed grads by m = 4 at the
            # end; dtlab back-propagates L_i / 4. Scaling by a power of two is exact
            # in fp32, so the two agree bit for bit.
            assert torch.equal(g_ours[n], g_theirs[n]), n


# ---- the bubble, measured ------------------------------------------------------------
def test_estimate_rejects_bad_pipeline_input():
    with pytest.raises(ValueError, match="stage 4 is outside"):
        est.pipeline_in_flight(4, 4, 8)
    with pytest.raises(ValueError, match="unknown schedule"):
        est.pipeline_in_flight(4, 0, 8, "pipedream")
    with pytest.raises(ValueError, match="needs schedule='interleaved'"):
        est.pipeline_step_time(4, 8, 1.0, 2.0, v=2)
    with pytest.raises(ValueError, match="m must be a positive integer"):
        est.pipeline_bubble_fraction(4, 0)


def test_gantt_draws_one_bar_per_span_and_one_row_per_stage():
    pytest.importorskip("plotly")
    from dtlab.lab.figures.pipeline import pipeline_bubble_figure, pipeline_gantt

    spans = simulate(interleaved_1f1b(2, 4, 2))
    fig = pipeline_gantt(spans, scale=1, unit="t_f")
    bars = {t.name: t for t in fig.data}
    assert sum(len(t.x) for t in fig.data) == len(spans)
    assert len(bars["F"].x) == len(bars["B"].x) == 2 * 4 * 2
    # the idle bars add up to the bubble of each stage
    idle = [
        sum(d for y, d in zip(bars["idle"].y, bars["idle"].x) if y == f"stage {s}")
        for s in range(2)
    ]
    step = max(e["t_end"] for e in spans)
    assert [i / step for i in idle] == pytest.approx(bubble(spans, per_rank=True))
    assert set(bars["F"].y) == {"stage 0", "stage 1"}
    rows = [
        {"p": 2, "m": m, "simulated": bubble(simulate(gpipe(2, m)))} for m in (1, 2)
    ]
    fig = pipeline_bubble_figure(rows)
    assert list(fig.data[-1].y) == pytest.approx([0.5, 1 / 3])

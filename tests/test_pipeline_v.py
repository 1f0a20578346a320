"""ZB-V and DualPipeV: two chunks per rank placed in a V, checked as data against
PyTorch's own orders, timed by the simulator, then run on real ranks and compared
with one process, with 1F1B, and with torch.distributed.pipelining.

Exactness. In a V, rank r runs the layers of virtual stages r and 2p-1-r, and each
chunk runs its forwards, input gradients (B) and weight gradients (W) in microbatch
order. B and W together compute, op for op, the backward one process runs (the
existing ZB-H1 test shows it on one stage), and each parameter's gradient gathers
its m microbatch terms in microbatch order, as one process accumulating L_i / m
does: so the gradients are equal bit for bit. The tied-embedding case gets the
tolerance tests/test_pipeline.py derives (two copies summed once per step).
"""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

import pytest
import torch

from dtlab import events
from dtlab.launch import spawn
from dtlab.model import GPT, GPTConfig, SyntheticTokens
from dtlab.pipeline import (
    Action,
    Pipeline,
    Schedule,
    ScheduleError,
    backward_pass,
    bubble,
    build_stages,
    catalogue,
    dualpipe_v,
    from_compute_orders,
    in_flight,
    make_schedule,
    one_f_one_b,
    partition,
    simulate,
    stage_place,
    validate,
    virtual_stage,
    zb_h1,
    zb_v,
    zero_bubble,
)
from dtlab.reference import accumulated_gradients
from dtlab.topology import Layout, Topology

# 8 layers: 2 per virtual stage on p = 2 (4 stages in the V), 1 on p = 4
CFG = GPTConfig(
    vocab_size=64, seq_len=16, n_layers=8, n_heads=2, d_model=32, tied_head=False
)
TIED = GPTConfig(**{**CFG.__dict__, "tied_head": True})
BATCH = 8
V_BUILDERS = {"zb_v": zb_v, "dualpipe_v": dualpipe_v}


def _batch(step=0):
    return SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(step, BATCH)


# ---- the V placement -----------------------------------------------------------------
def test_the_v_places_the_last_stage_on_rank_0():
    for p in (1, 2, 3, 4):
        seen = set()
        for r in range(p):
            for c in (0, 1):
                s = virtual_stage(p, r, c, "v")
                assert stage_place(p, s, "v") == (r, c)
                seen.add(s)
                # the interleaved placement is unchanged: c·p + r
                assert virtual_stage(p, r, c) == c * p + r
                assert stage_place(p, c * p + r) == (r, c)
        assert seen == set(range(2 * p))
        assert virtual_stage(p, 0, 1, "v") == 2 * p - 1  # loss on rank 0
        assert virtual_stage(p, p - 1, 1, "v") == p  # the turn stays on rank p-1
    assert zb_v(4, 8).loss_rank == dualpipe_v(4, 8).loss_rank == 0
    assert one_f_one_b(4, 8).loss_rank == 3
    # layers follow the placement: rank 1 of a p=2 V holds stages 1 and 2
    assert partition(CFG, 2, 2, "v")[1] == [range(2, 4), range(4, 6)]
    assert partition(CFG, 2, 2)[1] == [range(2, 4), range(6, 8)]


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
def test_v_stages_hold_the_full_models_weights(cfg):
    full = dict(GPT(cfg, seed=3).named_parameters())
    for p in (1, 2, 4):
        names = []
        for r in range(p):
            chunks = build_stages(cfg, p, r, 2, seed=3, placement="v")
            assert chunks[0].first == (r == 0) and chunks[1].last == (r == 0)
            for stage in chunks:
                for name, param in stage.global_named_parameters():
                    assert torch.equal(param, full[name]), name
                    names.append(name)
        # every weight once; a tied embedding twice (wte on chunk 0, the head's
        # copy on chunk 1, both on rank 0)
        assert sorted(set(names)) == sorted(full)
        assert len(names) == len(full) + cfg.tied_head


# ---- the orders are PyTorch's --------------------------------------------------------
def _torch_compute_order(cls, p: int, m: int, rank: int) -> list:
    """PyTorch's compute order of ``rank`` as dtlab's ``(op, microbatch, chunk)``.

    Every rank of a PyTorch schedule computes every rank's list in
    ``_calculate_single_rank_operations`` from three numbers, so it runs here
    without a process group (a private method: a renamed one fails this test
    loudly). PyTorch's I (input gradient) is dtlab's B; its full backward B is
    dtlab's B then W at once; an overlapped F&B pair runs its two actions in
    order, as PyTorch's runtime runs them."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    ops = {
        T.FORWARD: ("F",),
        T.BACKWARD_INPUT: ("B",),
        T.BACKWARD_WEIGHT: ("W",),
        T.FULL_BACKWARD: ("B", "W"),
    }
    plan = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    out = []
    for a in cls._calculate_single_rank_operations(plan, rank):
        for sub in (a.sub_actions or (a,)) if a is not None else ():
            chunk = stage_place(p, sub.stage_index, "v")[1]
            out += [
                (op, sub.microbatch_index, chunk) for op in ops[sub.computation_type]
            ]
    return out


def _ours(schedule, rank):
    return [(a.op, a.microbatch, a.chunk) for a in schedule.compute_order(rank)]


def test_compute_orders_are_pytorchs_action_for_action():
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble

    n = 0
    for p in (1, 2, 3, 4, 5):
        for m in range(1, 4 * p + 2):
            for build, cls in ((zb_v, ScheduleZBVZeroBubble),
                               (dualpipe_v, ScheduleDualPipeV)):  # fmt: skip
                if build is dualpipe_v and m < 2 * p:
                    continue
                s = build(p, m)
                for r in range(p):
                    assert _ours(s, r) == _torch_compute_order(cls, p, m, r), (
                        build.__name__,
                        p,
                        m,
                        r,
                    )
                n += 1
    assert n > 80


def test_v_schedules_are_complete_and_turn_in_memory():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 2 * p - 1, 2 * p, 3 * p + 1):
            for name, build in V_BUILDERS.items():
                if name == "dualpipe_v" and m < 2 * p:
                    continue
                s = validate(build(p, m))
                assert (s.v, s.placement, s.split_backward) == (2, "v", True)
                for r, acts in enumerate(s.actions):
                    ops = [a.op for a in acts]
                    assert ops.count("F") == ops.count("B") == ops.count("W") == 2 * m
                    # a message to oneself only at the turn, stage p-1 -> p
                    own = [a for a in acts if a.peer == r]
                    assert len(own) == (4 * m if r == p - 1 else 0)
                    # rank 0 holds stages 0 and 2p-1: it neither receives
                    # activations for stage 0 nor sends any from the last stage
                    if r == 0 and p > 1:
                        assert ops.count("recv_act") == ops.count("send_act") == m


# ---- the validator and bad input -----------------------------------------------------
def _orders(s):
    return [list(s.compute_order(r)) for r in range(s.p)]


def _rebuild(s, orders):
    return from_compute_orders(
        "edited", s.p, s.m, orders, v=2, split_backward=True, placement="v"
    )


def _move_before(order, what, before):
    order.remove(what)
    order.insert(order.index(before), what)


def test_validator_rejects_dependency_violations_in_a_v():
    s = zb_v(2, 4)

    def F(i, c):
        return Action("F", i, c)

    def B(i, c):
        return Action("B", i, c)

    def W(i, c):
        return Action("W", i, c)

    # W before its own B
    orders = _orders(s)
    _move_before(orders[0], W(0, 1), B(0, 1))
    with pytest.raises(
        ScheduleError, match="runs W of microbatch 0 chunk 1 before its B"
    ):
        validate(_rebuild(s, orders))
    # B before its own F
    orders = _orders(s)
    _move_before(orders[1], B(3, 0), F(3, 0))
    with pytest.raises(
        ScheduleError, match="runs B of microbatch 3 chunk 0 before its F"
    ):
        validate(_rebuild(s, orders))
    # at the turn: stage p (chunk 1 of rank p-1) before stage p-1 (chunk 0)
    orders = _orders(s)
    _move_before(orders[1], F(0, 1), F(0, 0))
    with pytest.raises(ScheduleError, match="waits for its own act of microbatch 0"):
        validate(_rebuild(s, orders))
    # across ranks: rank 0's last stage before the microbatch came back up
    orders = _orders(s)
    _move_before(orders[0], F(0, 1), F(0, 0))
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(_rebuild(s, orders))
    # microbatches swapped on a link: rank 0's chunk 0 sends 1 before 0
    orders = _orders(s)
    _move_before(orders[0], F(1, 0), F(0, 0))
    with pytest.raises(ScheduleError, match="in the order they were sent"):
        validate(_rebuild(s, orders))


def test_bad_arguments_name_the_fix():
    # PyTorch's ScheduleDualPipeV requires n_microbatches >= stages (2p) as well
    with pytest.raises(ValueError, match=r"use m >= 4"):
        dualpipe_v(2, 3)
    with pytest.raises(ValueError, match="m must be a positive integer"):
        zb_v(2, 0)
    # PyTorch's ScheduleZBVZeroBubble takes any m, padding to 2p-1; so does zb_v
    assert validate(zb_v(4, 1)).m == 1
    with pytest.raises(ValueError, match="runs 2 chunks per rank; chunks=3 needs"):
        make_schedule("zb_v", 2, 4, 3)
    assert make_schedule("dualpipe_v", 2, 4, 2) == make_schedule("dualpipe_v", 2, 4)
    with pytest.raises(ValueError, match="the V placement holds 2 chunks"):
        Schedule("x", 2, 4, 3, ((), ()), placement="v")
    with pytest.raises(ValueError, match="placement 'w'"):
        Schedule("x", 2, 4, 1, ((), ()), placement="w")
    with pytest.raises(ValueError, match="the V placement holds 2 chunks"):
        partition(CFG, 2, 1, "v")
    for alias, name in (("ZB-V", "zb_v"), ("zbv", "zb_v"), ("DualPipeV", "dualpipe_v")):
        assert make_schedule(alias, 2, 4) == make_schedule(name, 2, 4)
    assert {"zb_v", "dualpipe_v"} <= set(events.SCHEDULES)
    # a Pipeline of a V on one rank checks the layers split into 2 chunks
    with pytest.raises(ValueError, match="chunks=2 does not divide n_layers=3"):
        Pipeline(
            GPTConfig(**{**CFG.__dict__, "n_layers": 3}),
            Topology(Layout(), 0),
            "zb_v",
            microbatches=2,
        )


def test_new_modules_need_no_process_group_and_the_split_fits_on_a_slide():
    # like schedules.py and simulator.py: data and pure functions, no torch
    allowed = {"__future__", "collections", "dtlab.checks", "dtlab.events"}
    allowed |= {"dtlab.pipeline.schedules", "dtlab.pipeline.zero_bubble"}
    for module in (zero_bubble, catalogue):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert imported <= allowed, (module.__name__, imported - allowed)
    # chapter 05 shows the B/W split: one short function, three autograd calls
    source = inspect.getsource(backward_pass)
    assert len(source.splitlines()) <= 25
    assert source.count("torch.autograd.backward(") == 3


# ---- bubble and memory, simulated ----------------------------------------------------
GRID = [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (8, 16)]


def _step(s, t_f=1.0, t_b=2.0, t_w=1.0):
    spans = simulate(s, t_f, t_b, t_w)
    return max(e["t_end"] for e in spans), bubble(spans)


def test_with_equal_times_the_v_idles_only_while_microbatch_0_comes_down():
    # t_F = t_B = t_W: t_f = 1 and t_b = 2 per rank's layers, half that per chunk.
    # Rank r cannot start before microbatch 0 has run through the r chunks above
    # it (r·t_f/2), and every rank has the same 3m of work, so no schedule ends
    # before 3m + (p-1)·t_f/2: ZB-V and DualPipeV end exactly then.
    for p, m in GRID:
        for s in (zb_v(p, m), dualpipe_v(p, m)):
            t, b = _step(s)
            assert t == pytest.approx(3 * m + (p - 1) / 2), (s.name, p, m)
            assert b == pytest.approx(1 - 3 * m / t)
    # ZB-V idles nowhere else: rank r waits r·t_f/2 for microbatch 0 at the start
    # and (p-1-r)·t_f/2 for the others at the end (its work started that much
    # earlier), none in the steady state or the cool-down
    p, m = 4, 16
    spans = simulate(zb_v(p, m), 1.0, 2.0, 1.0)
    t = 3 * m + (p - 1) / 2
    for r in range(p):
        idle = [
            (e["t_start"], e["t_end"])
            for e in spans
            if e["rank"] == r and e["name"] == "idle" and e["t_end"] > e["t_start"]
        ]
        want = [(0.0, r / 2)] * (r > 0) + [(t - (p - 1 - r) / 2, t)] * (r < p - 1)
        assert idle == want, r  # halves: exact in floats


def test_bubble_zb_v_below_zb_h1_below_1f1b_and_memory_of_each():
    for p, m in GRID:
        t1, b1 = _step(one_f_one_b(p, m), 1.0, 2.0)  # B whole: t_b = 2
        th, bh = _step(zb_h1(p, m))
        tv, bv = _step(zb_v(p, m))
        td, bd = _step(dualpipe_v(p, m))
        assert bv < bh < b1, (p, m)
        assert bd == pytest.approx(bv)  # no F&B overlap here: same step
        # the formulas: 1F1B (p-1)(t_f + t_b), ZB-H1 (p-1)(t_f + t_B - t_W),
        # the V (p-1)·t_f/2, on top of the 3m of work
        assert (t1, th, tv) == pytest.approx(
            (3 * m + 3 * (p - 1), 3 * m + (p - 1), 3 * m + (p - 1) / 2)
        )
        # activations in flight, in microbatches of a whole rank's layers (a
        # chunk is half of them): 1F1B's first stage p, ZB-H1 p everywhere, ZB-V
        # p everywhere (2p chunks), DualPipeV one chunk more, p + 1/2 (the DualPipe
        # paper's PP + 1 chunks for PP = 2p stages)
        peaks = {
            s.name: [max(t) / s.v for t in in_flight(s)]
            for s in (one_f_one_b(p, m), zb_h1(p, m), zb_v(p, m), dualpipe_v(p, m))
        }
        assert peaks["1f1b"] == [p - r for r in range(p)]
        assert peaks["zb_h1"] == peaks["zb_v"] == [p] * p
        assert peaks["dualpipe_v"] == [p + 0.5] * p


# ---- one process: the V on a single rank ---------------------------------------------
def test_a_v_on_one_rank_is_the_model():
    # p = 1: both chunks on rank 0, every hand-over local, no process group
    x, y = _batch()
    loss, ref = accumulated_gradients(CFG, x, y, 4)
    for name in V_BUILDERS:
        pipe = Pipeline(CFG, Topology(Layout(), 0), name, microbatches=4)
        assert len(pipe.stages) == 2
        assert pipe.step(x, y)["loss"] == loss
        for n, q in pipe.named_parameters():
            assert torch.equal(q.grad, ref[n]), (name, n)


# ---- across ranks --------------------------------------------------------------------
def _torch_v(stages, topo, name: str, m: int):
    """``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` or
    ``ScheduleDualPipeV`` around the same two :class:`StageModule` chunks (stage
    indices of the V). Returns the runner and ``step(x, y)``: the mean microbatch
    loss on rank 0, which holds the last stage (``None`` elsewhere)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    pp = topo.axis("pp")
    kinds = {"zb_v": ScheduleZBVZeroBubble, "dualpipe_v": ScheduleDualPipeV}
    pipe_stages = [
        PipelineStage(
            chunk,
            virtual_stage(pp.size, pp.index, c, "v"),
            2 * pp.size,
            torch.device("cpu"),
            group=topo.group("pp"),
        )
        for c, chunk in enumerate(stages)
    ]
    runner = kinds[name](pipe_stages, n_microbatches=m, loss_fn=stages[0].loss)

    def step(x, y):
        losses: list = []
        if pp.index == 0:  # stage 0's input and the last stage's targets
            runner.step(x, target=y, losses=losses)
        else:
            runner.step()
        return torch.stack(losses).mean().item() if losses else None

    return runner, step


def _on_ranks(cases, torch_names, train_steps):
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.pipeline import train_pipeline

    topo = Topology(Layout(pp=dist.get_world_size()))
    rank, p = topo.coords["pp"], topo.size("pp")
    x, y = _batch()
    out = {"cases": [], "torch": {}, "train": None}
    for name, m, tied in cases:
        pipe = Pipeline(TIED if tied else CFG, topo, name, microbatches=m)
        rec = telemetry.Recorder(rank)
        with telemetry.use(rec):
            stats = pipe.step(x, y)
        out["cases"].append(
            {
                "stats": stats,
                "grads": {n: q.grad.clone() for n, q in pipe.named_parameters()},
                "sends": [e["tag"] for e in rec.events if e.get("op") == "send"],
            }
        )
    for name in torch_names:
        m = 2 * p
        stages = build_stages(CFG, p, rank, 2, placement="v")
        runner, step = _torch_v(stages, topo, name, m)
        loss = step(x, y)
        order = [  # PyTorch's actions, an F&B pair as its two halves
            (sub.computation_type.value, sub.microbatch_index, sub.stage_index)
            for a in runner.pipeline_order[rank]
            if a is not None
            for sub in (a.sub_actions or (a,))
        ]
        out["torch"][name] = {
            "loss": loss,
            "grads": {
                n: q.grad.clone()
                for stage in stages
                for n, q in stage.global_named_parameters()
            },
            "order": order,
        }
    if train_steps:
        records = train_pipeline(
            CFG,
            topo,
            steps=train_steps,
            global_batch_size=BATCH,
            schedule="dualpipe_v",
            microbatches=2 * p,
        )
        out["train"] = [r["loss"] for r in records]
    return out


# (schedule, m, tied head) on 2 ranks
CASES_2 = [
    ("1f1b", 4, False),
    ("zb_v", 4, False),
    ("dualpipe_v", 4, False),
    ("zb_v", 2, False),
    ("dualpipe_v", 4, True),
]
CASES_4 = [("zb_v", 8, False), ("dualpipe_v", 8, False)]


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_on_ranks, 2, CASES_2, list(V_BUILDERS), 2, timeout=60)


@pytest.fixture(scope="module")
def four_ranks():
    return spawn(_on_ranks, 4, CASES_4, [], 0, timeout=60)


def _gathered(per_rank, i):
    grads = {}
    for res in per_rank:
        for n, g in res["cases"][i]["grads"].items():
            assert n not in grads or n == "wte.weight", n  # each weight on one rank
            grads.setdefault(n, g)
    return grads


def _check_against_one_process(per_rank, cases, p):
    x, y = _batch()
    for i, (name, m, tied) in enumerate(cases):
        loss, ref = accumulated_gradients(TIED if tied else CFG, x, y, m)
        s = make_schedule(name, p, m)
        for r, res in enumerate(per_rank):
            stats = res["cases"][i]["stats"]
            # the loss lives where the last stage does: rank 0 in a V
            assert stats["loss"] == (loss if r == s.loss_rank else None), (name, r)
            assert stats["peak_in_flight"] == max(in_flight(s)[r]), (name, r)
        got = _gathered(per_rank, i)
        assert sorted(got) == sorted(ref)
        for n in ref:
            if tied and n == "wte.weight":
                # the embedding's two copies, both on rank 0, are added once per
                # step, where one process adds head and embedding terms once per
                # microbatch: same terms, another order (tests/test_pipeline.py)
                torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7)
            else:
                assert torch.equal(got[n], ref[n]), (name, n)


def test_two_ranks_match_one_process_and_1f1b(two_ranks):
    _check_against_one_process(two_ranks, CASES_2, 2)
    one_f_one_b_grads = _gathered(two_ranks, 0)
    for i in (1, 2):  # ZB-V and DualPipeV, m = 4: 1F1B's gradients, bit for bit
        got = _gathered(two_ranks, i)
        assert all(torch.equal(got[n], one_f_one_b_grads[n]) for n in got)
    # the V crosses the ranks twice, down and back up: each rank sends m = 4
    # activations and 4 gradients, where 1F1B's first rank sends only activations
    # and its last only gradients. The turn (stage 1 -> 2, both on rank 1) is
    # handed over in memory: no message for it on the wire.
    sends = [[sorted(res["cases"][i]["sends"]) for res in two_ranks] for i in range(3)]
    assert sends[0] == [["act"] * 4, ["grad"] * 4]
    assert sends[1] == sends[2] == [["act"] * 4 + ["grad"] * 4] * 2
    # DualPipeV holds one microbatch-chunk more than ZB-V, and so more bytes
    for res in two_ranks:
        zbv, dpv = (res["cases"][i]["stats"] for i in (1, 2))
        assert (zbv["peak_in_flight"], dpv["peak_in_flight"]) == (4, 5)
        assert dpv["peak_activation_bytes"] > zbv["peak_activation_bytes"]


def test_four_ranks_match_one_process(four_ranks):
    _check_against_one_process(four_ranks, CASES_4, 4)


def test_matches_torch_distributed_pipelining(two_ranks):
    x, y = _batch()
    for name in V_BUILDERS:
        ours = two_ranks[0]["cases"][1 if name == "zb_v" else 2]
        theirs = [res["torch"][name] for res in two_ranks]
        assert theirs[0]["loss"] == ours["stats"]["loss"]
        assert theirs[1]["loss"] is None
        # PyTorch back-propagates L_i and divides the summed gradients by m = 4
        # at the end; dtlab back-propagates L_i / 4. Scaling by a power of two is
        # exact in fp32, and both accumulate microbatches in the same order, so
        # the gradients agree bit for bit.
        got = _gathered(two_ranks, 1 if name == "zb_v" else 2)
        for res in theirs:
            for n, g in res["grads"].items():
                assert torch.equal(g, got[n]), (name, n)
        # the order PyTorch's runtime ran is the one compared without ranks above
        build = V_BUILDERS[name]
        for r, res in enumerate(theirs):
            order = [(op, i, stage_place(2, s, "v")[1]) for op, i, s in res["order"]]
            expanded = [
                (o, i, c)
                for op, i, c in order
                for o in {"I": "B", "B": "BW"}.get(op, op)
            ]
            assert expanded == _ours(build(2, 4), r)


def test_training_with_dualpipe_v_matches_one_process(two_ranks):
    # two AdamW steps; the loss broadcast from rank 0, where the V ends
    from dtlab.reference import make_optimizer

    losses = [res["train"] for res in two_ranks]
    assert losses[0] == losses[1]
    model = GPT(CFG)
    opt = make_optimizer(model.parameters())
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    exact = []
    for n in range(2):
        opt.zero_grad(set_to_none=True)
        x, y = data.batch(n, BATCH)
        parts = []
        for xi, yi in zip(x.tensor_split(4), y.tensor_split(4)):
            _, loss = model(xi, yi)
            (loss / 4).backward()
            parts.append(loss.detach())
        opt.step()
        exact.append(torch.stack(parts).mean().item())
    assert losses[0] == exact

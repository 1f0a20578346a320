"""dtlab.ddp: DDP against the single-process reference and against PyTorch's DDP, on
the same global batches; buckets, overlap, no_sync, frozen/tied/unused parameters;
and the naive single-process DataParallel.

On exactness. DDP sums each rank's shard gradient across ranks; the reference sums
the whole batch inside one backward. Those are different orders of floating-point
addition, so the comparison that can be exact is against a reference that computes
each shard's gradient separately (as each rank does) and adds them as the all-reduce
does. With two ranks that is ``g0/2 + g1/2``, and a sum of two numbers does not
depend on order: bit for bit. With four ranks gloo's ring adds each element in an
order that depends on where it sits in the flat bucket, so the exact check is
per element: every averaged gradient equals *one* of the 15 ways of adding the four
shard gradients.
"""

import itertools
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from dtlab import estimate, telemetry
from dtlab.ddp import DataParallel, DistributedDataParallel
from dtlab.model import GPT, GPTConfig, SyntheticTokens, shard_batch
from dtlab.reference import make_optimizer, train_reference

CFG = GPTConfig()  # 2 layers, d_model 64, vocab 64, seq 32, tied head: ~106K params
B = 8  # global batch
STEPS = 3
CAPS = {"one": 25.0, "two": 0.2, "many": 1e-6}  # bucket_cap_mb -> 1, 2, 36 buckets
FROZEN = ("wpe.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias")


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(model, ddp, steps, r, n, *, k=1, rec=None):
    """AdamW steps through ``ddp`` on this rank's slice of each global batch, in
    ``k`` microbatches (all but the last under no_sync). Returns, per step, the
    weights before it and the gradients ``loss.backward()`` left; and the final
    weights."""
    opt = make_optimizer(ddp.parameters())
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    trace = []
    for step in range(steps):
        if rec is not None:
            rec.step = step
        before = _state(model)
        x, y = shard_batch(*data.batch(step, B), r, n)
        opt.zero_grad(set_to_none=True)
        micro = list(zip(x.chunk(k), y.chunk(k)))
        for m, (xm, ym) in enumerate(micro):
            with ddp.no_sync() if m < k - 1 else nullcontext():
                _, loss = ddp(xm, ym)
                (loss / k if k > 1 else loss).backward()
        grads = {
            name: p.grad.clone()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        opt.step()
        trace.append({"before": before, "grads": grads})
    return {"trace": trace, "final": _state(model)}


class WithUnused(nn.Module):
    """A GPT plus a layer the loss may not use (``use_extra`` decides per call)."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(CFG)
        self.extra = nn.Linear(CFG.vocab_size, CFG.vocab_size)
        with torch.no_grad():  # the same weights in every process
            gen = torch.Generator().manual_seed(0)
            self.extra.weight.copy_(0.02 * torch.randn(64, 64, generator=gen))
            self.extra.bias.zero_()

    def forward(self, x, y, use_extra=False):
        logits, loss = self.gpt(x, y)
        if use_extra:
            loss = loss + self.extra(logits).pow(2).mean()
        return logits, loss


# ---- what every rank runs ------------------------------------------------------------
def _scenarios():
    """Everything that needs ranks, in one call (tensors come back from ranks 0
    and 1 only; the others report what they checked themselves)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from dtlab.topology import Layout, Topology

    rank = dist.get_rank()
    out = {"rank": rank}
    topo = Topology(Layout(dp=2, tp=2))
    dp = topo.axis("dp")  # two groups of two: [0, 2] and [1, 3]
    r2 = dp.index

    # -- two ranks: every bucket size; telemetry of the many-bucket run
    for name, cap in CAPS.items():
        rec = telemetry.Recorder(rank)
        model = GPT(CFG)
        ddp = DistributedDataParallel(model, bucket_cap_mb=cap, process_group=dp)
        with telemetry.use(rec):
            out[f"dp2_{name}"] = _run(model, ddp, STEPS, r2, 2, rec=rec)
        out[f"dp2_{name}_buckets"] = ddp.bucket_names()
        out[f"dp2_{name}_events"] = rec.events
        out[f"dp2_{name}_last_sync"] = ddp.last_sync

    # -- two ranks: PyTorch's DDP on the same data
    model = GPT(CFG)
    ddp = TorchDDP(model, process_group=topo.group("dp"))
    out["dp2_torch"] = _run(model, ddp, STEPS, r2, 2)

    # -- frozen parameters (the head stays tied to wte)
    model = GPT(CFG)
    for n, p in model.named_parameters():
        p.requires_grad_(n not in FROZEN)
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAPS["many"], process_group=dp)
    out["frozen"] = _run(model, ddp, STEPS, r2, 2)
    out["frozen_buckets"] = ddp.bucket_names()
    out["tied_after"] = model.head.weight is model.wte.weight

    # -- no_sync accumulation: 2 microbatches per rank, comm recorded
    rec = telemetry.Recorder(rank)
    model = GPT(CFG)
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAPS["two"], process_group=dp)
    with telemetry.use(rec):
        out["accum"] = _run(model, ddp, STEPS, r2, 2, k=2, rec=rec)
    out["accum_events"] = rec.events

    # -- weights broadcast from the group's rank 0 at wrap time
    model = GPT(CFG, seed=100 + rank)
    DistributedDataParallel(model, process_group=dp)
    first = GPT(CFG, seed=100 + dp.ranks[0])
    out["broadcast_ok"] = all(
        torch.equal(p, q) for p, q in zip(model.parameters(), first.parameters())
    )

    # -- finish_gradient_synchronization: idempotent; finishes a no_sync backward
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    x, y = shard_batch(*data.batch(0, B), r2, 2)
    rec = telemetry.Recorder(rank)
    model = GPT(CFG)
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAPS["two"], process_group=dp)
    with telemetry.use(rec):
        ddp(x, y)[1].backward()
        synced = {n: p.grad.clone() for n, p in model.named_parameters()}
        calls = len(telemetry.comm_events(rec.events, tag="ddp"))
        ddp.finish_gradient_synchronization()
        ddp.finish_gradient_synchronization()
        out["finish_no_extra_comm"] = calls == len(
            telemetry.comm_events(rec.events, tag="ddp")
        )
        out["finish_kept_grads"] = all(
            torch.equal(p.grad, synced[n]) for n, p in model.named_parameters()
        )
        model.zero_grad(set_to_none=True)
        with ddp.no_sync():
            ddp(x, y)[1].backward()
        out["no_sync_calls"] = len(telemetry.comm_events(rec.events, tag="ddp")) - calls
        ddp.finish_gradient_synchronization()
        ddp.finish_gradient_synchronization()
        out["finish_after_no_sync"] = all(
            torch.equal(p.grad, synced[n]) for n, p in model.named_parameters()
        )
        out["finish_calls"] = len(telemetry.comm_events(rec.events, tag="ddp")) - calls
        calls = len(telemetry.comm_events(rec.events, tag="ddp"))
        model(x, y)[1].backward()  # the module on its own: DDP stays out of it
        out["direct_calls"] = len(telemetry.comm_events(rec.events, tag="ddp")) - calls

    # -- unused parameters: a clear error, or find_unused_parameters
    model = WithUnused()
    ddp = DistributedDataParallel(model, process_group=dp)
    try:
        ddp(x, y)[1].backward()
        out["unused_error"] = None
    except RuntimeError as exc:
        out["unused_error"] = str(exc)
    results = {}
    for impl in ("dtlab", "torch"):
        model = WithUnused()
        if impl == "dtlab":
            ddp = DistributedDataParallel(
                model, bucket_cap_mb=CAPS["two"], process_group=dp,
                find_unused_parameters=True,
            )  # fmt: skip
        else:
            ddp = TorchDDP(
                model, process_group=topo.group("dp"), find_unused_parameters=True
            )
        grads = []
        for use_extra in (False, r2 == 0):  # unused everywhere, then on one rank
            model.zero_grad(set_to_none=True)
            ddp(x, y, use_extra=use_extra)[1].backward()
            grads.append(
                {
                    n: None if p.grad is None else p.grad.clone()
                    for n, p in model.named_parameters()
                }
            )
        results[impl] = grads
    out["find_unused"] = results

    # -- four ranks: dtlab DDP (two bucket sizes) and PyTorch DDP, whole world
    for name, cap in (("one", CAPS["one"]), ("many", CAPS["many"])):
        model = GPT(CFG)
        ddp = DistributedDataParallel(model, cap)
        out[f"dp4_{name}"] = _run(model, ddp, 2, rank, 4)
    model = GPT(CFG)
    out["dp4_torch"] = _run(model, TorchDDP(model), 2, rank, 4)
    if rank > 1:  # ranks 2 and 3: just say whether they agree with the others
        digest = {k: _digest(v) for k, v in out.items() if isinstance(v, dict)}
        return {"rank": rank, "digest": digest}
    out["digest"] = {k: _digest(v) for k, v in out.items() if isinstance(v, dict)}
    return out


def _digest(obj) -> float:
    """A float64 fingerprint of every tensor in ``obj`` (equal iff, in practice, the
    tensors are equal)."""
    if isinstance(obj, torch.Tensor):
        return float(obj.double().flatten().mul(torch.arange(1, obj.numel() + 1)).sum())
    if isinstance(obj, dict):
        return sum(_digest(v) * (i + 1) for i, v in enumerate(obj.values()))
    if isinstance(obj, (list, tuple)):
        return sum(_digest(v) * (i + 7) for i, v in enumerate(obj))
    return 0.0


@pytest.fixture(scope="module")
def ranks(lab_cluster):
    return lab_cluster(4).run(_scenarios, timeout=240)


# ---- references ------------------------------------------------------------------
def same_order_reference(n, *, steps=STEPS, k=1, frozen=()):
    """One process doing what n DDP ranks do, in the same order: each shard's
    gradient on its own (k microbatches accumulated), times 1/n, then added up.
    Only meaningful bit for bit for n=2, where the order of the sum cannot matter."""
    model = GPT(CFG)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    opt = make_optimizer(model.parameters())
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    trace = []
    for step in range(steps):
        x, y = data.batch(step, B)
        shards = [_shard_grads(model, *shard_batch(x, y, r, n), n, k) for r in range(n)]
        opt.zero_grad(set_to_none=True)
        for name, p in model.named_parameters():
            if name in shards[0]:
                p.grad = shards[0][name] + shards[1][name]
        trace.append({name: p.grad.clone() for name, p in model.named_parameters()
                      if p.grad is not None})  # fmt: skip
        opt.step()
    return trace, _state(model)


def _shard_grads(model, x, y, n, k=1):
    """One rank's local gradient, pre-divided by n as DDP's buckets are."""
    model.zero_grad(set_to_none=True)
    for xm, ym in zip(x.chunk(k), y.chunk(k)):
        _, loss = model(xm, ym)
        (loss / k if k > 1 else loss).backward()
    return {
        name: torch.mul(p.grad, 1.0 / n)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _orders_of_four(a, b, c, d):
    """Every way floating-point addition can combine four numbers: 12 chains
    ((p+q)+s)+t and 3 pairings (p+q)+(s+t)."""
    terms = (a, b, c, d)
    sums = [((terms[p] + terms[q]) + terms[s]) + terms[t]
            for p, q, s, t in itertools.permutations(range(4)) if p < q]  # fmt: skip
    sums += [(a + b) + (c + d), (a + c) + (b + d), (a + d) + (b + c)]
    return sums


def _is_one_of_the_orders(got, shards) -> bool:
    hit = torch.zeros_like(got, dtype=torch.bool)
    for s in _orders_of_four(*shards):
        hit |= s == got
    return bool(hit.all())


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- two ranks: bit for bit ----------------------------------------------------------
@pytest.mark.cluster
def test_two_ranks_equal_the_reference_bit_for_bit_for_every_bucket_size(ranks):
    ref_trace, ref_final = same_order_reference(2)
    counts = {}
    for out in ranks[:2]:  # rank 0 is in dp group [0, 2], rank 1 in [1, 3]
        for name in CAPS:
            run = out[f"dp2_{name}"]
            for step, ref_grads in enumerate(ref_trace):
                assert _equal(run["trace"][step]["grads"], ref_grads), (name, step)
            assert _equal(run["final"], ref_final), name
            counts[name] = len(out[f"dp2_{name}_buckets"])
    assert counts == {"one": 1, "two": 2, "many": len(ref_final)}
    # the plain reference (the whole batch in one backward) agrees to rounding
    plain = train_reference(CFG, steps=STEPS, global_batch_size=B).model
    for name, p in plain.named_parameters():
        # 3 AdamW steps of at most lr=1e-3 each; last-bit gradient differences
        # move Adam's normalised update by far less than a tenth of a step
        torch.testing.assert_close(ref_final[name], p.detach(), rtol=0, atol=1e-4)


@pytest.mark.cluster
def test_two_ranks_equal_pytorch_ddp_bit_for_bit(ranks):
    for out in ranks[:2]:
        ours, theirs = out["dp2_many"], out["dp2_torch"]
        for a, b in zip(ours["trace"], theirs["trace"]):
            assert _equal(a["grads"], b["grads"])
        assert _equal(ours["final"], theirs["final"])


@pytest.mark.cluster
def test_replicas_stay_identical_on_every_rank(ranks):
    digests = [out["digest"] for out in ranks]
    # the two dp groups see the same data, so all four ranks agree on everything
    for key in ("dp2_one", "dp2_many", "dp2_torch", "accum", "frozen", "dp4_one"):
        assert len({d[key] for d in digests}) == 1, key
    assert all(out.get("broadcast_ok", True) for out in ranks)
    assert ranks[0]["broadcast_ok"] and ranks[1]["broadcast_ok"]


# ---- four ranks: every element is one of the ways to add four numbers ----------------
@pytest.mark.cluster
@pytest.mark.parametrize("impl", ["dp4_one", "dp4_many", "dp4_torch"])
def test_four_ranks_sum_the_shard_gradients_in_some_order(ranks, impl):
    run = ranks[0][impl]
    data = SyntheticTokens(CFG.vocab_size, CFG.seq_len)
    for step, entry in enumerate(run["trace"]):
        model = GPT(CFG)
        model.load_state_dict(entry["before"], strict=False)  # DDP's own trajectory
        x, y = data.batch(step, B)
        shards = [_shard_grads(model, *shard_batch(x, y, r, 4), 4) for r in range(4)]
        for name, got in entry["grads"].items():
            assert _is_one_of_the_orders(got, [s[name] for s in shards]), (step, name)
    plain = train_reference(CFG, steps=2, global_batch_size=B).model
    for name, p in plain.named_parameters():
        torch.testing.assert_close(run["final"][name], p.detach(), rtol=0, atol=1e-4)


# ---- frozen and tied parameters -----------------------------------------------------
@pytest.mark.cluster
def test_frozen_parameters_are_skipped_and_tied_ones_synchronized_once(ranks):
    out = ranks[0]
    names = [n for b in out["frozen_buckets"] for n in b]
    assert not set(FROZEN) & set(names)
    assert names.count("wte.weight") == 1 and "head.weight" not in names
    assert out["tied_after"]
    ref_trace, ref_final = same_order_reference(2, frozen=FROZEN)
    for step, ref in enumerate(ref_trace):
        assert _equal(out["frozen"]["trace"][step]["grads"], ref)
    assert _equal(out["frozen"]["final"], ref_final)
    start = GPT(CFG).state_dict()
    for name in FROZEN:
        assert torch.equal(out["frozen"]["final"][name], start[name])


# ---- gradient accumulation ----------------------------------------------------------
@pytest.mark.cluster
def test_no_sync_accumulation_equals_the_large_batch(ranks):
    out = ranks[0]
    ref_trace, ref_final = same_order_reference(2, k=2)
    for step, ref in enumerate(ref_trace):
        assert _equal(out["accum"]["trace"][step]["grads"], ref)
    assert _equal(out["accum"]["final"], ref_final)
    # the same global batch in one backward per rank: equal to rounding
    for name, p in out["dp2_one"]["final"].items():
        torch.testing.assert_close(ref_final[name], p, rtol=0, atol=1e-4)
    # only the last microbatch communicated: one all-reduce per bucket and step
    calls = telemetry.comm_events(out["accum_events"], tag="ddp")
    assert [sum(e["step"] == s for e in calls) for s in range(STEPS)] == [2] * STEPS
    spans = [e for e in out["accum_events"] if e["kind"] == "span" and e["name"] == "B"]
    assert sorted(e["microbatch"] for e in spans if e["step"] == 0) == [0, 1]


@pytest.mark.cluster
def test_finish_gradient_synchronization_is_idempotent(ranks):
    out = ranks[0]
    assert out["finish_no_extra_comm"] and out["finish_kept_grads"]
    assert out["no_sync_calls"] == 0  # no_sync really sends nothing
    assert out["finish_after_no_sync"]  # ... and finish() averages what it left
    assert out["finish_calls"] == 2  # the two buckets, once
    assert out["direct_calls"] == 0  # hooks act only after the wrapper's forward


# ---- unused parameters -------------------------------------------------------------
@pytest.mark.cluster
def test_unused_parameters_error_or_option(ranks):
    for out in ranks[:2]:
        err = out["unused_error"]
        assert err and "extra.weight" in err and "find_unused_parameters=True" in err
        ours, theirs = out["find_unused"]["dtlab"], out["find_unused"]["torch"]
        assert ours[0]["extra.weight"] is None  # no rank used it: left alone
        assert ours[1]["extra.weight"] is not None  # one rank used it: averaged
        for a, b in zip(ours, theirs):  # same as PyTorch, bit for bit
            assert a.keys() == b.keys()
            for k in a:
                assert (a[k] is None) == (b[k] is None), k
                assert a[k] is None or torch.equal(a[k], b[k]), k


# ---- telemetry: bytes and overlap --------------------------------------------------
@pytest.mark.cluster
def test_wire_bytes_per_step_equal_the_formula(ranks):
    psi = CFG.n_params()
    for out in ranks[:2]:
        for name in CAPS:
            events = out[f"dp2_{name}_events"]
            n_buckets = len(out[f"dp2_{name}_buckets"])
            for step in range(STEPS):
                calls = [e for e in telemetry.comm_events(events, tag="ddp")
                         if e["step"] == step]  # fmt: skip
                assert len(calls) == n_buckets
                assert sum(e["payload_bytes"] for e in calls) == psi * 4
                sent = sum(e["wire_bytes"] for e in calls)
                assert sent == pytest.approx(estimate.ddp_bytes_per_step(psi, 2))
            assert out[f"dp2_{name}_last_sync"]["wire_bytes"] == pytest.approx(
                2 * (2 - 1) / 2 * psi * 4
            )


@pytest.mark.cluster
def test_bucket_all_reduces_start_while_backward_still_runs(ranks):
    for out in ranks[:2]:
        events = out["dp2_many_events"]
        for step in range(STEPS):
            (b_span,) = [e for e in events if e["kind"] == "span"
                         and e["name"] == "B" and e["step"] == step]  # fmt: skip
            buckets = sorted(
                (e for e in events if e["kind"] == "ddp_bucket" and e["step"] == step),
                key=lambda e: e["bucket"],
            )
            assert [e["bucket"] for e in buckets] == list(range(len(buckets)))
            # the first bucket goes out while backward is still computing ...
            assert buckets[0]["t_start"] < b_span["t_end"]
            # ... and the buckets are launched in order, each before backward ends
            launches = [e["t_start"] for e in buckets]
            assert launches == sorted(launches) and launches[-1] <= b_span["t_end"]
            comm = [e for e in telemetry.comm_events(events, tag="ddp")
                    if e["step"] == step]  # fmt: skip
            assert min(e["t_start"] for e in comm) < b_span["t_end"]


# ---- single-process checks ----------------------------------------------------------
def test_buckets_follow_pytorchs_rule_in_reverse_registration_order():
    params = list(GPT(CFG).named_parameters())  # the tied head appears once
    reverse = [n for n, _ in params][::-1]
    size = {n: p.numel() * 4 for n, p in params}
    for cap_mb in (25.0, 0.2, 0.1, 0.01, 1e-6):
        ddp = DistributedDataParallel(GPT(CFG), bucket_cap_mb=cap_mb)
        names = ddp.bucket_names()
        assert [n for b in names for n in b] == reverse
        cap = cap_mb * 1024 * 1024
        for i, bucket in enumerate(names):  # closed as soon as it reached the cap
            total = sum(size[n] for n in bucket)
            assert total - size[bucket[-1]] < cap
            assert total >= cap or i == len(names) - 1
        sizes = [size[n] for n in reverse]
        assert [len(b) for b in names] == [
            len(b) for b in estimate.ddp_bucket_assignment(sizes, cap)
        ]
    assert len(DistributedDataParallel(GPT(CFG), 25).buckets) == 1
    assert len(DistributedDataParallel(GPT(CFG), 1e-6).buckets) == len(params)


def test_one_rank_ddp_is_the_module_itself():
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, B)
    ref, model = GPT(CFG), GPT(CFG)
    ref(x, y)[1].backward()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1)
    ddp(x, y)[1].backward()
    ddp.finish_gradient_synchronization()
    pairs = zip(model.parameters(), ref.parameters())
    assert all(torch.equal(p.grad, q.grad) for p, q in pairs)


@pytest.mark.parametrize("cap", [0, -1.0, "25", True])
def test_bad_bucket_cap_is_a_clear_error(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb=cap)


def test_naive_data_parallel_reduces_onto_the_primary():
    x, y = SyntheticTokens(CFG.vocab_size, CFG.seq_len).batch(0, B)
    ref = GPT(CFG)
    ref(x, y)[1].backward()
    for threads in (True, False):
        model = GPT(CFG)
        dp = DataParallel(model, n_devices=4, threads=threads)
        logits, losses = dp(x, y)
        assert logits.shape == (B, CFG.seq_len, CFG.vocab_size)
        assert losses.shape == (4,)  # one mean per replica, as nn.DataParallel does
        losses.mean().backward()
        # shard gradients summed onto the primary: the full-batch gradient up to
        # the order of the sums (4 shard backward passes vs one over the batch)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        report = dp.memory_report()
        primary, other = report[0], report[1]
        assert primary["grads"] == model.n_params() * 4 and other["grads"] == 0
        assert primary["params"] == other["params"] == model.n_params() * 4
        assert primary["outputs"] == 4 * other["outputs"]  # the gathered batch
        assert set(dp.last_forward["times"]) == {
            "replicate", "scatter", "parallel_apply", "gather",
        }  # fmt: skip
    # (no bit-for-bit check between the two: with threads, the replicas' autograd
    # nodes are created in an interleaved order, and that order decides in which
    # order their gradients are added onto the primary, as in nn.DataParallel)
    with pytest.raises(ValueError, match="at least n_devices"):
        DataParallel(GPT(CFG), n_devices=4)(x[:2], y[:2])
    with pytest.raises(ValueError, match="n_devices"):
        DataParallel(GPT(CFG), n_devices=0)


def test_ddp_formulas_by_hand():
    psi = 1_000_000
    # 2(N-1)/N · Ψ · bytes: N=2 sends the gradients once, N=4 1.5 times, -> 2Ψ
    assert estimate.ddp_bytes_per_step(psi, 2) == 4 * psi
    assert estimate.ddp_bytes_per_step(psi, 4, bytes_per_grad=2) == 1.5 * 2 * psi
    assert estimate.ddp_bytes_per_step(psi, 1024, 2) == pytest.approx(4 * psi, 1e-3)
    assert estimate.ddp_bucket_assignment([5, 5, 5, 20, 1], 10) == [[0, 1], [2, 3], [4]]
    assert estimate.ddp_bucket_assignment([50, 1], 10) == [[0], [1]]
    # two 100-byte buckets, 2 ranks: each all-reduce takes 2 steps x 0.1 s + 100 B at
    # 100 B/s = 1.2 s; ready at 0.5 s and 1.0 s of a 1 s backward
    two = estimate.ddp_overlap([100, 100], 2, 1.0, 0.1, 100.0)
    assert two["ready"] == [0.5, 1.0] and two["start"] == [0.5, 1.7]
    assert two["end"] == pytest.approx([1.7, 2.9])
    assert two["exposed_s"] == pytest.approx(1.9)
    assert two["overlap"] == pytest.approx(1 - 1.9 / 2.4)
    one = estimate.ddp_overlap([200], 2, 1.0, 0.1, 100.0)  # starts after backward
    assert one["exposed_s"] == pytest.approx(2.2) and one["overlap"] == 0.0
    with pytest.raises(ValueError, match="cap_bytes"):
        estimate.ddp_bucket_assignment([1], 0)
    with pytest.raises(ValueError, match="backward_s"):
        estimate.ddp_overlap([1], 2, -1.0, 0.0, 1.0)

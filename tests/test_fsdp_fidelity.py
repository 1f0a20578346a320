"""dtlab's FullyShardedDataParallel against one process, bit for bit: the comparison
Stanford CS336's FSDP assignment makes (an fp32 model sharded over gloo ranks, each
rank training on its contiguous slice of the global batch, against a copy trained
in one process, ``torch.equal`` after several optimizer steps), on CS336's toy
model, dtlab's TinyMLP and a small GPT; where it cannot be exact, the one operation
that rounds differently and its bound. Also: parameters kept whole (``replicate``),
and an all-gather whose ranks disagree on sizes failing at once instead of hanging.

**Which one process.** Equality needs the reference to add the same floats in the
same order. The whole batch in one backward does not: its matmuls sum the rows'
terms of each weight gradient in one order, N ranks sum them as N groups added
afterwards (see tests/test_zero.py::test_fp32_zero_is_bit_exact_where_the_order_of_
sums_allows, which bounds that difference). The reference here computes each
rank's gradient on that rank's rows, divides it by N and adds the N of them: at
N = 2 the sum ``a/2 + b/2`` has one order, so FSDP must match it exactly, step after
step. At N = 4 gloo adds four terms in an order that depends on where an element
sits in the buffer it reduces (its ring chunk): DDP's buckets and FSDP's units lay
elements out differently, so no fixed-order reference (and not DDP) can be equal;
:func:`test_four_ranks_differ_only_by_the_order_gloo_adds_in` bounds it.

Runs on one 4-engine cluster; the 2-rank cases use a group of ranks 0 and 1."""

import pytest
import torch

pytestmark = pytest.mark.cluster

STEPS = 4
GLOBAL_BATCH = 16


# ---- models, data, optimizers (built the same on the engines and here) ----------
def _build(kind: str):
    """CS336's toy model (Linear without bias, LayerNorm, Linear), dtlab's TinyMLP,
    or a small GPT; the same weights wherever it is built."""
    from torch import nn

    from dtlab.model import GPT, GPTConfig, TinyMLP

    if kind == "mlp":
        return TinyMLP()
    if kind == "gpt":
        cfg = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, n_heads=2, d_model=16)
        return GPT(cfg)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(10, 10, bias=False)
            self.ln = nn.LayerNorm(10)
            self.fc2 = nn.Linear(10, 5, bias=False)
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in (self.fc1.weight, self.fc2.weight):
                    p.copy_(torch.randn(p.shape, generator=gen) / 3)

        def forward(self, x):  # (B, 10) -> (B, 5)
            return self.fc2(self.ln(self.fc1(x)))

    return Toy()


def _batch(kind: str, step: int):
    from dtlab.model import SyntheticTokens, regression_batch

    if kind == "mlp":
        return regression_batch(step, GLOBAL_BATCH)
    if kind == "gpt":
        return SyntheticTokens(32, 8).batch(step, GLOBAL_BATCH)
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, 10, generator=gen)
    return x, torch.randn(GLOBAL_BATCH, 5, generator=gen)


def _loss(kind: str, model, x, y):
    if kind == "gpt":
        return model(x, y)[1]
    return torch.nn.functional.mse_loss(model(x), y)


def _optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    how = {"adamw": {}, "adamw_foreach": {"foreach": True}}
    how["adamw_fused"] = {"fused": True}
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **how[name])


def _not_a_matrix(name, p):  # what CS336 keeps whole under FSDP: norms, biases
    return p.dim() < 2


# ---- on the engines ------------------------------------------------------------
def _group(n):
    """Ranks 0..n-1 as a group (every rank calls it); None outside it."""
    import torch.distributed as dist

    if n == dist.get_world_size():
        return dist.group.WORLD
    g = dist.new_group(list(range(n)))
    return g if dist.get_rank() < n else None


def _train(n, kind, opt_name, wrappers=("fsdp", "fsdp_replicated", "ddp")):
    """Each wrapper trains ``kind`` for STEPS steps on this rank's slice; the whole
    weights after every step, and the flat layout (where the pieces are cut)."""
    from dtlab import comm
    from dtlab.ddp import DistributedDataParallel
    from dtlab.model import shard_batch
    from dtlab.zero import FullyShardedDataParallel

    g = _group(n)
    if g is None:
        return None
    r = comm.group_rank(g)
    out = {}
    for wrapper in wrappers:
        net = _build(kind)
        if wrapper == "ddp":
            model = DistributedDataParallel(net, process_group=g)
        else:
            stage = int(wrapper[-1]) if wrapper[-1].isdigit() else 3
            rep = _not_a_matrix if wrapper == "fsdp_replicated" else None
            model = FullyShardedDataParallel(net, None, g, stage=stage, replicate=rep)
        opt = _optimizer(opt_name, model.parameters())
        steps = []
        for step in range(STEPS):
            x, y = shard_batch(*_batch(kind, step), r, n)
            _loss(kind, model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if wrapper == "ddp":
                steps.append({k: p.detach().clone() for k, p in net.named_parameters()})
            else:
                steps.append(model.gather_full_params())
        out[wrapper] = {"steps": steps}
        if wrapper != "ddp":
            out[wrapper]["units"] = model.units
    return out


# ---- in this process -----------------------------------------------------------
def _reference(n, kind, opt_name, cuts=None):
    """One process: each rank's gradient on its own rows, divided by n, added in
    rank order; the optimizer steps whole parameters, or (``cuts``: name -> the
    [start, stop) pieces of the flattened parameter) the pieces FSDP steps."""
    from dtlab.model import shard_batch

    net = _build(kind)
    params = dict(net.named_parameters())
    pieces = {}  # name -> [(start, stop, leaf tensor the optimizer steps)]
    for name, p in params.items():
        spans = (cuts or {}).get(name, [(0, p.numel())])
        pieces[name] = [
            (a, b, p.detach().view(-1)[a:b].clone().requires_grad_()) for a, b in spans
        ]
    opt = _optimizer(opt_name, [t for ps in pieces.values() for _, _, t in ps])
    steps = []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        total = {}
        for r in range(n):
            net.zero_grad(set_to_none=True)
            _loss(kind, net, *shard_batch(x, y, r, n)).backward()
            for name, p in params.items():
                g = p.grad / n
                total[name] = g if r == 0 else total[name] + g
        for name, ps in pieces.items():
            for a, b, t in ps:
                t.grad = total[name].reshape(-1)[a:b].clone()
        opt.step()
        with torch.no_grad():
            for name, ps in pieces.items():
                for a, b, t in ps:
                    params[name].view(-1)[a:b] = t
        steps.append({k: p.detach().clone() for k, p in params.items()})
    return steps


def _cuts(units, n) -> dict:
    """name -> the [start, stop) pieces of each parameter over n ranks' slices."""
    out = {}
    for u in units:
        S = u["padded"] // n
        for name, shape, off in u["params"]:
            numel = torch.Size(shape).numel()
            inner = {k * S - off for k in range(1, n)} if not u["replicated"] else set()
            ends = sorted({0, numel} | {e for e in inner if 0 < e < numel})
            out[name] = list(zip(ends, ends[1:]))
    return out


def _assert_equal(a: dict, b: dict, what):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (what, k, (a[k] - b[k]).abs().max().item())


@pytest.fixture(scope="module")
def cluster(lab_cluster):
    return lab_cluster(4)


# ---- N = 2: equal, step after step ---------------------------------------------
@pytest.mark.parametrize("kind", ["toy", "mlp", "gpt"])
@pytest.mark.parametrize("opt_name", ["sgd", "sgd_momentum", "adamw", "adamw_foreach"])
def test_fsdp_equals_one_process_bit_for_bit(cluster, kind, opt_name):
    runs = cluster.run(_train, 2, kind, opt_name, timeout=180)[0]
    reference = _reference(2, kind, opt_name)
    # the optimizer over per-parameter pieces (1-D views of the flat master slice)
    # computes what it computes on the whole parameter: element-wise, and the
    # for-loop and foreach kernels round their vector body and tail alike
    for wrapper, run in runs.items():
        for step in range(STEPS):
            _assert_equal(run["steps"][step], reference[step], (wrapper, step))


def test_fused_adamw_is_the_one_operation_a_piece_changes(cluster):
    # PyTorch's fused CPU AdamW steps a tensor in vectors of V elements and its
    # last numel % V elements one by one, and the two paths round differently (the
    # vector body contracts multiplies and adds the scalar tail rounds apart). An
    # element's bits thus depend on where the tensor it is stepped in ends: DDP
    # steps whole parameters, FSDP pieces of them, so only FSDP moves elements
    # between the paths. The same pieces stepped in one process give FSDP's bits.
    wrappers = ("fsdp", "ddp")
    runs = cluster.run(_train, 2, "toy", "adamw_fused", wrappers, timeout=120)[0]
    cuts = _cuts(runs["fsdp"]["units"], 2)
    by_pieces = _reference(2, "toy", "adamw_fused", cuts)
    whole = _reference(2, "toy", "adamw_fused")
    for step in range(STEPS):
        _assert_equal(runs["fsdp"]["steps"][step], by_pieces[step], step)
        _assert_equal(runs["ddp"]["steps"][step], whole[step], step)
    V = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability())
    if V is None:
        return  # the vector width of this CPU's kernels is not known here
    # and where pieces and whole differ, the element changed path: element-wise
    # math, so an element stepped the same way every step has the same bits
    for name, spans in cuts.items():
        numel = whole[-1][name].numel()
        in_tail = torch.zeros(numel, dtype=torch.bool)
        in_tail[numel - numel % V :] = True
        in_piece_tail = torch.zeros(numel, dtype=torch.bool)
        for a, b in spans:
            in_piece_tail[b - (b - a) % V : b] = True
        moved = in_tail ^ in_piece_tail
        differs = whole[-1][name].view(-1) != by_pieces[-1][name].view(-1)
        assert not (differs & ~moved).any(), name


# ---- N = 4: the order gloo adds in ----------------------------------------------
@pytest.mark.parametrize("kind", ["toy", "gpt"])
def test_four_ranks_differ_only_by_the_order_gloo_adds_in(cluster, kind):
    # One SGD step, so that the difference has one source. Each rank's gradient
    # q_r = g_r/4 has the same bits here as on its rank (its own rows, one power-of-
    # two division); gloo adds the four in an order fixed per ring chunk, the
    # reference as ((q0 + q1) + q2) + q3. Any order of 3 additions lies within
    # γ_3·Σ|q_r| of the exact sum (Higham, Accuracy and Stability, §4.2), so
    # |Δg| ≤ 2·γ_3·Σ|q_r|; w − lr·g rounds lr·g and the difference once each side:
    # |Δw| ≤ lr·|Δg| + u·lr·(|g| + |g'|) + u·(|w| + |w'|).
    from dtlab.model import shard_batch

    runs = cluster.run(_train, 4, kind, "sgd", ("fsdp", "ddp"), timeout=180)[0]
    u = 2.0**-24
    gamma3 = 3 * u / (1 - 3 * u)
    lr = 0.1
    net = _build(kind)
    w0 = {k: p.detach().double().clone() for k, p in net.named_parameters()}
    magnitude = {k: torch.zeros_like(w) for k, w in w0.items()}
    summed = {k: torch.zeros_like(w) for k, w in w0.items()}
    x, y = _batch(kind, 0)
    for r in range(4):
        net.zero_grad(set_to_none=True)
        _loss(kind, net, *shard_batch(x, y, r, 4)).backward()
        for k, p in net.named_parameters():
            magnitude[k] += (p.grad / 4).double().abs()
            summed[k] += (p.grad / 4).double()
    reference = _reference(4, kind, "sgd")[0]
    for wrapper in ("fsdp", "ddp"):
        ours = runs[wrapper]["steps"][0]
        for k, w_ref in reference.items():
            a, b = ours[k].double(), w_ref.double()
            g_a, g_b = (w0[k] - a) / lr, (w0[k] - b) / lr  # the steps taken
            bound = lr * 2 * gamma3 * magnitude[k]
            bound += u * lr * (g_a.abs() + g_b.abs()) + u * (a.abs() + b.abs())
            assert ((a - b).abs() <= bound).all(), (wrapper, k)
    for k, g in summed.items():  # no blanket: a gradient 1e-5 off breaks the sum's
        assert (1e-5 * g.abs() > 2 * gamma3 * magnitude[k]).any(), k  # part


# ---- parameters kept whole ----------------------------------------------------
def _replicated_view():
    """After one backward at stage 3 with norms and biases replicated: what the
    module shows, and a CS336-style all-gather of each replicated gradient."""
    from torch import nn

    from dtlab import comm
    from dtlab.model import shard_batch
    from dtlab.zero import FullyShardedDataParallel

    g = _group(2)
    if g is None:
        return None
    r = comm.group_rank(g)
    model = FullyShardedDataParallel(_build("gpt"), None, g, replicate=_not_a_matrix)
    x, y = shard_batch(*_batch("gpt", 0), r, 2)
    model(x, y)[1].backward()
    shown, same = {}, {}
    whole = dict(_build("gpt").named_parameters())
    for name, p in model.module.named_parameters():  # after backward: the shards
        shown[name] = (tuple(p.shape), tuple(p.grad.shape))
        if whole[name].dim() < 2:  # kept whole: the same gradient on both ranks
            every = torch.empty(2 * p.grad.numel())
            comm.all_gather(every, p.grad.reshape(-1).contiguous(), group=g)
            same[name] = torch.equal(every[: p.numel()], every[p.numel() :])
    units = model.units
    norm = model.clip_grad_norm_()
    plain = FullyShardedDataParallel(_build("gpt"), None, g)
    plain(x, y)[1].backward()
    msgs = {}
    try:
        FullyShardedDataParallel(_build("toy"), None, g, replicate="norms")
    except ValueError as exc:
        msgs["bad"] = str(exc)
    kinds = FullyShardedDataParallel(_build("toy"), None, g, replicate=nn.LayerNorm)
    return {
        "shown": shown,
        "same": same,
        "units": units,
        "norm": norm,
        "plain_norm": plain.clip_grad_norm_(),
        "by_class": [(u["name"], u["replicated"]) for u in kinds.units],
        "msgs": msgs,
    }


def test_replicated_parameters_live_as_under_ddp(cluster):
    out = cluster.run(_replicated_view, timeout=120)[0]
    params = dict(_build("gpt").named_parameters())
    for name, (shape, grad_shape) in out["shown"].items():
        full = tuple(params[name].shape)
        if params[name].dim() < 2:  # whole, in its shape, the same on both ranks
            assert shape == grad_shape == full, name
            assert out["same"][name], name
        else:  # a 1-D piece of this rank's slice
            assert len(shape) == 1 and grad_shape == shape, name
    # each unit's norms and biases moved into a replicated unit beside it
    names = [u["name"] for u in out["units"]]
    assert "root" in names and "root(replicated)" in names
    assert "blocks.0(replicated)" in names
    for u in out["units"]:
        shapes = [len(shape) for _, shape, _ in u["params"]]
        assert u["replicated"] == all(d < 2 for d in shapes), u["name"]
        if u["replicated"]:
            assert (u["lo"], u["S"]) == (0, u["padded"])
    # the global norm counts a replicated gradient once, not once per rank
    assert out["norm"].item() == pytest.approx(out["plain_norm"].item(), rel=1e-6)
    assert "replicate must be None" in out["msgs"]["bad"]
    assert out["by_class"] == [("root", False), ("root(replicated)", True)]


# ---- sizes that differ across ranks fail at once --------------------------------
def _mismatched_gathers():
    """User code gathering tensors of different sizes on the two ranks: a plain
    all_gather, the local piece of a sharded parameter's gradient (the toy's
    fc1.weight, 100 elements, cut 85 + 15 by the 2 ranks' slices of 170), and
    gather_slices given such a piece (85 elements is a whole slice on rank 0)."""
    from dtlab import comm
    from dtlab.model import shard_batch
    from dtlab.zero import FullyShardedDataParallel

    g = _group(2)
    if g is None:
        return None
    r = comm.group_rank(g)
    msgs = {}
    mine = torch.ones(10 if r == 0 else 4)
    try:
        comm.all_gather(torch.empty(2 * mine.numel()), mine, group=g)
    except ValueError as exc:
        msgs["plain"] = str(exc)
    model = FullyShardedDataParallel(_build("toy"), None, g)
    x, y = shard_batch(*_batch("toy", 0), r, 2)
    _loss("toy", model, x, y).backward()
    piece = model.module.fc1.weight.grad  # 85 elements on rank 0, 15 on rank 1
    msgs["sizes"] = [s.stop - s.start for s in model.local_shards()][:1]
    try:
        comm.all_gather(torch.empty(2 * piece.numel()), piece, group=g)
    except ValueError as exc:
        msgs["piece"] = str(exc)
    try:
        model.gather_slices(piece)
    except ValueError as exc:
        msgs["slices"] = str(exc)
    # the group still works: the check raised before any gather started
    ok = torch.full((1,), float(r))
    every = torch.empty(2)
    comm.all_gather(every, ok, group=g)
    msgs["after"] = every.tolist()
    return msgs


def test_an_all_gather_of_unequal_sizes_fails_naming_them(cluster):
    # gloo does not compare sizes: the rank that sent less waits forever for the
    # rest, the one that sent more aborts its process. dtlab.comm checks first.
    per_rank = cluster.run(_mismatched_gathers, timeout=60)[:2]
    for msgs in per_rank:
        assert "rank 0: 10, rank 1: 4 elements" in msgs["plain"]
        assert "different sizes" in msgs["piece"]
        assert "rank 0: 85, rank 1: 15 elements" in msgs["slices"]
        assert msgs["after"] == [0.0, 1.0]
    assert per_rank[0]["sizes"] + per_rank[1]["sizes"] == [85, 15]
    assert "rank 0: 85, rank 1: 15 elements" in per_rank[0]["piece"]


def _checkpoint_of_a_replicated_model(path):
    import torch
    from torch import nn

    from dtlab import checkpoint
    from dtlab.zero import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), replicate=(nn.LayerNorm,)
    )
    try:
        checkpoint.save_sharded(path, model)
    except NotImplementedError as e:
        return str(e)
    return None


def test_a_sharded_checkpoint_refuses_replicated_units(cluster, tmp_path):
    said = cluster.run(
        _checkpoint_of_a_replicated_model, str(tmp_path / "ckpt"), timeout=60
    )
    assert all(s and "replicated" in s for s in said), said

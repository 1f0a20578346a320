"""One gradient-sync interface (:mod:`dtlab.gradsync`): every layout's parts answer
it, the trainer and its neighbours ask it without asking which wrapper they hold,
the one coalesced all-reduce gives exactly what one all-reduce per tensor gives,
and ZeRO's explicit finish reduces what ``no_sync`` accumulated, as DDP's does.

The parity of every layout with the single-process reference lives in
tests/test_parallelize.py and tests/test_train.py; these tests pin the interface.
"""

import ast
import pathlib

import pytest
import torch

from dtlab.model import GPTConfig
from dtlab.topology import Layout
from dtlab.train import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = GPTConfig(n_layers=2, d_model=16, n_heads=2, vocab_size=32, seq_len=8)


def _kinds():
    """On every rank: which GradSync each layout builds, and whether it is one."""
    from dtlab.gradsync import GradSync
    from dtlab.parallelize import parallelize
    from dtlab.topology import Topology

    out = {}
    for name, layout, strategy in (
        ("ddp", Layout(dp=2), "ddp"),
        ("zero1", Layout(dp=2), "zero1"),
        ("zero3", Layout(dp=2), "zero3"),
        ("pipe-ddp", Layout(pp=2), "ddp"),
        ("pipe-zero1", Layout(pp=2), "zero1"),
        ("tp-ddp", Layout(tp=2), "ddp"),
    ):
        config = TrainConfig(model=CFG, layout=layout, strategy=strategy, steps=1)
        parts = parallelize(config, Topology(layout), torch.device("cpu"))
        sync = parts.sync
        out[name] = (type(sync).__name__, isinstance(sync, GradSync))
    return out


def test_every_layout_builds_one_grad_sync(lab_cluster):
    for kinds in lab_cluster(2).run(_kinds):
        assert all(ok for _, ok in kinds.values()), kinds
        assert {n: k for n, (k, _) in kinds.items()} == {
            "ddp": "Replicated",
            "zero1": "Sharded",
            "zero3": "Sharded",
            "pipe-ddp": "Replicated",
            "pipe-zero1": "Sharded",
            "tp-ddp": "Replicated",
        }


def _flat_vs_each():
    """One flat all-reduce against one all-reduce per tensor, on odd shapes."""
    from dtlab import comm, telemetry
    from dtlab.gradsync import all_reduce_flat

    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(rank)
    shapes = [(3, 5), (7,), (2, 2, 3), (1,)]
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    each = [t.clone() for t in tensors]
    for t in each:
        comm.all_reduce(t)
        t /= 2
    rec = telemetry.Recorder(rank)
    with telemetry.use(rec):
        all_reduce_flat(tensors, None, tag="test/flat", divide_by=2)
    ops = [(e["op"], e["numel"]) for e in rec.events if e.get("tag") == "test/flat"]
    return all(torch.equal(a, b) for a, b in zip(tensors, each)), ops


def test_one_flat_all_reduce_equals_one_per_tensor(lab_cluster):
    for equal, ops in lab_cluster(2).run(_flat_vs_each):
        assert equal  # elementwise sums of the same two numbers, the same division
        assert ops == [("all_reduce", 15 + 7 + 12 + 1)]  # one collective


def test_all_reduce_flat_alone_divides_and_sends_nothing():
    from dtlab.gradsync import all_reduce_flat
    from dtlab.topology import Axis

    one = Axis("dp", ranks=(0,), index=0)
    t = torch.tensor([2.0, 4.0])
    all_reduce_flat([t], one, tag="x", divide_by=2)
    assert t.tolist() == [1.0, 2.0]
    all_reduce_flat([], one, tag="x", divide_by=2)  # nothing to do


def _zero_finish_after_no_sync(stage):
    """ZeRO-1 (or 0) over 2 ranks: two microbatches under no_sync, then an explicit
    finish, against the second microbatch's backward run outside no_sync."""
    from dtlab.zero import FullyShardedDataParallel

    rank = torch.distributed.get_rank()
    grads = []
    for explicit in (True, False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
        model = FullyShardedDataParallel(net, stage=stage)
        xs = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(rank))
        with model.no_sync():
            model(xs[0]).sum().backward()
            if explicit:
                model(xs[1]).sum().backward()
        if explicit:
            model.finish_gradient_synchronization()
            model.finish_gradient_synchronization()  # idempotent
        else:
            model(xs[1]).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_finish_reduces_what_no_sync_accumulated(lab_cluster, stage):
    assert all(lab_cluster(2).run(_zero_finish_after_no_sync, stage))


# the trainer and its neighbours never ask which wrapper they hold
ASKING = ("train.py", "parallelize.py", "global_norm.py", "checkpoint.py")
# attributes that parameters and submodules carry by design (not wrappers)
PARAMETER_TAGS = {"tensor_parallel_dim", "expert_parallel", "sequence_parallel", "rng"}


@pytest.mark.parametrize("name", ASKING)
def test_no_duck_typing_on_wrappers(name):
    tree = ast.parse((ROOT / "dtlab" / name).read_text())
    asked = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr":
                asked.append((node.lineno, "hasattr"))
            if node.func.id == "getattr":
                attr = node.args[1]
                if not (
                    isinstance(attr, ast.Constant) and attr.value in PARAMETER_TAGS
                ):
                    asked.append((node.lineno, ast.unparse(node)))
    assert not asked, f"dtlab/{name} asks objects what they are: {asked}"

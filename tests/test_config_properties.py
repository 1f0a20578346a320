"""Bad input is rejected before any process starts, with a message saying what to
change; good input always passes.

Property-based (hypothesis) over :class:`dtlab.topology.Layout` and
:class:`dtlab.train.TrainConfig`: model shapes, dp/tp/pp, microbatches, chunks,
schedules, precision, activation checkpointing, batch sizes and world sizes. Whether
a combination can run is decided by :func:`_violations`, an oracle written here from
the rules of the techniques (heads split over tp, layers over pp and chunks, the
batch over dp, microbatches over a flush, ...), never by calling the code under test.
Also the lab's entry points: ``LabCluster(world_size=...)``, ``start()`` and
``cluster.train(config)`` reject bad requests before any engine runs.

No cluster is started here; every example is milliseconds.
"""

import re

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtlab.launch import max_cpu_world_size
from dtlab.model import GPTConfig
from dtlab.topology import Layout
from dtlab.train import TrainConfig

FAST = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

DP_FLAVOURS = ("ddp", "zero1", "zero2", "zero3")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")
PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINTING = ("none", "selective", "full")
# a message must say what to change, not only what is wrong
ADVICE = re.compile(
    r"\b(use|make|pick|leave|set|choose|one of|must be|needs|multiple of)\b"
)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# ---- the oracle ----------------------------------------------------------------------
def _violations(c: dict, world_size: int) -> list[tuple[str, ...]]:
    """Every rule the run ``c`` breaks on ``world_size`` ranks; each as the words
    one of which its error message must contain. Empty: the run is possible."""
    out = []
    m = c["model"]
    # field values that make no sense on any world
    if c["strategy"] not in DP_FLAVOURS:
        out.append(("strategy",))
    for name in ("global_batch_size", "grad_accum_steps", "chunks"):
        if not _positive_int(c[name]):
            out.append((name,))
    if c["microbatches"] is not None and not _positive_int(c["microbatches"]):
        out.append(("microbatches",))
    if c["schedule"] not in SCHEDULES:
        out.append(("schedule",))
    if c["precision"] not in PRECISIONS:
        out.append(("precision",))
    if c["activation_checkpointing"] not in CHECKPOINTING:
        out.append(("activation_checkpointing",))
    if c["layout"] is not None and not all(_positive_int(v) for v in c["layout"]):
        out.append(("dp", "tp", "pp"))
    if out:
        return out  # the rest needs sane fields
    dp, tp, pp = c["layout"] if c["layout"] is not None else (world_size, 1, 1)
    chunks, ga, gbs = c["chunks"], c["grad_accum_steps"], c["global_batch_size"]
    if dp * tp * pp != world_size:
        out.append(("world",))
    # tensor parallelism gives each rank whole heads
    if m["n_heads"] % tp:
        out.append(("n_heads", "tp="))
    # a pipeline stage (or virtual stage) holds whole layers, the same number each
    if m["n_layers"] % (pp * chunks):
        out.append(("n_layers", "chunks"))
    # the global batch splits into dp ranks x accumulation microbatches
    if gbs % (dp * ga):
        out.append(("global_batch_size",))
    if pp == 1:
        # pipeline options on a layout without a pipeline are a mistake
        if c["microbatches"] is not None:
            out.append(("microbatches",))
        if chunks != 1:
            out.append(("chunks",))
    else:
        micro = c["microbatches"] or pp
        if c["schedule"] != "gpipe" and micro < pp:  # the pipe never fills
            out.append(("microbatches",))
        per_flush = gbs // (dp * ga)  # sequences per dp rank and pipeline flush
        if gbs % (dp * ga) == 0 and per_flush % micro:
            out.append(("microbatches", "global_batch_size"))
        if chunks > 1 and c["schedule"] != "interleaved":
            out.append(("chunks", "interleaved"))
        if c["schedule"] == "interleaved" and chunks > 1 and micro % pp:
            out.append(("microbatches", "interleaved"))
        zero = c["strategy"].startswith("zero")
        if zero and c["schedule"] == "zb_h1":
            # zero-bubble splits backward in two; ZeRO reduce-scatters at its end
            out.append(("zb_h1",))
    if c["sequence_parallel"] and (tp == 1 or m["seq_len"] % tp):
        out.append(("sequence_parallel", "seq_len", "sequence parallelism"))
    if c["offload"] and not c["strategy"].startswith("zero"):
        out.append(("offload",))
    return out


# ---- what hypothesis draws -----------------------------------------------------------
@st.composite
def models(draw):
    heads = draw(st.integers(1, 8))
    return dict(
        vocab_size=draw(st.integers(8, 64)),
        seq_len=draw(st.integers(1, 16)),
        n_layers=draw(st.integers(1, 8)),
        n_heads=heads,
        d_model=heads * draw(st.sampled_from([2, 4, 8])),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.1])),
    )


small = st.integers(1, 4)
BAD = {  # a wrong value per field, for the field-level rules
    "strategy": st.sampled_from(["tp", "pp", "fsdp"]),
    "global_batch_size": st.sampled_from([0, -4, True, 8.0]),
    "grad_accum_steps": st.sampled_from([0, -1, False, "2"]),
    "microbatches": st.sampled_from([0, -2, 2.5]),
    "chunks": st.sampled_from([0, True, "1"]),
    "schedule": st.sampled_from(["zigzag", "1F1B ", ""]),
    "precision": st.sampled_from(["fp8", "float32", "tf32"]),
    "activation_checkpointing": st.sampled_from(["some", "all", None]),
    "layout": st.sampled_from([(0, 1, 1), (2, -1, 1), (1, 1, True), (2.0, 1, 1)]),
}


@st.composite
def configs(draw):
    """(config fields, world size): half the time a valid run with one thing
    changed (the near misses a learner makes), half the time sensible values in
    random combinations (most of which do not fit together); and now and then one
    field whose value is wrong on any world."""
    if draw(st.booleans()):
        return draw(near_misses())
    layout = draw(st.one_of(st.none(), st.tuples(small, small, small)))
    c = dict(
        model=draw(models()),
        layout=layout,
        strategy=draw(st.sampled_from(DP_FLAVOURS)),
        global_batch_size=draw(st.integers(1, 48)),
        grad_accum_steps=draw(small),
        microbatches=draw(st.one_of(st.none(), st.integers(1, 8))),
        chunks=draw(st.integers(1, 3)),
        schedule=draw(st.sampled_from(SCHEDULES)),
        precision=draw(st.sampled_from(PRECISIONS)),
        activation_checkpointing=draw(st.sampled_from(CHECKPOINTING)),
        sequence_parallel=draw(st.booleans()),
        offload=draw(st.booleans()),
    )
    if draw(st.integers(0, 3)) == 0:
        field = draw(st.sampled_from(sorted(BAD)))
        c[field] = draw(BAD[field])
    fits = c["layout"] is not None and all(_positive_int(v) for v in c["layout"])
    if fits and draw(st.integers(0, 3)):
        world = c["layout"][0] * c["layout"][1] * c["layout"][2]  # usually fits
    else:
        world = draw(st.integers(1, 16))
    if not fits and c["layout"] is None and draw(st.booleans()):
        # data parallel over the world: pipeline options are the usual slip
        c["microbatches"], c["chunks"] = None, 1
    return c, world


@st.composite
def valid_configs(draw):
    """Runs that must be accepted, built to satisfy every rule."""
    tp, pp, dp = draw(small), draw(small), draw(small)
    schedule = draw(st.sampled_from(SCHEDULES)) if pp > 1 else "1f1b"
    chunks = draw(st.integers(1, 3)) if schedule == "interleaved" else 1
    micro = None
    if pp > 1:
        low = 1 if schedule == "gpipe" else pp
        micro = draw(st.integers(low, 8))
        if schedule == "interleaved" and chunks > 1:
            micro = pp * draw(st.integers(1, 2))
    strategy = draw(st.sampled_from(DP_FLAVOURS))
    if schedule == "zb_h1":
        strategy = "ddp"
    ckpt = draw(st.sampled_from(CHECKPOINTING))
    sp = tp > 1 and draw(st.booleans())
    ga = draw(small)
    model = dict(
        vocab_size=draw(st.integers(8, 64)),
        seq_len=tp * draw(st.integers(1, 4)),
        n_layers=pp * chunks * draw(st.integers(1, 2)),
        n_heads=tp * draw(st.integers(1, 2)),
        d_model=0,
        dropout=draw(st.sampled_from([0.0, 0.1])),
    )
    model["d_model"] = model["n_heads"] * 4
    layout = (dp, tp, pp)
    if tp == pp == 1 and draw(st.booleans()):
        layout = None  # data parallel over the whole world
    c = dict(
        model=model,
        layout=layout,
        strategy=strategy,
        global_batch_size=dp * ga * (micro or 1) * draw(st.integers(1, 2)),
        grad_accum_steps=ga,
        microbatches=micro,
        chunks=chunks,
        schedule=schedule,
        precision=draw(st.sampled_from(PRECISIONS)),
        activation_checkpointing=ckpt,
        sequence_parallel=sp,
        offload=strategy.startswith("zero") and draw(st.booleans()),
    )
    return c, dp * tp * pp


def _build(c: dict) -> TrainConfig:
    fields = dict(c)
    fields["model"] = GPTConfig(**c["model"])
    if c["layout"] is not None:
        dp, tp, pp = c["layout"]
        fields["layout"] = Layout(dp=dp, tp=tp, pp=pp)
    return TrainConfig(**fields)


def _check(c: dict, world: int):
    """What the code under test says: the layout, or the ValueError."""
    try:
        return _build(c).check(world)
    except ValueError as exc:
        return exc


# ---- properties ----------------------------------------------------------------------
@FAST
@given(configs())
def test_check_accepts_exactly_the_runs_the_oracle_allows(case):
    c, world = case
    wrong = _violations(c, world)
    got = _check(c, world)
    if not wrong:
        assert isinstance(got, Layout), f"rejected a valid run: {got}"
        dp, tp, pp = c["layout"] or (world, 1, 1)
        assert got == Layout(dp=dp, tp=tp, pp=pp)
        return
    assert isinstance(got, ValueError), f"accepted {c} on {world} ranks; {wrong}"
    message = str(got)
    # it names one of the things that are wrong ...
    assert any(word in message for words in wrong for word in words), (
        message,
        wrong,
    )
    # ... and what to do about it
    assert ADVICE.search(message), message


@FAST
@given(valid_configs())
def test_every_valid_run_passes_check(case):
    c, world = case
    assert _violations(c, world) == []  # the generator and the oracle agree
    got = _check(c, world)
    assert isinstance(got, Layout), f"{c} on {world} ranks rejected: {got}"
    assert got.world_size == world
    # and a config survives the trip through JSON unchanged
    config = _build(c)
    assert TrainConfig.from_dict(config.to_dict()) == config


@FAST
@given(st.tuples(*(st.one_of(st.integers(-2, 5), st.just(True), st.just(1.0),
                             st.just("2")) for _ in range(3))))  # fmt: skip
def test_layout_sizes_are_positive_integers(sizes):
    dp, tp, pp = sizes
    if all(_positive_int(v) for v in sizes):
        layout = Layout(dp=dp, tp=tp, pp=pp)
        assert layout.world_size == dp * tp * pp
        # rank <-> coordinates is a bijection, and each axis partitions the ranks
        n = layout.world_size
        assert [layout.rank(**layout.coords(r)) for r in range(n)] == list(range(n))
        for axis in ("dp", "tp", "pp"):
            groups = layout.groups(axis)
            assert sorted(r for g in groups for r in g) == list(range(n))
            assert all(len(g) == layout.size(axis) for g in groups)
    else:
        with pytest.raises(ValueError, match="must be a positive integer"):
            Layout(dp=dp, tp=tp, pp=pp)


@FAST
@given(
    st.tuples(small, small, small),
    st.integers(1, 12),
    st.integers(1, 8),
    st.integers(1, 8),
    st.one_of(st.none(), st.integers(1, 8)),
    st.sampled_from(SCHEDULES),
    st.integers(1, 3),
)
def test_layout_validate_matches_the_rules(
    sizes, world, n_layers, n_heads, micro, schedule, chunks
):
    dp, tp, pp = sizes
    wrong = []
    if dp * tp * pp != world:
        wrong.append("world")
    if n_heads % tp:
        wrong.append("n_heads")
    if n_layers % (pp * chunks):
        wrong.append("n_layers")
    if micro is not None and schedule != "gpipe" and micro < pp:
        wrong.append("microbatches")
    layout = Layout(dp=dp, tp=tp, pp=pp)
    kwargs = dict(
        n_layers=n_layers,
        n_heads=n_heads,
        microbatches=micro,
        schedule=schedule,
        chunks=chunks,
    )
    if not wrong:
        assert layout.validate(world, **kwargs) is layout
        return
    with pytest.raises(ValueError) as info:
        layout.validate(world, **kwargs)
    assert any(w in str(info.value) for w in wrong), (str(info.value), wrong)
    assert ADVICE.search(str(info.value)), str(info.value)


# ---- the lab's entry points ----------------------------------------------------------
def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=10_000, max_value=10**9),
        st.floats(allow_nan=True),
        st.text(max_size=3),
        st.booleans(),
    )
)
def test_lab_cluster_rejects_bad_world_sizes_before_starting(world_size):
    pytest.importorskip("ipyparallel")
    from dtlab.lab import LabCluster

    before = _children()
    with pytest.raises(ValueError, match="world_size") as info:
        LabCluster(world_size=world_size, backend="gloo")
    assert ADVICE.search(str(info.value)) or "positive integer" in str(info.value)
    assert _children() <= before


class _Running:
    """Stands in for a cluster the notebook already started."""

    running = True
    world_size = 2
    stopped = False

    def stop(self):
        self.stopped = True

    def reset(self):
        return self


def test_start_with_a_world_the_machine_cannot_give_stops_nothing():
    pytest.importorskip("ipyparallel")
    from dtlab.lab import start
    from dtlab.lab.kernel import teardown

    old = _Running()
    teardown.register(old)  # as if the notebook had started it
    before = _children()
    try:
        with pytest.raises(ValueError, match="more than this machine can run"):
            start(world_size=max_cpu_world_size() + 1)
        assert not old.stopped, "a bad request stopped the running cluster"
        with pytest.raises(ValueError, match="world_size must be a positive"):
            start(world_size=0)
        assert not old.stopped
    finally:
        teardown.forget(old)
    assert _children() <= before


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(layout=Layout(dp=2, tp=2)), "world has 2"),
        (dict(global_batch_size=3), "global_batch_size=3"),
        (dict(strategy="fsdp"), "unknown strategy"),
        (dict(sequence_parallel=True), "sequence_parallel"),
        (dict(microbatches=2), "pipeline option"),
    ],
)
def test_cluster_train_rejects_a_bad_config_before_any_engine_runs(changes, match):
    pytest.importorskip("ipyparallel")
    from dtlab.lab import LabCluster

    cluster = LabCluster(2, backend="gloo")  # never started

    def run(*args, **kwargs):
        raise AssertionError("an engine was asked to run a config check rejects")

    cluster.run = run
    with pytest.raises(ValueError, match=match):
        cluster.train(TrainConfig(**changes), live=False)


@st.composite
def near_misses(draw):
    c, world = draw(valid_configs())
    c = dict(c, model=dict(c["model"]))
    what = draw(st.sampled_from(["world", "model", "field", "bad", "none"]))
    if what == "world":
        world = draw(st.integers(1, 16))
    elif what == "model":
        key = draw(st.sampled_from(["n_layers", "n_heads", "seq_len", "dropout"]))
        if key == "dropout":
            c["model"]["dropout"] = 0.1
        else:
            c["model"][key] = draw(st.integers(1, 8))
        c["model"]["d_model"] = c["model"]["n_heads"] * 4
    elif what == "field":
        key, value = draw(
            st.sampled_from(
                [
                    ("global_batch_size", st.integers(1, 48)),
                    ("grad_accum_steps", small),
                    ("microbatches", st.one_of(st.none(), st.integers(1, 8))),
                    ("chunks", st.integers(1, 3)),
                    ("schedule", st.sampled_from(SCHEDULES)),
                    ("strategy", st.sampled_from(DP_FLAVOURS)),
                    ("sequence_parallel", st.booleans()),
                    ("offload", st.booleans()),
                    ("activation_checkpointing", st.sampled_from(CHECKPOINTING)),
                ]
            )
        )
        c[key] = draw(value)
    elif what == "bad":
        key = draw(st.sampled_from(sorted(BAD)))
        c[key] = draw(BAD[key])
    return c, world

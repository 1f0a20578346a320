"""Checkpoints that reshard (dtlab.reshard, issue 28 item 4): saved at one layout and
strategy, loaded at another, and the run goes on with the losses of the run that
never stopped.

Saved on 4 ranks (ZeRO-3 dp4, DDP dp4, ZeRO-1 dp2·tp2, DDP dp2·pp2, bf16 DDP
dp2·tp2, ZeRO-3 dp4 with dropout, fp16 DDP dp4, HSDP 2x2), each after K steps of a
run that then goes on uninterrupted; loaded on 4 ranks, on 2 and in this process
alone. (The whole file: ~22 s, its clusters' start included.) PyTorch's own
(torch.distributed.checkpoint over FSDP2) saves the same job at world 2 and loads it
at 1 and 4, beside dtlab's.

Tolerances. A load at the layout it was saved at continues exactly (``==``): the
same sums in the same order. At another layout the state loaded is exactly the
saved one (the weights and moments compare with ``torch.equal``: resharding moves
bytes, never computes), but the steps after it sum the gradients in the new
layout's order; tests/test_parallelize.py derives for that a loss agreement within
2e-6 relative (measured here: at most 1.0e-7; ZeRO-3 -> DDP and DDP -> ZeRO-1 at
dp4 even come out equal). A load that drops Adam's moments misses the continued
losses by more than 1e-4 relative (measured 8.9e-4), so the 2e-6 agreement is a
proof that the moments moved.
"""

import math
import os
import shutil
import warnings

import pytest
import torch

from dtlab import reshard
from dtlab.model import GPTConfig
from dtlab.reference import train_reference
from dtlab.reshard import Piece, overlaps, tp_piece
from dtlab.topology import Layout
from dtlab.train import TrainConfig, Trainer

# vocab 33: under tp=2 the vocabulary pads to 34 rows, the last rank's slice of the
# embedding ends in a row that is no token
MODEL = GPTConfig(vocab_size=33, seq_len=8, n_layers=2, n_heads=2, d_model=16)
CONFIG = TrainConfig(model=MODEL, global_batch_size=8, steps=4)
K = 2  # steps before the checkpoint; CONFIG.steps - K after it
REL = 2e-6
MOMENT = "blocks.1.attn.proj.weight"  # whose Adam moments the tests follow

# name -> (layout, strategy, precision, dropout, other config fields), on 4 ranks
SAVED = {
    "zero3-dp4": (Layout(dp=4), "zero3", "fp32", 0.0, {}),
    "ddp-dp4": (Layout(dp=4), "ddp", "fp32", 0.0, {}),
    "zero1-dp2tp2": (Layout(dp=2, tp=2), "zero1", "fp32", 0.0, {}),
    "ddp-dp2pp2": (Layout(dp=2, pp=2), "ddp", "fp32", 0.0, {}),
    "bf16-dp2tp2": (Layout(dp=2, tp=2), "ddp", "bf16", 0.0, {}),
    "dropout-zero3-dp4": (Layout(dp=4), "zero3", "fp32", 0.1, {}),
    "fp16-ddp-dp4": (Layout(dp=4), "ddp", "fp16", 0.0, {}),
    "hsdp-zero3-dp4": (Layout(dp=4), "zero3", "fp32", 0.0, {"zero_shard_size": 2}),
}
# (saved, layout, strategy, options): loaded on 4 ranks, then on 2
LOADS_4 = [
    ("zero3-dp4", Layout(dp=4), "zero3", {}),  # the same layout: exact
    ("zero3-dp4", Layout(dp=4), "ddp", {}),  # ZeRO-3 -> DDP, same world
    ("ddp-dp4", Layout(dp=4), "zero1", {}),  # DDP -> ZeRO-1
    ("zero3-dp4", Layout(dp=2, tp=2), "zero2", {}),  # tp1 -> tp2
    ("zero3-dp4", Layout(dp=2, pp=2), "ddp", {}),  # pp1 -> pp2
    ("dropout-zero3-dp4", Layout(dp=4), "zero3", {}),  # same layout, dropout on
]
LOADS_2 = [
    ("zero3-dp4", Layout(dp=2), "zero3", {}),  # 4 -> 2
    ("zero3-dp4", Layout(dp=2), "ddp", {}),  # 4 -> 2, ZeRO-3 -> DDP
    ("zero3-dp4", Layout(dp=2), "zero3", {"optimizer": False}),  # weights only
    ("zero1-dp2tp2", Layout(dp=2), "ddp", {}),  # tp2 -> tp1
    ("ddp-dp2pp2", Layout(dp=2), "zero3", {}),  # pp2 -> pp1
    ("dropout-zero3-dp4", Layout(dp=2), "zero3", {}),  # dropout on, masks differ
    ("fp16-ddp-dp4", Layout(dp=2), "zero1", {"precision": "fp16"}),  # loss scale
    ("hsdp-zero3-dp4", Layout(dp=2), "ddp", {}),  # HSDP: replica 0 wrote
]


def _config(layout, strategy, precision="fp32", dropout=0.0, **more):
    model = GPTConfig(**{**MODEL.__dict__, "dropout": dropout})
    return CONFIG.replace(
        model=model, layout=layout, strategy=strategy, precision=precision, **more
    )


def _copy(tensors):
    # full_parameters may hand out the live masters (DDP): steps would change them
    return {k: v.clone() for k, v in tensors.items()}


def _losses(trainer):
    return [r["loss"] for r in trainer.records]


# ---- on the ranks --------------------------------------------------------------------
def _save_all(root):
    """On 4 ranks: each SAVED run trains K steps, is saved, and goes on to the end
    (the uninterrupted run). Returns per run its losses, its full weights at the
    save (this rank's stage) and the moments gathered over dp (ZeRO runs)."""
    from dtlab.checkpoint import gather_full_optimizer_state
    from dtlab.topology import Topology

    topos, out = {}, {}
    for name, (layout, strategy, precision, dropout, more) in SAVED.items():
        topo = topos.setdefault(layout, Topology(layout))
        config = _config(layout, strategy, precision, dropout, **more)
        trainer = Trainer(config, topo)
        trainer.fit(K)
        params = _copy(trainer.full_parameters())
        moments = None
        if trainer.parts.zero_stage is not None and not trainer.parts.pipe:
            full = gather_full_optimizer_state(
                trainer.model, trainer.optimizer.optimizer
            )
            moments = {n: full[n] for n in (MOMENT, "wte.weight")}
        reshard.save(f"{root}/{name}", trainer)
        scaler = trainer.optimizer.scaler.state_dict()
        trainer.fit(CONFIG.steps - K)
        out[name] = dict(
            losses=_losses(trainer), params=params, moments=moments, scaler=scaler
        )
    return out


def _load_all(root, cases):
    """On every rank: load each case into a fresh trainer, note what the load
    restored (this rank's full weights) and reported, and train to the end."""
    from dtlab.topology import Topology

    topos, out = {}, []
    for src, layout, strategy, options in cases:
        options = dict(options)
        precision = options.pop("precision", "fp32")
        topo = topos.setdefault(layout, Topology(layout))
        trainer = Trainer(_config(layout, strategy, precision, SAVED[src][3]), topo)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = reshard.load(f"{root}/{src}", trainer, **options)
        params = _copy(trainer.full_parameters())
        scaler = trainer.optimizer.scaler.state_dict()
        trainer.fit(CONFIG.steps - report.step)
        out.append(
            dict(
                losses=_losses(trainer),
                params=params,
                report=report,
                scaler=scaler,
                warned=[type(w.message).__name__ for w in caught],
            )
        )
    return out


def _dcp_and_dtlab(root):
    """On 2 ranks: the ZeRO-3 job with FSDP2 saved by DCP, and with dtlab's
    ZeRO-3 saved by dtlab.reshard, each after K steps and then run to the end."""
    from dtlab.reshard.dcp import fsdp2_train

    config = _config(None, "zero3")
    dcp = fsdp2_train(config, f"{root}/dcp", K)
    trainer = Trainer(config)
    trainer.fit(K)
    reshard.save(f"{root}/dtlab", trainer)
    trainer.fit(CONFIG.steps - K)
    return dict(dcp=dcp["losses"], dtlab=_losses(trainer))


def _dcp_resume(root):
    from dtlab.reshard.dcp import fsdp2_resume

    return fsdp2_resume(_config(None, "zero3"), f"{root}/dcp")


# ---- the runs, once for the module ---------------------------------------------------
@pytest.fixture(scope="module")
def runs(lab_cluster, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    saved = lab_cluster(4).run(_save_all, root, timeout=240)
    two = lab_cluster(2)
    side = two.run(_dcp_and_dtlab, root, timeout=120)[0]
    loaded_2 = two.run(_load_all, root, LOADS_2, timeout=240)
    loaded_4 = lab_cluster(4).run(_load_all, root, LOADS_4, timeout=240)
    dcp_4 = lab_cluster(4).run(_dcp_resume, root, timeout=120)[0]
    reference = train_reference(MODEL, steps=CONFIG.steps, global_batch_size=8)
    return dict(
        root=root,
        saved=saved,
        side=side,
        loaded={2: loaded_2, 4: loaded_4},
        dcp_4=dcp_4,
        reference=reference.losses,
    )


def _loaded(runs, world, case):
    """Every rank's result of one load case."""
    i = (LOADS_2 if world == 2 else LOADS_4).index(case)
    return [rank[i] for rank in runs["loaded"][world]]


def _saved_params(runs, name):
    """The saved run's full weights at the save, merged over its ranks' stages."""
    out = {}
    for rank in runs["saved"]:
        out.update(rank[name]["params"])
    return out


def _assert_restored_and_continues(runs, world, case, exact=False, rel=REL):
    src = case[0]
    got = _loaded(runs, world, case)
    saved = _saved_params(runs, src)
    for rank, r in enumerate(got):
        assert r["report"].step == K
        assert r["report"].resharded == (case[1] != SAVED[src][0])
        for name, t in r["params"].items():  # moving bytes changes no bit
            assert torch.equal(t, saved[name]), (case, rank, name)
    whole = runs["saved"][0][src]["losses"]
    continued = got[0]["losses"]
    assert len(continued) == CONFIG.steps - K
    if exact:
        assert continued == whole[K:], case
    else:
        assert continued == pytest.approx(whole[K:], rel=rel), case
        if SAVED[src][2] == "fp32":
            assert continued == pytest.approx(runs["reference"][K:], rel=rel), case
    return got


# ---- the geometry, without ranks -----------------------------------------------------
def _brute(piece):
    """The full-tensor flat indices of a piece's elements, the slow way."""
    index = torch.arange(math.prod(piece.shape))
    box = index.view(piece.shape).narrow(
        piece.dim, piece.start, piece.stop - piece.start
    )
    return box.reshape(-1)[piece.lo : piece.hi]


def test_overlaps_agree_with_indices_for_every_kind_of_piece():
    """Boxes along dim 0 and 1, flat ranges of them, whole tensors: where two pieces
    meet (:func:`overlaps`) is where their elements' indices agree."""
    gen = torch.Generator().manual_seed(0)
    shape = (6, 10)
    pieces = []
    for dim in (0, 1):
        for _ in range(30):
            a, b = sorted(
                torch.randint(0, shape[dim] + 1, (2,), generator=gen).tolist()
            )
            numel = (b - a) * (shape[1 - dim])
            lo, hi = sorted(torch.randint(0, numel + 1, (2,), generator=gen).tolist())
            pieces.append(Piece(shape, dim, a, b, lo, hi))
    pieces.append(Piece.whole(shape))
    for want in pieces:
        w = _brute(want)
        for have in pieces[::7]:
            h = _brute(have)
            out = torch.full((want.numel,), -1)
            for wo, ho, n in overlaps(want, have):
                out[wo : wo + n] = h[ho : ho + n]
                assert torch.equal(w[wo : wo + n], h[ho : ho + n])
            shared = torch.isin(w, h)
            assert torch.equal(out >= 0, shared)


def test_a_padded_vocabulary_slice_is_cut_to_real_rows():
    # vocab 33 over tp=2: 17 rows a rank, the last one's 17th row is padding
    piece, padding = tp_piece((33, 16), (17, 16), 0, 1, 0, 17 * 16)
    assert (piece.start, piece.stop, piece.numel, padding) == (17, 33, 16 * 16, 16)
    # a ZeRO range of that slice straddling the padding: real prefix, padding suffix
    piece, padding = tp_piece((33, 16), (17, 16), 0, 1, 200, 272)
    assert (piece.lo, piece.hi, padding) == (200, 256, 16)
    with pytest.raises(ValueError, match="full shape"):
        tp_piece((16,), (8,), None, 0, 0, 8)


# ---- resharding on the cluster -------------------------------------------------------
@pytest.mark.cluster
def test_zero3_on_4_ranks_continues_on_2_under_zero3_and_ddp(runs):
    """4 -> 2: the continued losses are the uninterrupted 4-rank run's and the
    single-process reference's; each ZeRO-3 rank read exactly its half of the
    bytes, each DDP replica all of them, and no rank more."""
    payload = reshard.describe(f"{runs['root']}/zero3-dp4")["payload_bytes"]
    z3 = _assert_restored_and_continues(runs, 2, LOADS_2[0])
    assert [r["report"].bytes_read for r in z3] == [payload // 2] * 2
    ddp = _assert_restored_and_continues(runs, 2, LOADS_2[1])
    assert [r["report"].bytes_read for r in ddp] == [payload] * 2
    # the uninterrupted runs agree with the reference too
    for name in ("zero3-dp4", "ddp-dp4", "zero1-dp2tp2", "ddp-dp2pp2"):
        whole = runs["saved"][0][name]["losses"]
        assert whole == pytest.approx(runs["reference"], rel=REL), name


@pytest.mark.cluster
def test_strategy_changes_at_the_same_world(runs):
    """ZeRO-3 -> ZeRO-3 at its own layout continues exactly; ZeRO-3 -> DDP and
    DDP -> ZeRO-1 on the same 4 ranks to rounding."""
    exact = _assert_restored_and_continues(runs, 4, LOADS_4[0], exact=True)
    assert exact[0]["report"].random_state == "restored"
    _assert_restored_and_continues(runs, 4, LOADS_4[1])
    _assert_restored_and_continues(runs, 4, LOADS_4[2])


@pytest.mark.cluster
def test_tensor_and_pipeline_layouts_reshard(runs):
    """tp1 -> tp2 and pp1 -> pp2 on 4 ranks; tp2 -> tp1 and pp2 -> pp1 on 2; and a
    dp2·tp2 run into this process alone."""
    _assert_restored_and_continues(runs, 4, LOADS_4[3])
    _assert_restored_and_continues(runs, 4, LOADS_4[4])
    _assert_restored_and_continues(runs, 2, LOADS_2[3])
    _assert_restored_and_continues(runs, 2, LOADS_2[4])
    alone = Trainer(_config(None, "ddp"))
    report = reshard.load(f"{runs['root']}/zero1-dp2tp2", alone)
    saved = _saved_params(runs, "zero1-dp2tp2")
    for name, t in alone.full_parameters().items():
        assert torch.equal(t, saved[name]), name
    alone.fit(CONFIG.steps - report.step)
    assert _losses(alone) == pytest.approx(runs["reference"][K:], rel=REL)


@pytest.mark.cluster
def test_the_optimizer_state_moves_with_the_weights(runs):
    """The saved moments are the uninterrupted run's, element for element, through
    tp's column slices and the padded vocabulary too; a load without them would
    miss the continued losses by far more than the tolerance."""
    root = runs["root"]
    gathered = runs["saved"][0]["zero3-dp4"]["moments"][MOMENT]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(
            reshard.read_full(f"{root}/zero3-dp4", MOMENT, key), gathered[key]
        )
    # dp2·tp2: ranks 0 and 1 are tp 0 and 1 of dp 0; proj is split by columns (dim
    # 1), the embedding by padded rows (dim 0)
    tp = [runs["saved"][r]["zero1-dp2tp2"]["moments"] for r in (0, 1)]
    for name, dim in ((MOMENT, 1), ("wte.weight", 0)):
        full = torch.cat([tp[0][name]["exp_avg"], tp[1][name]["exp_avg"]], dim=dim)
        full = full[: MODEL.vocab_size] if name == "wte.weight" else full
        got = reshard.read_full(f"{root}/zero1-dp2tp2", name, "exp_avg")
        assert torch.equal(got, full), name
    with_state = _loaded(runs, 2, LOADS_2[0])[0]["losses"]
    without = _loaded(runs, 2, LOADS_2[2])
    assert without[0]["report"].optimizer is False
    whole = runs["saved"][0]["zero3-dp4"]["losses"][K:]
    gap = max(abs(a - b) / b for a, b in zip(without[0]["losses"], whole))
    assert gap > 1e-4, gap
    assert with_state == pytest.approx(whole, rel=REL)


@pytest.mark.cluster
def test_the_random_state_is_not_carried_across_layouts(runs):
    """Dropout on: at the saved layout each rank gets its own random state back
    and the run continues exactly; at dp2 the loader says it kept its own seeding
    (a RandomStateNotCarried warning on every rank), and the masks, so the
    losses, differ from the run that never stopped."""
    whole = runs["saved"][0]["dropout-zero3-dp4"]["losses"]
    same = _loaded(runs, 4, LOADS_4[5])
    assert same[0]["losses"] == whole[K:]
    assert all(r["report"].random_state == "restored" and not r["warned"] for r in same)
    other = _loaded(runs, 2, LOADS_2[5])
    for r in other:
        assert r["report"].random_state == "fresh"
        assert r["warned"] == ["RandomStateNotCarried"]
        assert any("dropout masks" in note for note in r["report"].notes)
    gap = max(abs(a - b) / b for a, b in zip(other[0]["losses"], whole[K:]))
    assert gap > 1e-4, gap
    # without dropout the same reshard says the state stayed behind, and nothing else
    quiet = _loaded(runs, 2, LOADS_2[0])[0]
    assert quiet["report"].random_state == "fresh" and not quiet["warned"]


@pytest.mark.cluster
def test_bad_input_is_named(runs, tmp_path):
    root = runs["root"]
    other = TrainConfig(model=GPTConfig(**{**MODEL.__dict__, "d_model": 32}))
    with pytest.raises(ValueError, match="d_model=16 there, 32 here"):
        reshard.load(f"{root}/zero3-dp4", Trainer(other))
    with pytest.raises(ValueError, match="holds no metadata.json"):
        reshard.load(tmp_path, Trainer(_config(None, "ddp")))
    broken = tmp_path / "broken"
    shutil.copytree(f"{root}/zero3-dp4", broken)
    os.remove(broken / "rank00002.bin")
    trainer = Trainer(_config(None, "ddp"))
    before = {k: v.clone() for k, v in trainer.full_parameters().items()}
    with pytest.raises(ValueError, match="rank00002.bin is missing"):
        reshard.load(broken, trainer)
    # refused before anything was written
    assert all(torch.equal(v, before[k]) for k, v in trainer.full_parameters().items())
    shutil.copy(f"{root}/zero3-dp4/rank00002.bin", broken)
    with open(broken / "rank00001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="truncated"):
        reshard.load(broken, Trainer(_config(None, "ddp")))


@pytest.mark.cluster
def test_16_bit_runs_save_their_fp32_masters_and_load_into_fp32(runs):
    """The decision: a checkpoint holds the fp32 masters, so a bf16 run loads into
    an fp32 trainer (and the reverse) with its masters exact; what the model then
    computes with is them in the new precision. The report says so."""
    root, name = runs["root"], "bf16-dp2tp2"
    saved = _saved_params(runs, name)
    wte = reshard.read_full(f"{root}/{name}", "wte.weight")
    assert torch.equal(wte, saved["wte.weight"])  # the master, not the bf16 copy
    assert not torch.equal(wte, wte.bfloat16().float())
    fp32 = Trainer(_config(None, "ddp"))
    report = reshard.load(f"{root}/{name}", fp32)
    assert any("saved in bf16, loaded in fp32" in n for n in report.notes)
    for k, v in fp32.full_parameters().items():
        assert torch.equal(v, saved[k]), k
    bf16 = Trainer(_config(None, "ddp", "bf16"))
    reshard.load(f"{root}/zero3-dp4", bf16)
    master = bf16.optimizer.masters[0]
    assert torch.equal(master, _saved_params(runs, "zero3-dp4")["wte.weight"])
    assert torch.equal(bf16.optimizer.params[0], master.bfloat16())


@pytest.mark.cluster
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process
def test_dcp_beside_dtlab(runs, tmp_path):
    """torch.distributed.checkpoint saving FSDP2 at world 2, loaded at 1 and at 4,
    and dtlab's ZeRO-3 at world 2 loaded at 1: both continue with the losses of
    their uninterrupted runs, and of the reference. What each wrote: the same fp32
    numbers (weights and both moments, 12 bytes a parameter), DCP's with the tied
    head stored a second time and the step counts as tensors, each item with a
    torch.save header, and a pickled metadata; dtlab's raw, one JSON index."""
    from dtlab.reshard.dcp import describe_dcp, fsdp2_resume

    root, side, ref = runs["root"], runs["side"], runs["reference"]
    assert side["dcp"] == pytest.approx(ref, rel=REL)
    assert side["dtlab"] == pytest.approx(ref, rel=REL)
    alone = fsdp2_resume(_config(None, "zero3"), f"{root}/dcp")  # no process group
    assert alone["step"] == K
    assert alone["losses"] == pytest.approx(side["dcp"][K:], rel=REL)
    assert runs["dcp_4"]["losses"] == pytest.approx(side["dcp"][K:], rel=REL)
    trainer = Trainer(_config(None, "ddp"))
    reshard.load(f"{root}/dtlab", trainer)
    trainer.fit(CONFIG.steps - K)
    assert _losses(trainer) == pytest.approx(side["dtlab"][K:], rel=REL)
    assert _losses(trainer) == pytest.approx(alone["losses"], rel=REL)

    ours, theirs = reshard.describe(f"{root}/dtlab"), describe_dcp(f"{root}/dcp")
    psi = MODEL.n_params()
    assert ours["params"] == psi
    assert ours["payload_bytes"] == 12 * psi  # fp32 master, exp_avg, exp_avg_sq
    assert list(ours["data_bytes"].values()) == [6 * psi] * 2  # one half a rank
    assert len(theirs["data_bytes"]) == 2
    head = MODEL.vocab_size * MODEL.d_model * 4  # the tied head, again
    steps = ours["tensors"] * 4  # a float32 step count per parameter
    assert theirs["payload_bytes"] == 12 * psi + head + steps
    assert "model.head.weight" in theirs["keys"]
    # pieces: dtlab's ZeRO-3 cuts each unit's flat buffer once at world 2 (3 units:
    # the root and 2 blocks), so at most 3 tensors come in two pieces; DCP stores
    # every sharded tensor (weights, both moments) as one chunk a rank, dim 0, and
    # each step count whole
    n = ours["tensors"]  # 36 parameters
    assert n < ours["pieces"] <= n + 3
    assert theirs["pieces"] == 2 * (n + 1) + 2 * 2 * n + n  # head; moments; steps
    assert ours["metadata_bytes"] < theirs["metadata_bytes"]
    assert theirs["stored_bytes"] > theirs["payload_bytes"]  # a header per item
    assert sum(theirs["data_bytes"].values()) >= theirs["stored_bytes"]


@pytest.mark.cluster
def test_hybrid_sharding_and_the_fp16_loss_scale(runs):
    """HSDP (ZeRO-3 in groups of 2, replicated twice) is written by its first
    replica alone and loads into DDP on 2 ranks; an fp16 run on 4 ranks goes on on
    2 under ZeRO-1 with its loss scaler's state (scale, clean steps) carried.
    fp16's tolerance is tests/test_parallelize.py's (3e-4: each fp16 rounding is
    worth 2^-11; measured here ~1e-6)."""
    root = runs["root"]
    assert len(reshard.describe(f"{root}/hsdp-zero3-dp4")["data_bytes"]) == 2
    _assert_restored_and_continues(runs, 2, LOADS_2[7])
    fp16 = _assert_restored_and_continues(runs, 2, LOADS_2[6], rel=3e-4)
    saved = runs["saved"][0]["fp16-ddp-dp4"]["scaler"]
    assert saved["clean_steps"] == K
    for r in fp16:
        assert r["report"].scaler == "restored"
        assert r["scaler"] == saved

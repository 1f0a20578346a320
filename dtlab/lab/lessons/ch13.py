"""Chapter 13's lesson helpers (``notebooks/13_resilience.ipynb``): the numbers the
chapter asks the learner to predict (``QUESTIONS``) and the runs and tables behind
its three sections, kept out of the learner's cells.

- How often to checkpoint (:mod:`dtlab.ft.young_daly`): :data:`LLAMA3_FAILURES`,
  the failure count one large run published, :func:`node_mtbf_s` turns it into a
  node's MTBF, :func:`waste_rows` and :func:`waste_figure` price intervals.
- A replica lost and healed (:mod:`dtlab.ft.quorum`): :func:`ft_run` (run on every
  rank) trains the course's GPT with a :class:`dtlab.ft.FaultTolerantReplica` per
  rank, one of them lost for a few steps; :func:`ddp_run` and :func:`local_run`
  (run on every rank) train the same steps under DDP and under LocalSGD/DiLoCo;
  :func:`global_losses` and :func:`loss_figure` read the curves back.
- Checkpoints that reshard (:mod:`dtlab.reshard`): :func:`reshard_save` and
  :func:`reshard_load` (run on every rank) save a :class:`dtlab.train.Trainer` at
  one layout and load it at another; :func:`dcp_save` and :func:`dcp_resume` do the
  same with PyTorch's DCP on FSDP2 (:mod:`dtlab.reshard.dcp`).

The figures and tables run in the notebook's kernel; the functions marked "run on
every rank" are shipped to the engines by ``cluster.run``.
"""

from __future__ import annotations

import torch

from dtlab.lab.predictions import Question
from dtlab.model import GPTConfig

__all__ = [
    "QUESTIONS",
    "LLAMA3_FAILURES",
    "node_mtbf_s",
    "waste_rows",
    "simulate_waste",
    "waste_figure",
    "ft_run",
    "ddp_run",
    "local_run",
    "global_losses",
    "loss_figure",
    "reshard_save",
    "reshard_load",
    "dcp_save",
    "dcp_resume",
    "same_weights",
]

QUESTIONS = [
    Question(
        "young_daly_hours",
        "13",
        "the Young-Daly interval between checkpoints of a 1,024-GPU job (128 nodes "
        "of 8) whose checkpoint stalls training for 2 minutes, at the failure rate "
        "Llama 3's pre-training reported",
        "h",
    ),
    Question(
        "diloco_bytes_per_step",
        "13",
        "bytes one of 4 replicas sends per inner step under DiLoCo with H = 4 on "
        "the chapter's GPT (fp32, one ring all-reduce of every parameter per "
        "meeting)",
        "kB",
    ),
    Question(
        "reshard_bytes_read",
        "13",
        "bytes rank 0 reads from disk when the chapter's ZeRO-3 checkpoint, saved "
        "on 4 ranks, loads into DDP on 2 (fp32 AdamW)",
        "kB",
    ),
]

# ---- 1. how often to checkpoint ------------------------------------------------------
LLAMA3_FAILURES = {"days": 54, "gpus": 16_384, "unexpected": 419, "gpus_per_node": 8}
"""Dubey et al. 2024 (*The Llama 3 Herd of Models*, §3.3.4): over a 54-day window
of pre-training on 16,384 H100s (8 a server), 419 unexpected interruptions."""


def node_mtbf_s(failures: dict = LLAMA3_FAILURES) -> float:
    """One node's mean time between failures in seconds, if ``failures`` (a count
    over a window, on a number of GPUs) were spread evenly over the nodes: the
    window times the node count, over the failures."""
    nodes = failures["gpus"] / failures["gpus_per_node"]
    return failures["days"] * 86_400 * nodes / failures["unexpected"]


def waste_rows(checkpoint_s: float, mtbf_s: float, intervals_s) -> list[dict]:
    """For each interval τ: :func:`dtlab.ft.expected_waste`, split into its two
    terms (writing checkpoints, C/τ; work redone after a failure, τ/2M)."""
    from dtlab.ft import expected_waste

    return [
        {
            "interval_h": tau / 3600,
            "writing": checkpoint_s / tau,
            "redone": tau / (2 * mtbf_s),
            "waste": expected_waste(tau, checkpoint_s, mtbf_s),
        }
        for tau in intervals_s
    ]


def simulate_waste(
    checkpoint_s: float, mtbf_s: float, intervals_s, failures: int = 100_000, seed=0
) -> list[float]:
    """The share of time lost at each interval τ, simulated rather than derived:
    ``failures`` failure-free stretches drawn from an exponential distribution of
    mean ``mtbf_s`` (the same draws for every τ). In a stretch of length g the job
    completes ⌊g / (τ + C)⌋ work-and-checkpoint cycles and loses the rest; the
    waste is one minus the work kept over the time spent."""
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(failures, dtype=torch.float64)
    gaps.exponential_(1.0 / mtbf_s, generator=gen)  # (F,) seconds between failures
    total = gaps.sum().item()
    out = []
    for tau in intervals_s:
        kept = tau * torch.floor(gaps / (tau + checkpoint_s)).sum().item()
        out.append(1.0 - kept / total)
    return out


def waste_figure(checkpoint_s: float, mtbf_s: float, best_s: float):
    """The expected waste against the interval (log axis), its two terms, and the
    Young–Daly optimum marked."""
    import plotly.graph_objects as go

    taus = [best_s * 2 ** (k / 8) for k in range(-32, 33)]
    rows = waste_rows(checkpoint_s, mtbf_s, taus)
    x = [r["interval_h"] for r in rows]
    fig = go.Figure()
    for key, name in (
        ("waste", "expected waste"),
        ("writing", "writing checkpoints, C/τ"),
        ("redone", "work redone, τ/2M"),
    ):
        dash = None if key == "waste" else "dot"
        fig.add_scatter(x=x, y=[r[key] for r in rows], name=name, line_dash=dash)
    fig.add_vline(x=best_s / 3600, line_dash="dash", annotation_text="√(2CM)")
    fig.update_layout(
        height=340,
        title="Share of the job lost, by checkpoint interval",
        xaxis_title="interval between checkpoints (hours)",
        yaxis_title="share of time lost",
        xaxis_type="log",
        yaxis_tickformat=".0%",
        yaxis_range=[0, 0.3],
    )
    return fig


# ---- 2. a replica lost and healed; LocalSGD and DiLoCo -------------------------------
def _grads_step(model, x, y) -> float:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.item()


def ft_run(config: GPTConfig, steps: int, batch: int, down=None, lost=1) -> dict:
    """Run on every rank: ``steps`` AdamW steps of ``GPT(config)``, one
    :class:`dtlab.ft.FaultTolerantReplica` per rank, each step's global batch of
    ``batch`` rows dealt over all ranks. ``down=(first, end)``: rank ``lost`` is
    lost before step ``first`` (a new process: fresh weights, step 0) and takes
    part again from step ``end``, healed by a live peer. Returns each step's live
    set and this rank's loss (``None`` when it sat out), the bytes it received
    healing, its step count and its weights at the end."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.ft import FaultTolerantReplica
    from dtlab.model import GPT, SyntheticTokens, shard_batch
    from dtlab.reference import make_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(config.vocab_size, config.seq_len)
    model = GPT(config)
    replica = FaultTolerantReplica(model, make_optimizer(model.parameters()))
    out = {"live": [], "loss": []}
    for it in range(steps):
        telemetry.current().step = it
        out_now = down is not None and rank == lost and down[0] <= it < down[1]
        if out_now and it == down[0]:  # the process dies; a new one starts afresh
            fresh = GPT(config, seed=123)
            replica.lose_state(fresh, make_optimizer(fresh.parameters()))
        q = replica.start_quorum(taking_part=not out_now)
        out["live"].append(q.live)
        if rank not in q.live:
            out["loss"].append(None)
            continue
        x, y = shard_batch(*data.batch(q.step, batch), rank, world)
        out["loss"].append(_grads_step(replica.model, x, y))
        replica.average_gradients(q)
        replica.optimizer_step()
    out["step"] = replica.step
    out["healed_bytes"] = replica.healed_bytes
    out["final"] = {n: p.detach().clone() for n, p in replica.model.named_parameters()}
    return out


def ddp_run(config: GPTConfig, steps: int, batch: int) -> dict:
    """Run on every rank: the same steps under
    :class:`dtlab.ddp.DistributedDataParallel` with the reference's AdamW. Returns
    this rank's losses and final weights."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.ddp import DistributedDataParallel
    from dtlab.model import GPT, SyntheticTokens, shard_batch
    from dtlab.reference import make_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(config.vocab_size, config.seq_len)
    model = GPT(config)
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(ddp.parameters())
    losses = []
    for step in range(steps):
        telemetry.current().step = step
        x, y = shard_batch(*data.batch(step, batch), rank, world)
        losses.append(_grads_step(ddp, x, y))
        opt.step()
    return {
        "loss": losses,
        "final": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def local_run(config: GPTConfig, steps: int, batch: int, kind: str, H: int) -> dict:
    """Run on every rank: the same steps with AdamW inside and the replicas meeting
    every ``H`` steps, ``kind`` ``"localsgd"`` (:class:`dtlab.ft.LocalSGD`) or
    ``"diloco"`` (:class:`dtlab.ft.DiLoCo`, the paper's outer lr 0.7 and Nesterov
    0.9). Returns this rank's losses and final weights."""
    import torch.distributed as dist

    from dtlab import telemetry
    from dtlab.ft import DiLoCo, LocalSGD
    from dtlab.model import GPT, SyntheticTokens, shard_batch
    from dtlab.reference import make_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(config.vocab_size, config.seq_len)
    model = GPT(config)
    kinds = {"localsgd": LocalSGD, "diloco": DiLoCo}
    if kind not in kinds:
        raise ValueError(f"kind must be one of {sorted(kinds)}, got {kind!r}")
    syncer = kinds[kind](model, make_optimizer(model.parameters()), H)
    losses = []
    for step in range(steps):
        telemetry.current().step = step
        x, y = shard_batch(*data.batch(step, batch), rank, world)
        losses.append(_grads_step(model, x, y))
        syncer.step()
    return {
        "loss": losses,
        "final": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def global_losses(results: list[dict]) -> list[float]:
    """Each step's loss over the whole batch the live replicas saw: the mean of
    their shard losses (``results``: every rank's, in rank order; equal shards)."""
    out = []
    for step in range(len(results[0]["loss"])):
        mine = [r["loss"][step] for r in results if r["loss"][step] is not None]
        out.append(sum(mine) / len(mine))
    return out


def loss_figure(curves: dict, title: str, shade=None):
    """Loss per step of each run in ``curves`` (``{name: losses}``); ``shade``,
    ``(first, end)``, greys the steps a replica was out."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, losses in curves.items():
        fig.add_scatter(
            x=list(range(len(losses))), y=losses, mode="lines+markers", name=name
        )
    if shade is not None:
        fig.add_vrect(
            x0=shade[0] - 0.5,
            x1=shade[1] - 0.5,
            fillcolor="grey",
            opacity=0.15,
            line_width=0,
            annotation_text="a replica out",
        )
    fig.update_layout(height=340, title=title, xaxis_title="step", yaxis_title="loss")
    return fig


# ---- 3. checkpoints that reshard -----------------------------------------------------
def _trainer(config):
    from dtlab.topology import Topology
    from dtlab.train import Trainer

    return Trainer(config, Topology(config.layout))


def reshard_save(config, path: str, at: int) -> dict:
    """Run on every rank: train ``config`` (a :class:`dtlab.train.TrainConfig`) for
    ``at`` steps, save it with :func:`dtlab.reshard.save` into ``path``, and go on
    to ``config.steps``: the run that never stopped. Returns its losses."""
    from dtlab import reshard

    trainer = _trainer(config)
    trainer.fit(at)
    reshard.save(path, trainer)
    trainer.fit(config.steps - at)
    return {"losses": [r["loss"] for r in trainer.records]}


def reshard_load(config, path: str, name: str = "wte.weight") -> dict:
    """Run on every rank: a fresh trainer of ``config``, loaded from ``path`` with
    :func:`dtlab.reshard.load`, trained to ``config.steps``. Returns the losses
    after the load, what the load read (bytes, files) and, for tensor ``name``,
    this rank's piece (``lo``, ``hi``) and the saved pieces it read from (``file``,
    ``lo``, ``hi`` and the overlaps: offset in this rank's piece, offset in the
    saved one, length)."""
    from dtlab import reshard
    from dtlab.reshard import Piece, holdings, overlaps, read_metadata

    trainer = _trainer(config)
    report = reshard.load(path, trainer)
    entry = read_metadata(path)["tensors"][name]
    mine = next(h for h in holdings(trainer) if h.name == name)
    reads = []
    for saved in entry["pieces"]:
        segments = overlaps(mine.piece, Piece.from_dict(entry["shape"], saved))
        if segments:
            reads.append(
                {
                    "file": saved["file"],
                    "lo": saved["lo"],
                    "hi": saved["hi"],
                    "segments": segments,
                }
            )
    trainer.fit(config.steps - report.step)
    return {
        "losses": [r["loss"] for r in trainer.records],
        "step": report.step,
        "resharded": report.resharded,
        "bytes_read": report.bytes_read,
        "files_read": report.files_read,
        "notes": report.notes,
        "piece": (mine.piece.lo, mine.piece.hi),
        "reads": reads,
    }


def dcp_save(config, path: str, at: int) -> dict:
    """Run on every rank: the same job under PyTorch's FSDP2, saved by DCP after
    ``at`` steps and run on to the end (:func:`dtlab.reshard.dcp.fsdp2_train`)."""
    from dtlab.reshard.dcp import fsdp2_train

    return fsdp2_train(config, path, at)


def dcp_resume(config, path: str) -> dict:
    """Run on every rank: DCP's load at this world size, then on to the end
    (:func:`dtlab.reshard.dcp.fsdp2_resume`)."""
    from dtlab.reshard.dcp import fsdp2_resume

    return fsdp2_resume(config, path)


def same_weights(results: list[dict]) -> bool:
    """Whether every rank of ``results`` ends with rank 0's weights, bit for bit."""
    first = results[0]["final"]
    return all(torch.equal(r["final"][k], first[k]) for r in results for k in first)

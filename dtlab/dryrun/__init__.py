"""A dry run at any scale: dtlab's real composition and one training step on a
fake process group of ``world_size`` ranks, with meta-device weights.

``dry_run(config, world_size, rank=None)`` checks the config as
:meth:`dtlab.config.TrainConfig.check` does (same errors), then, for each rank
asked, joins PyTorch's ``fake`` process group as that rank in a spawned process
(collectives return at once; subgroups work), builds :class:`dtlab.train.Trainer`
(:func:`dtlab.parallelize.parallelize`: tensor parallelism, the pipeline stage,
checkpointing, ZeRO or DDP, precision) on the meta device, and runs one step
(ZeRO-1 and -2 then start the all-gather the next forward would: counted in the
step, as the steady state sends it) with dtlab's telemetry on
(:mod:`dtlab.dryrun.child`). What comes back is what dtlab's own accounting
recorded on that rank: the bytes held by category (:mod:`dtlab.memory`) and the
bytes every :mod:`dtlab.comm` call sent, by axis and op. Each is set beside
:func:`dtlab.estimate.layout_memory` / :func:`dtlab.estimate.layout_traffic` for
the rank's pipeline stage, with the difference and its reason
(:mod:`dtlab.dryrun.compare`).

``rank=None`` asks one representative rank per pipeline role: the first stage
(the embedding, the most microbatches in flight), the second (a middle stage) and
the last (the head), each at dp = cp = tp = 0 (the ranks of one stage hold the same
bytes). The ranks are shared over ``jobs`` spawned processes (default: one per
core, at most one per rank); each process dry-runs its ranks one after another,
leaving the fake world and joining it again as the next rank (torch's import is
paid once per process, not per rank; the test checks the numbers equal a fresh
process's). Each rank is bounded by ``timeout`` seconds; an error or a timeout
stops every process, and no process outlives the call.

dtlab's GPT is GPT-2-shaped. :func:`stand_in` makes the GPT that stands in for a
published model (same width, heads, vocabulary and context; the MLP as wide in
parameters; layers rounded up to a multiple of pp, since dtlab's stages hold equal
blocks), and says what differs; ``published=`` then adds the published model's
own estimate beside the measurement, with that reason. :func:`llama3_405b` is
Llama 3 405B's published layouts (Dubey et al. 2024, Table 4).

Taught in chapter 09 (planning at scale): the plan, then dtlab's own code at the
plan's scale.
"""

from __future__ import annotations

import os
import queue as queue_mod
import time
from dataclasses import dataclass, field

from dtlab.checks import positive_int
from dtlab.dryrun.compare import compare_memory, compare_traffic
from dtlab.dryrun.presets import StandIn, llama3_405b, stand_in
from dtlab.dryrun.report import RankReport, format_table

__all__ = [
    "dry_run",
    "DryRunReport",
    "RankReport",
    "representative_ranks",
    "stand_in",
    "StandIn",
    "llama3_405b",
]


@dataclass
class DryRunReport:
    """What :func:`dry_run` returns: the config, the world, one
    :class:`RankReport` per rank asked, and the seconds the whole call took."""

    config: object
    world_size: int
    layout: object
    ranks: list[RankReport] = field(default_factory=list)
    seconds: float = 0.0
    published: StandIn | None = None

    def rank(self, r: int) -> RankReport:
        for report in self.ranks:
            if report.rank == r:
                return report
        raise KeyError(f"rank {r} was not dry-run (ranks: {self.rank_ids})")

    @property
    def rank_ids(self) -> list[int]:
        return [r.rank for r in self.ranks]

    def unexplained(self) -> list[tuple[int, str, str]]:
        """``(rank, "memory"|"traffic", category)`` of every difference from the
        estimate that has no reason (empty when code and formulas agree)."""
        return [
            (r.rank, kind, row["category"])
            for r in self.ranks
            for kind, rows in (("memory", r.memory), ("traffic", r.traffic))
            for row in rows
            if row["difference"] and not row["reason"]
        ]

    def table(self) -> str:
        return format_table(self)

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "world_size": self.world_size,
            "layout": str(self.layout),
            "seconds": self.seconds,
            "published": None if self.published is None else self.published.name,
            "ranks": [r.to_dict() for r in self.ranks],
        }


def representative_ranks(layout) -> list[int]:
    """One rank per pipeline role (first, second, last stage) at dp = cp = tp = 0."""
    stages = sorted({0, min(1, layout.pp - 1), layout.pp - 1})
    return [layout.rank(pp=s) for s in stages]


def _role(layout, stage: int) -> str:
    if layout.pp == 1:
        return "only"
    return {0: "first", layout.pp - 1: "last"}.get(stage, "middle")


def _ranks_asked(rank, world_size: int, layout) -> list[int]:
    if rank is None:
        return representative_ranks(layout)
    asked = [rank] if isinstance(rank, int) else list(rank)
    if not asked:
        raise ValueError("rank: give a rank, a list of ranks, or None")
    for r in asked:
        if isinstance(r, bool) or not isinstance(r, int):
            raise ValueError(f"rank must be an int (or a list of them), got {r!r}")
        if not 0 <= r < world_size:
            raise ValueError(
                f"rank {r} is outside the world of {world_size} ranks: "
                f"ask for ranks in 0..{world_size - 1}"
            )
    return sorted(set(asked))


def _check(config, world_size: int):
    """TrainConfig.check's errors, after a clearer one for a world that the
    layout's tp·cp·pp does not divide."""
    from dtlab.train import TrainConfig

    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(config).__name__}")
    positive_int("world_size", world_size)
    if config.layout is not None:
        lay = config.layout
        cell = lay.tp * lay.cp * lay.pp
        if world_size % cell:
            raise ValueError(
                f"world_size={world_size} is not a multiple of the layout's "
                f"tp x cp x pp = {lay.tp} x {lay.cp} x {lay.pp} = {cell}: the world "
                f"is dp copies of that; with dp={lay.dp} it has {lay.world_size} ranks"
            )
    return config.check(world_size)


def dry_run(
    config,
    world_size: int,
    rank=None,
    *,
    published=None,
    timeout: float = 600.0,
    jobs: int | None = None,
) -> DryRunReport:
    """Dry-run ``config`` on a fake world of ``world_size`` ranks as ``rank`` (an
    int, a list, or ``None``: :func:`representative_ranks`); see the module
    docstring. ``published``: a :class:`StandIn` whose published model's estimate
    to add beside each number. Raises ``ValueError`` for what the config cannot
    run (the errors of ``TrainConfig.check``), a ``RuntimeError`` naming the rank
    whose process failed, ``TimeoutError`` after ``timeout`` seconds per rank."""
    t0 = time.perf_counter()
    layout = _check(config, world_size)
    config = config if config.layout is not None else config.replace(layout=layout)
    ranks = _ranks_asked(rank, world_size, layout)
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if jobs is not None:
        positive_int("jobs", jobs)
    jobs = min(len(ranks), jobs or os.cpu_count() or 1)
    results = _run_ranks(config, world_size, ranks, timeout, jobs)
    report = DryRunReport(config, world_size, layout, published=published)
    for r in ranks:
        out = results[r]
        stage = out["coords"]["pp"]
        report.ranks.append(
            RankReport(
                rank=r,
                coords=out["coords"],
                stage=stage,
                role=_role(layout, stage),
                memory=compare_memory(
                    config,
                    layout,
                    stage,
                    out["memory"],
                    out["step_counter_bytes"],
                    published,
                ),  # fmt: skip
                traffic=compare_traffic(
                    config, layout, stage, out["traffic"], published
                ),
                seconds=out["seconds"],
                steps=out["steps"],
                measurement=out,
            )
        )
    report.seconds = time.perf_counter() - t0
    return report


def _run_ranks(config, world_size, ranks, timeout, jobs) -> dict[int, dict]:
    """The ranks shared round-robin over ``jobs`` spawned processes, each running
    its share one after another (:func:`dtlab.dryrun.child.run_ranks`); every
    process is stopped before this returns or raises."""
    from dtlab.dryrun.child import run_ranks
    from dtlab.launch import process_context

    ctx = process_context()
    results = ctx.Queue()
    shares = [ranks[i::jobs] for i in range(jobs)]
    procs = []  # (process, its ranks still to report, when it last reported)
    out: dict[int, dict] = {}
    try:
        for share in shares:
            p = ctx.Process(
                target=run_ranks, args=(config, world_size, share, results),
                daemon=True, name=f"dtlab-dryrun-{share[0]}",
            )  # fmt: skip
            p.start()
            procs.append([p, list(share), time.monotonic(), None])
        while len(out) < len(ranks):
            try:
                status, r, value = results.get(timeout=0.2)
            except queue_mod.Empty:
                _check_running(procs, timeout)
                continue
            if status == "error":
                message, tb = value
                raise RuntimeError(
                    f"dry run of rank {r} failed: {message}\n--- rank {r} ---\n{tb}"
                )
            out[r] = value
            for entry in procs:
                if r in entry[1]:
                    entry[1].remove(r)
                    entry[2] = time.monotonic()
        return out
    finally:
        for p, *_ in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        results.close()


def _check_running(procs, timeout) -> None:
    """Raise if a process took over ``timeout`` seconds for a rank, or ended with
    ranks unreported (after 2 s: its last reports may still be in the pipe)."""
    now = time.monotonic()
    for entry in procs:
        p, left, since, dead_since = entry
        if not left:
            continue
        if now - since > timeout:
            raise TimeoutError(
                f"the dry run of rank {left[0]} took over {timeout:.0f}s"
            )
        if p.exitcode is not None:
            if dead_since is None:
                entry[3] = now
            elif now - dead_since > 2.0:
                raise RuntimeError(
                    f"the dry run of rank {left[0]} died (exit code {p.exitcode}) "
                    "without reporting"
                )

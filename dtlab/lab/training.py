"""Training on the live cluster, with each step's record streamed to the notebook.

Taught in chapter 02; every later chapter trains through it.

    from dtlab.lab.training import train
    from dtlab.train import TrainConfig

    run = train(cluster, TrainConfig(steps=30), live=True)   # a live loss plot
    run.losses()                  # the global-batch loss per step
    run.records[2][-1]            # rank 2's last record
    run.events                    # every telemetry event of the run, all ranks

``dtlab.train.train`` runs on every engine through ``cluster.run``; each rank
emits a telemetry event of kind ``"step"`` per step, which reaches the notebook
while the run goes on (ipyparallel's data publication) and is handed to the live
figure and to ``on_records``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dtlab.train import TrainConfig, Trainer


@dataclass
class TrainRun:
    """What :func:`train` returns."""

    config: TrainConfig
    records: list[list[dict]]  # records[rank][step]
    events: list[dict] = field(default_factory=list, repr=False)
    live: object | None = field(default=None, repr=False)  # the LiveFigure, if any

    def by_rank(self, key: str) -> dict[int, list]:
        """``{rank: [record[key] per step]}``."""
        return {r: [rec[key] for rec in recs] for r, recs in enumerate(self.records)}

    def losses(self) -> list[float]:
        """The global-batch loss per step (every rank computes the same numbers)."""
        return [rec["loss"] for rec in self.records[0]]


def _train_on_engine(config: TrainConfig) -> list[dict]:
    """Runs on each engine. Reuses the topology the engine made at start (the one
    ``%%px`` cells see) when its layout fits, so that run after run does not pile up
    new process groups."""
    import torch.distributed as dist

    from dtlab.lab import engine

    topo = engine._user_ns().get("topo")
    layout = config.resolve_layout(dist.get_world_size())
    if topo is None or getattr(topo, "released", False) or topo.layout != layout:
        topo = None
    return Trainer(config, topo).fit()


def train(
    cluster,
    config: TrainConfig,
    live: bool = True,
    on_records: Callable[[list[dict]], None] | None = None,
    timeout: float = 600.0,
    *,
    publish_interval: float = 0.1,
    reference: list[float] | None = None,
) -> TrainRun:
    """Train ``config`` on every rank of ``cluster``; return a :class:`TrainRun`.

    ``live=True`` shows a loss plot (one line per rank, ``reference`` losses dashed)
    that updates while the ranks train. ``on_records(batch)`` receives every batch
    of step records as it arrives. ``timeout`` bounds the whole run; an error on a
    rank comes back as :class:`dtlab.launch.RankError` naming it.
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a dtlab.train.TrainConfig, got {config!r}")
    config.check(cluster.world_size)  # fail here, before any engine starts
    figure = None
    if live:
        from dtlab.lab import plots

        figure = plots.LiveFigure(
            plots.loss_figure, min_interval=0.2, reference=reference
        )
        _display(figure.widget)

    def on_events(batch):
        steps = [e for e in batch if e.get("kind") == "step"]
        if not steps:
            return
        if figure is not None:
            figure.update(steps)
        if on_records is not None:
            on_records(steps)

    streaming = live or on_records is not None
    records = cluster.run(
        _train_on_engine,
        config,
        timeout=timeout,
        record=True,
        on_events=on_events if streaming else None,
        publish_interval=publish_interval,
    )
    if figure is not None:
        figure.flush()
    return TrainRun(config, records, list(cluster.last_events), figure)


def _display(widget) -> None:
    """Show ``widget`` in a notebook; outside IPython there is nothing to show."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover
        return
    if get_ipython() is not None:
        display(widget)

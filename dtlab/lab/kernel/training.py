"""Training on the live cluster, with each step's record streamed to the notebook.

Taught in chapter 02; every later chapter trains through it.

    from dtlab.lab.kernel.training import train_on_cluster
    from dtlab.train import TrainConfig

    run = train_on_cluster(cluster, TrainConfig(steps=30))  # a live loss plot
    run.losses()                  # the global-batch loss per step
    run.records[2][-1]            # rank 2's last record
    run.events                    # every telemetry event of the run, all ranks

:class:`dtlab.train.Trainer` runs on every engine through ``cluster.run``
(:func:`dtlab.lab.engine.training.train_rank`); each rank emits a telemetry event
of kind ``"step"`` per step, which reaches the notebook while the run goes on
(ipyparallel's data publication) and is handed to the live figure and to
``on_records``.

Chapter 07's control panel needs a run that does not block the kernel and can be
stopped: :func:`start_run` trains in a background thread and returns a
:class:`LiveRun` at once::

    live = start_run(cluster, config, on_events=dashboard)
    live.stop()          # every rank leaves after the same step
    run = live.wait(60)  # the TrainRun
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dtlab.events import Kind
from dtlab.lab.engine.training import train_rank, train_rank_stoppable
from dtlab.lab.kernel import replicas
from dtlab.train import TrainConfig


@dataclass
class TrainRun:
    """What :func:`train_on_cluster` returns."""

    config: TrainConfig
    records: list[list[dict]]  # records[rank][step]
    events: list[dict] = field(default_factory=list, repr=False)
    live: object | None = field(default=None, repr=False)  # the LiveFigure, if any
    # survive=True: each lost replica and what it cost (dtlab.lab.kernel.replicas)
    lost: list[dict] = field(default_factory=list)
    seconds: float | None = None  # wall-clock time of the whole run

    def by_rank(self, key: str) -> dict[int, list]:
        """``{rank: [record[key] per step]}``."""
        return {r: [rec[key] for rec in recs] for r, recs in enumerate(self.records)}

    def losses(self) -> list[float]:
        """The global-batch loss per step (every rank computes the same numbers)."""
        return [rec["loss"] for rec in self.records[0]]


def train_on_cluster(
    cluster,
    config: TrainConfig,
    live: bool = True,
    on_records: Callable[[list[dict]], None] | None = None,
    timeout: float = 600.0,
    *,
    publish_interval: float = 0.1,
    reference: list[float] | None = None,
    survive: bool = False,
) -> TrainRun:
    """Train ``config`` on every rank of ``cluster``; return a :class:`TrainRun`.

    ``live=True`` shows a loss plot (one line per rank, ``reference`` losses dashed)
    that updates while the ranks train. ``on_records(batch)`` receives every batch
    of step records as it arrives. ``timeout`` bounds the whole run; an error on a
    rank comes back as :class:`dtlab.launch.RankError` naming it. ``survive=True``:
    an engine that dies mid-run is replaced and the run goes on from a replica's
    state, with the losses of a run that never broke (every layout whose ranks'
    states are each held twice; the others are refused here, before any engine
    is touched: :mod:`dtlab.lab.kernel.replicas`); ``run.lost`` says what each loss
    cost.
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a dtlab.train.TrainConfig, got {config!r}")
    config.check(cluster.world_size)  # fail here, before any engine starts
    if survive:
        replicas.check(config, cluster.world_size)
    figure = None
    if live:
        from dtlab.lab.figures.data_parallel import loss_figure
        from dtlab.lab.figures.live import LiveFigure

        figure = LiveFigure(loss_figure, min_interval=0.2, reference=reference)
        _display(figure.widget)

    def on_events(batch):
        steps = [e for e in batch if e.get("kind") == Kind.STEP]
        if not steps:
            return
        if figure is not None:
            figure.update(steps)
        if on_records is not None:
            on_records(steps)

    streaming = live or on_records is not None
    if survive:
        out, lost, seconds = replicas.train_surviving(
            cluster,
            config,
            on_events=on_events if streaming else None,
            timeout=timeout,
            publish_interval=publish_interval,
        )
        records = [o["records"] for o in out]
    else:
        t0 = time.perf_counter()
        records = cluster.run(
            train_rank,
            config,
            timeout=timeout,
            record=True,
            on_events=on_events if streaming else None,
            publish_interval=publish_interval,
        )
        lost, seconds = [], time.perf_counter() - t0
    if figure is not None:
        figure.flush()
    return TrainRun(config, records, list(cluster.last_events), figure, lost, seconds)


def _display(widget) -> None:
    """Show ``widget`` in a notebook; outside IPython there is nothing to show."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover
        return
    if get_ipython() is not None:
        display(widget)


# ---- a run in the background that Stop ends at a step boundary (chapter 07) ----------
#
# The notebook's Run button must not block the kernel: the kernel has to stay free to
# process the Stop click (and to redraw the live figures). So the run's
# ``cluster.run`` call waits in a background thread of the kernel, and Stop reaches
# the engines by a signal (SIGUSR1), on which every rank leaves after the same step
# (dtlab.lab.engine.training.train_rank_stoppable says how). If the ranks do not
# stop within a bound (a rank stuck inside a step), Stop falls back to the
# cluster's interrupt (SIGINT): the run ends with an error on every rank and the
# next run resets the process group by itself.


class LiveRun:
    """A training run going on in a background thread of the kernel; made by
    :func:`start_run`.

    ``stop()`` ends it at a step boundary (every rank after the same step),
    ``wait()`` returns its :class:`TrainRun`. While it runs, ``step``, ``loss`` and
    ``tokens_per_s`` follow the newest record.
    """

    def __init__(
        self, cluster, config, *, on_events, on_done, pace, timeout, publish_interval
    ):
        import threading

        self.cluster = cluster
        self.config = config
        self.pace = float(pace)
        self.timeout = float(timeout)
        self.publish_interval = publish_interval
        self._on_events = on_events
        self._on_done = on_done
        self._lock = threading.Lock()
        self._ready: set[int] = set()  # ranks whose stop handler is in place
        self._signalled: set[int] = set()
        self.stop_requested = False
        self.interrupted = False  # Stop had to fall back to SIGINT
        self.message = ""
        self.step = -1  # newest step seen in a record
        self.loss = float("nan")
        self.tokens_per_s = float("nan")
        self.stopped_at: int | None = None
        self.result: TrainRun | None = None
        self.error: BaseException | None = None
        self.t_start = self.t_end = None  # wall clock (time.time())
        self.rank_t_end: list[float] = []  # when each rank's loop ended
        self._thread = threading.Thread(target=self._main, name="dtlab-run")
        self._thread.daemon = True  # a kernel that exits does not wait for it

    # ---- the background thread --------------------------------------------------
    def _main(self) -> None:
        import time

        self.t_start = time.time()
        try:
            out = self.cluster.run(
                train_rank_stoppable,
                self.config,
                self.pace,
                timeout=self.timeout,
                record=True,
                on_events=self._events,
                publish_interval=self.publish_interval,
            )
            stops = {o["stopped_at"] for o in out}
            if len(stops) != 1:  # the agreement all-reduce makes this impossible
                raise RuntimeError(f"ranks stopped at different steps: {stops}")
            self.stopped_at = stops.pop()
            self.rank_t_end = [o["t_end"] for o in out]
            self.result = TrainRun(
                self.config, [o["records"] for o in out], list(self.cluster.last_events)
            )
            if self.stopped_at is not None:
                self.message = (
                    f"stopped after step {self.stopped_at} on every rank "
                    f"({self.stopped_at + 1} of {self.config.steps} steps)"
                )
        except BaseException as exc:  # noqa: BLE001 - handed to wait() and on_done
            self.error = exc
        finally:
            self.t_end = time.time()
            if self._on_done is not None:
                try:
                    self._on_done(self)
                except BaseException as exc:  # noqa: BLE001 - never lost
                    self.error = self.error or exc

    def _events(self, batch) -> None:
        for e in batch:
            kind = e.get("kind")
            if kind == Kind.CONTROL and e.get("what") == "ready":
                with self._lock:
                    self._ready.add(e["rank"])
                    late = self.stop_requested  # Stop came before this rank was ready
                if late:
                    self._signal([e["rank"]])
            elif kind == Kind.STEP and e["step"] >= self.step:
                self.step = e["step"]
                self.loss = e.get("loss", self.loss)
                t = e.get("time_s") or 0.0
                tokens = self.config.global_batch_size * self.config.model.seq_len
                self.tokens_per_s = e.get("tokens_per_s", tokens / t if t else 0.0)
        if self._on_events is not None:
            self._on_events(batch)

    def _signal(self, ranks) -> None:
        import signal

        with self._lock:
            fresh = [r for r in ranks if r not in self._signalled]
            self._signalled.update(fresh)
        # by pid on this machine, through ipyparallel on another (LabCluster.signal)
        self.cluster.signal(fresh, signal.SIGUSR1)

    # ---- the notebook side ------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 20.0) -> str:
        """Ask every rank to stop after its current step and wait up to ``timeout``
        seconds; if they have not stopped by then, interrupt them (SIGINT) and say
        so. Returns what happened (also in :attr:`message`)."""
        import signal

        if not self.running:
            return self.message or "the run had already finished"
        with self._lock:
            self.stop_requested = True
            ready = sorted(self._ready)
        self._signal(ready)  # ranks not ready yet are signalled when they are
        self._thread.join(timeout)
        if self.running:
            self.interrupted = True
            self.message = (
                f"the ranks did not stop at a step boundary within {timeout:g} s: "
                "they were interrupted (SIGINT); the next run resets the process "
                "group by itself"
            )
            # idle engines ignore SIGINT
            self.cluster.signal(list(self.cluster.pids), signal.SIGINT)
            self._thread.join(max(timeout, 30.0))  # the ranks tear their group down
        return self.message

    def wait(self, timeout: float | None = None) -> TrainRun:
        """Block until the run ends (at most ``timeout`` seconds) and return its
        :class:`TrainRun`; a rank's error is raised here."""
        self._thread.join(timeout)
        if self.running:
            raise TimeoutError(
                f"the run is still going after {timeout} s (step {self.step}): "
                "call stop() or wait longer"
            )
        if self.error is not None and not self.interrupted:
            raise self.error
        return self.result

    def __repr__(self) -> str:
        state = "running" if self.running else ("failed" if self.error else "done")
        return f"<LiveRun {state} step {self.step + 1}/{self.config.steps}>"


def start_run(
    cluster,
    config: TrainConfig,
    *,
    on_events: Callable[[list[dict]], None] | None = None,
    on_done: Callable[[LiveRun], None] | None = None,
    pace: float = 0.0,
    timeout: float = 600.0,
    publish_interval: float = 0.1,
) -> LiveRun:
    """Start training ``config`` on every rank of ``cluster`` in a background thread
    and return at once with a :class:`LiveRun` (``.stop()``, ``.wait()``).

    ``on_events(batch)`` receives the telemetry of every rank while the run goes on
    (steps, comm, compute spans, memory); it runs in the background thread.
    ``on_done(run)`` is called there when the run ends, however it ends. ``pace``
    sleeps that many seconds between steps, so that a person can watch a tiny model
    train. The config is checked first: a bad one raises ``ValueError`` here.
    """
    if not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a dtlab.train.TrainConfig, got {config!r}")
    if pace < 0:
        raise ValueError(f"pace must be >= 0 seconds between steps, got {pace}")
    config.check(cluster.world_size)  # fail here, before any engine starts
    run = LiveRun(
        cluster,
        config,
        on_events=on_events,
        on_done=on_done,
        pace=pace,
        timeout=timeout,
        publish_interval=publish_interval,
    )
    run._thread.start()
    return run

"""Control panels: pick a world size and a parallel layout, press Run, watch.

Taught in chapter 07 (3D parallelism).

    from dtlab.lab.widgets import ControlPanel
    panel = ControlPanel(cluster)        # cluster = dtlab.lab.start(world_size=4)
    panel                                # the panel, with the live dashboard under it
    panel.run_button.click()             # what the Run button does (cells can too)
    panel.wait(timeout=120)              # the finished run (a TrainRun)

The panel offers, for the chosen world size, only the dp × tp × pp factorisations
that fit the model (:meth:`dtlab.topology.Layout.validate`: heads divisible by tp,
layers by pp) and lists the others with the reason they do not fit. Every other
choice (ZeRO stage, pipeline schedule, microbatches, precision, activation
checkpointing) is checked as a whole with :meth:`dtlab.train.TrainConfig.check`
before anything runs: Run stays disabled, and the message says what to change.

Run trains in a background thread of the kernel (:func:`dtlab.lab.training.start_run`),
so the notebook stays responsive and Stop can end the run at a step boundary on every
rank. Errors of a callback (a bad value, a rank that failed) are written into the
panel's ``output`` widget, never swallowed.
"""

from __future__ import annotations

import traceback

from ipywidgets import (
    HTML,
    BoundedIntText,
    Button,
    Dropdown,
    HBox,
    IntProgress,
    Output,
    ToggleButtons,
    VBox,
    Widget,
)

from dtlab.checks import divisors, positive_int
from dtlab.events import CHECKPOINTING, PRECISIONS, SCHEDULES, STRATEGIES
from dtlab.lab import training
from dtlab.lab.figures.dashboard import Dashboard
from dtlab.model import GPTConfig
from dtlab.topology import Layout
from dtlab.train import TrainConfig

DEFAULT_MODEL = GPTConfig(vocab_size=64, seq_len=32, n_layers=4, n_heads=4, d_model=64)


def factorisations(world_size: int) -> list[Layout]:
    """Every ``Layout(dp, tp, pp)`` whose product is ``world_size``, ordered by tp,
    then pp (the order the picker lists them)."""
    positive_int("world_size", world_size)
    return [
        Layout(dp=world_size // (tp * pp), tp=tp, pp=pp)
        for tp in divisors(world_size)
        for pp in divisors(world_size // tp)
    ]


def layout_choices(
    world_size: int, model: GPTConfig
) -> tuple[list[Layout], dict[Layout, str]]:
    """``(valid, invalid)`` layouts of ``world_size`` ranks for ``model``: the
    factorisations :meth:`Layout.validate` accepts, and for each other one the
    message it raises (what does not divide what)."""
    valid, invalid = [], {}
    for layout in factorisations(world_size):
        try:
            layout.validate(world_size, n_layers=model.n_layers, n_heads=model.n_heads)
        except ValueError as exc:
            invalid[layout] = str(exc)
        else:
            valid.append(layout)
    return valid, invalid


class ControlPanel:
    """World size, layout, ZeRO stage, schedule, microbatches, precision and
    checkpointing; Run and Stop; a progress bar; the live dashboard.

    ``cluster``: a running :class:`dtlab.lab.LabCluster` (``None``: Run starts one
    of the chosen world size with :func:`dtlab.lab.start`, which also replaces a
    cluster of another size). ``base``: the config every other field comes from
    (model, batch, learning rate, ...). ``pace``: seconds between steps, so that a
    tiny model trains slowly enough to watch. ``stop_timeout``: how long Stop waits
    for the ranks to reach a step boundary before interrupting them.
    """

    def __init__(
        self,
        cluster=None,
        *,
        base: TrainConfig | None = None,
        world_sizes=(1, 2, 4, 8),
        dashboard: Dashboard | None = None,
        pace: float = 0.0,
        timeout: float = 600.0,
        stop_timeout: float = 20.0,
    ):
        self.cluster = cluster
        self.base = base or TrainConfig(model=DEFAULT_MODEL, steps=20)
        self.pace = pace
        self.timeout = timeout
        self.stop_timeout = stop_timeout
        self.dashboard = dashboard or Dashboard()
        self.live: training.LiveRun | None = None  # the current (or last) run
        self._busy = False  # from Run until the run has ended
        self.runs: list = []  # every finished TrainRun, oldest first
        self.errors: list[BaseException] = []  # every error shown in `output`

        sizes = sorted(set(world_sizes) | ({cluster.world_size} if cluster else set()))
        world = cluster.world_size if cluster is not None else sizes[-1]
        style = {"description_width": "110px"}
        self.world = Dropdown(
            options=sizes, value=world, description="world size", style=style
        )
        self.layout = Dropdown(description="layout", style=style)
        self.invalid = HTML()  # the factorisations that do not fit, and why
        self.strategy = ToggleButtons(
            options=list(STRATEGIES),
            value=self.base.strategy if self.base.strategy in STRATEGIES else "ddp",
            description="dp flavour",
            style={**style, "button_width": "60px"},
            tooltips=[
                "DDP",
                "ZeRO-1: optimizer states sharded",
                "ZeRO-2: + gradients",
                "ZeRO-3 (FSDP): + parameters",
            ],
        )
        self.schedule = Dropdown(
            options=list(SCHEDULES),
            value=self.base.schedule,
            description="schedule",
            style=style,
        )
        self.microbatches = BoundedIntText(
            value=self.base.microbatches or 4,
            min=1,
            max=64,
            description="microbatches",
            style=style,
        )
        self.chunks = BoundedIntText(
            value=self.base.chunks, min=1, max=16, description="chunks (v)", style=style
        )
        self.precision = Dropdown(
            options=list(PRECISIONS),
            value=self.base.precision,
            description="precision",
            style=style,
        )
        self.checkpointing = Dropdown(
            options=list(CHECKPOINTING),
            value=self.base.activation_checkpointing,
            description="checkpointing",
            style=style,
        )
        self.steps = BoundedIntText(
            value=self.base.steps, min=1, max=10_000, description="steps", style=style
        )
        self.run_button = Button(description="Run", button_style="success", icon="play")
        self.stop_button = Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.progress = IntProgress(
            value=0, min=0, max=self.steps.value, description="progress", style=style
        )
        self.status = HTML()
        self.check_message = HTML()
        self.output = Output()  # callback errors land here

        self._guard(self._refresh_layouts)()
        self.world.observe(self._guard(self._refresh_layouts), names="value")
        choices = (
            self.layout,
            self.strategy,
            self.schedule,
            self.microbatches,
            self.chunks,
            self.precision,
            self.checkpointing,
            self.steps,
        )
        for choice in choices:
            choice.observe(self._guard(self.refresh), names="value")
        self.run_button.on_click(self._guard(self.run))
        self.stop_button.on_click(self._guard(self.stop))
        self._box = None

    # ---- errors go to the output widget ------------------------------------------
    def _show_error(self, exc: BaseException) -> None:
        self.errors.append(exc)
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.output.append_stderr(text)

    def _guard(self, fn):
        """``fn`` for a widget callback: an exception is shown in :attr:`output`
        (ipywidgets would otherwise only log it where nobody looks)."""

        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - shown, not swallowed
                self._show_error(exc)
                return None

        call.__name__ = getattr(fn, "__name__", "callback")
        return call

    # ---- the choices ---------------------------------------------------------------
    def _refresh_layouts(self, _change=None) -> None:
        n = self.world.value
        valid, invalid = layout_choices(n, self.base.model)
        old = self.layout.value
        self.layout.options = [(str(lay), lay) for lay in valid]
        self.layout.value = old if old in valid else (valid[0] if valid else None)
        if invalid:
            items = "".join(
                f"<li><code>{lay}</code>: {msg}</li>" for lay, msg in invalid.items()
            )
            self.invalid.value = (
                f"<details><summary>{len(invalid)} layout(s) of {n} ranks do not fit "
                f"this model</summary><ul>{items}</ul></details>"
            )
        else:
            self.invalid.value = ""
        self.refresh()

    @property
    def valid_layouts(self) -> list[Layout]:
        """The layouts the picker offers now."""
        return [value for _, value in self.layout.options]

    def config(self) -> TrainConfig:
        """The :class:`TrainConfig` the widgets describe (``ValueError`` if they
        describe none)."""
        if self.layout.value is None:
            raise ValueError(
                f"no layout of {self.world.value} ranks fits this model: choose "
                "another world size"
            )
        layout = self.layout.value
        changes = dict(
            layout=layout, strategy=self.strategy.value, steps=self.steps.value
        )
        pipelined = layout.pp > 1
        changes.update(
            schedule=self.schedule.value,
            microbatches=self.microbatches.value if pipelined else None,
            chunks=self.chunks.value if pipelined else 1,
            precision=self.precision.value,
            activation_checkpointing=self.checkpointing.value,
        )
        return self.base.replace(**changes)

    def check(self) -> TrainConfig:
        """:meth:`config`, checked against the world size with
        :meth:`TrainConfig.check`."""
        config = self.config()
        config.check(self.world.value)
        return config

    def refresh(self, _change=None) -> None:
        """Check the config the widgets describe again (every widget change does;
        call it after changing :attr:`base`): Run is enabled exactly when
        :meth:`check` passes, and the message says what to change."""
        pp = self.layout.value.pp if self.layout.value is not None else 1
        for w in (self.schedule, self.microbatches, self.chunks):
            w.disabled = pp == 1  # pipeline settings only
        self.progress.max = self.steps.value
        try:
            self.check()
        except (ValueError, NotImplementedError) as exc:
            self.check_message.value = f"<span style='color:#b00'>✗ {exc}</span>"
            self.run_button.disabled = True
            return
        self.check_message.value = "<span style='color:#080'>✓ this config runs</span>"
        self.run_button.disabled = self._busy

    # ---- Run and Stop --------------------------------------------------------------
    def _running_cluster(self):
        n = self.world.value
        if (
            self.cluster is None
            or not self.cluster.running
            or (self.cluster.world_size != n)
        ):
            from dtlab.lab import start

            self.status.value = f"starting {n} engines…"
            self.cluster = start(world_size=n)
        return self.cluster

    def run(self, _button=None) -> training.LiveRun:
        """What Run does: check the config, (re)start the cluster if the world size
        changed, reset the dashboard and start training in the background."""
        if self._busy:
            raise RuntimeError("a run is still going: press Stop, or wait for it")
        config = self.check()
        cluster = self._running_cluster()
        self.dashboard.reset(config, cluster.world_size)
        self.progress.value = 0
        self.progress.max = config.steps
        self.progress.bar_style = ""
        self._busy = True
        self.run_button.disabled = True
        self.stop_button.disabled = False
        self.status.value = f"training {config.resolve_layout(cluster.world_size)}…"
        try:
            self.live = training.start_run(
                cluster,
                config,
                on_events=self._on_events,
                on_done=self._on_done,
                pace=self.pace,
                timeout=self.timeout,
            )
        except BaseException:
            self._busy = False
            self.run_button.disabled, self.stop_button.disabled = False, True
            raise
        return self.live

    def _on_events(self, batch) -> None:
        """In the run's thread: feed the dashboard, move the progress bar."""
        self.dashboard.update(batch)
        live = self.live
        if live is not None and live.step >= 0:
            self.progress.value = min(live.step + 1, self.progress.max)
            self.status.value = (
                f"step {live.step + 1}/{live.config.steps} · loss {live.loss:.4f} · "
                f"{live.tokens_per_s:,.0f} tokens/s"
            )

    def _on_done(self, live: training.LiveRun) -> None:
        """In the run's thread, when it ends however it ends."""
        self.dashboard.flush()
        self._busy = False
        self.stop_button.disabled = True
        if live.error is not None:
            self.progress.bar_style = "warning" if live.interrupted else "danger"
            self.status.value = live.message or f"failed: {type(live.error).__name__}"
            self._show_error(live.error)  # after an interrupt: what each rank saw
        else:
            self.progress.bar_style = (
                "warning" if live.stopped_at is not None else "success"
            )
            self.runs.append(live.result)
            self.status.value = live.message or (
                f"done: {live.config.steps} steps · loss {live.loss:.4f}"
            )
        self.refresh()

    def stop(self, _button=None) -> str:
        """What Stop does: end the run at a step boundary (see
        :meth:`dtlab.lab.training.LiveRun.stop`)."""
        if self.live is None or not self.live.running:
            return "nothing is running"
        self.stop_button.disabled = True
        self.status.value = "stopping at the end of this step…"
        return self.live.stop(self.stop_timeout)  # the status: by _on_done

    def wait(self, timeout: float = 300.0):
        """Wait for the current run (at most ``timeout`` seconds) and return its
        :class:`~dtlab.lab.training.TrainRun`."""
        if self.live is None:
            raise RuntimeError("nothing has run yet: press Run (or call panel.run())")
        return self.live.wait(timeout)

    # ---- display -------------------------------------------------------------------
    @property
    def widget(self) -> Widget:
        if self._box is None:
            choices = HBox(
                [
                    VBox([self.world, self.layout, self.steps]),
                    VBox([self.schedule, self.microbatches, self.chunks]),
                    VBox([self.precision, self.checkpointing]),
                ]
            )
            self._box = VBox(
                [
                    choices,
                    self.strategy,
                    self.invalid,
                    self.check_message,
                    HBox([self.run_button, self.stop_button, self.progress]),
                    self.status,
                    self.output,
                    self.dashboard.widget,
                ]
            )
        return self._box

    def _ipython_display_(self):  # a panel at the end of a cell shows its widget
        from IPython.display import display

        display(self.widget)

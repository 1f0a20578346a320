"""Control panels: pick a world size and a parallel layout, press Run, watch.

Taught in chapter 07 (3D parallelism).

    from dtlab.lab.widgets import ControlPanel
    panel = ControlPanel(cluster)        # cluster = dtlab.lab.start(world_size=4)
    panel                                # the panel, with the live dashboard under it
    panel.run_button.click()             # what the Run button does (cells can too)
    panel.wait(timeout=120)              # the finished run (a TrainRun)

The panel offers, for the chosen world size, only the dp × tp × pp factorisations
that fit the model (:meth:`dtlab.topology.Layout.validate`: heads divisible by tp,
layers by pp) and lists the others with the reason they do not fit. With
``beyond_3d=True`` (chapter 11) it offers the 4D and 5D layouts too, every cp and ep
of the world (:func:`dtlab.topology.factorisations`), each checked as a whole
config (:meth:`dtlab.train.TrainConfig.check`: what cp and ep compose with, the
sequence and heads a cp variant needs, experts divisible by ep), and a cp-variant
choice (ring attention or Ulysses); its default model is then a mixture of four
experts. Every other
choice (ZeRO stage, pipeline schedule, microbatches, precision, activation
checkpointing) is checked as a whole with :meth:`dtlab.train.TrainConfig.check`
before anything runs: Run stays disabled, and the message says what to change.

Run trains in a background thread of the kernel
(:func:`dtlab.lab.kernel.training.start_run`), so the notebook stays responsive and
Stop can end the run at a step boundary on every
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

from dtlab.events import CHECKPOINTING, CP_VARIANTS, PRECISIONS, SCHEDULES, STRATEGIES
from dtlab.lab.figures.dashboard import Dashboard
from dtlab.lab.kernel import training
from dtlab.model import GPTConfig
from dtlab.topology import Layout, factorisations
from dtlab.train import TrainConfig

__all__ = ["ControlPanel", "layout_choices", "factorisations", "DEFAULT_MODEL"]

DEFAULT_MODEL = GPTConfig(vocab_size=64, seq_len=32, n_layers=4, n_heads=4, d_model=64)
MOE_MODEL = GPTConfig(n_layers=2, n_heads=4, d_model=64, n_experts=4, top_k=2)
"""The beyond-3D panel's default: four experts, so ep can be 2 or 4."""


def layout_choices(
    world_size: int,
    model: GPTConfig,
    *,
    beyond_3d: bool = False,
    config: TrainConfig | None = None,
) -> tuple[list[Layout], dict[Layout, str]]:
    """``(valid, invalid)`` layouts of ``world_size`` ranks for ``model``: the
    factorisations :meth:`Layout.validate` accepts, and for each other one the
    message it raises (what does not divide what). ``beyond_3d``: every cp and ep
    too; ``config`` (with ``model``): also checked as a whole with
    :meth:`TrainConfig.check`, whose message then says why a layout does not fit
    (what cp and ep compose with)."""
    valid, invalid = [], {}
    for layout in factorisations(world_size, beyond_3d=beyond_3d):
        try:
            layout.validate(world_size, n_layers=model.n_layers, n_heads=model.n_heads)
            if config is not None:
                config.replace(model=model, layout=layout).check(world_size)
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
    for the ranks to reach a step boundary before interrupting them. ``beyond_3d``:
    offer the cp and ep layouts and the cp variant (chapter 11; the default model is
    then :data:`MOE_MODEL`).
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
        beyond_3d: bool = False,
    ):
        self.cluster = cluster
        self.beyond_3d = beyond_3d
        model = MOE_MODEL if beyond_3d else DEFAULT_MODEL
        self.base = base or TrainConfig(model=model, steps=20)
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
        self.cp_variant = ToggleButtons(
            options=list(CP_VARIANTS),
            value=self.base.cp_variant,
            description="cp variant",
            style={**style, "button_width": "70px"},
            tooltips=[
                "ring attention: K/V blocks go round the cp ring (isend/irecv)",
                "Ulysses: all-to-all from sequence- to head-sharded and back",
            ],
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
        if beyond_3d:
            # the layouts' fit is checked with the whole config: a new choice can
            # change which layouts fit (ZeRO with ep, a cp variant's seq_len)
            for choice in (self.strategy, self.cp_variant, self.checkpointing):
                choice.observe(self._guard(self._refresh_layouts), names="value")
        for choice in (*choices, self.cp_variant):
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
        valid, invalid = layout_choices(
            n,
            self.base.model,
            beyond_3d=self.beyond_3d,
            config=self._choices(self.base) if self.beyond_3d else None,
        )
        old = self.layout.value
        self.layout.options = [(str(lay), lay) for lay in valid]
        self.layout.value = old if old in valid else (valid[0] if valid else None)
        if invalid:
            what = " and these choices" if self.beyond_3d else ""
            items = "".join(
                f"<li><code>{lay}</code>: {msg}</li>" for lay, msg in invalid.items()
            )
            self.invalid.value = (
                f"<details><summary>{len(invalid)} layout(s) of {n} ranks do not fit "
                f"this model{what}</summary><ul>{items}</ul></details>"
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
        pipelined = layout.pp > 1
        return self._choices(self.base).replace(
            layout=layout,
            schedule=self.schedule.value,
            microbatches=self.microbatches.value if pipelined else None,
            chunks=self.chunks.value if pipelined else 1,
        )

    def _choices(self, config: TrainConfig) -> TrainConfig:
        """``config`` with the choices that do not depend on the layout."""
        return config.replace(
            strategy=self.strategy.value,
            steps=self.steps.value,
            precision=self.precision.value,
            activation_checkpointing=self.checkpointing.value,
            cp_variant=self.cp_variant.value,
        )

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
        cp = self.layout.value.cp if self.layout.value is not None else 1
        self.cp_variant.disabled = cp == 1
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
        :meth:`dtlab.lab.kernel.training.LiveRun.stop`)."""
        if self.live is None or not self.live.running:
            return "nothing is running"
        self.stop_button.disabled = True
        self.status.value = "stopping at the end of this step…"
        return self.live.stop(self.stop_timeout)  # the status: by _on_done

    def wait(self, timeout: float = 300.0):
        """Wait for the current run (at most ``timeout`` seconds) and return its
        :class:`~dtlab.lab.kernel.training.TrainRun`."""
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
                    *([self.cp_variant] if self.beyond_3d else []),
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

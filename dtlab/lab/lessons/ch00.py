"""Chapter 00's lesson helpers: the chapter's figures, the memory calculator and the
"how many GPUs until it fits" table (``notebooks/00_why_distribute.ipynb``).

:func:`bill_figure` draws what one device would hold to train each model alone,
:func:`activation_figure` the activation bytes against the sequence length under
each recomputation mode. :class:`MemoryCalculator` is the chapter's widget: a model,
a precision policy, an optimizer, a number of data-parallel GPUs, a GPU type, a
microbatch and a recomputation mode in; one stacked bar per ZeRO stage out, priced
by :func:`dtlab.estimate.memory_per_device`, with the GPU's memory as a dashed line.
Its controls are attributes, so the chapter's claims (``tests/claims/ch00.py``) can
move them the way a learner would and read back what the figure shows.
"""

from __future__ import annotations

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab import estimate as est
from dtlab.estimate import GB
from dtlab.exercises.ch00_memory import fitting_gpus

__all__ = [
    "CATEGORIES",
    "COLORS",
    "STAGES",
    "MemoryCalculator",
    "activation_figure",
    "bill_figure",
    "fit_table",
]

CATEGORIES = ["params", "grads", "optimizer", "activations"]
COLORS = {
    "params": "#4c78a8",
    "grads": "#f58518",
    "optimizer": "#54a24b",
    "activations": "#b279a2",
}
STAGES = [0, 1, 2, 3]


def bill_figure(bill: dict, models, gpu: str = "H100-80GB") -> go.Figure:
    """One panel per model: the bytes one device holds to train it alone under each
    precision policy (``bill[model, precision]`` from
    :func:`dtlab.estimate.memory_per_device`), stacked by kind, with ``gpu``'s
    memory as a dashed line."""
    fig = make_subplots(
        rows=1, cols=len(models), subplot_titles=[est.MODELS[k].name for k in models]
    )
    for col, key in enumerate(models, start=1):
        for cat in CATEGORIES:
            fig.add_bar(
                x=list(est.STATE_PRECISIONS),
                y=[bill[key, p][cat] / GB for p in est.STATE_PRECISIONS],
                name=cat,
                marker_color=COLORS[cat],
                legendgroup=cat,
                showlegend=col == 1,
                row=1,
                col=col,
            )
        fig.add_hline(
            y=est.GPUS[gpu].memory_bytes / GB, line_dash="dash", row=1, col=col
        )
    fig.update_layout(
        barmode="stack",
        height=420,
        yaxis_title="GB on one device (1 GB = 1e9 B)",
        title="Training memory on a single device, Adam, microbatch 1",
    )
    return fig


def activation_figure(seq_lens, acts: dict, model: str = "7B") -> go.Figure:
    """Activation GB against the sequence length (log-log), one line per
    recomputation mode (``acts[mode]``: one value per entry of ``seq_lens``)."""
    fig = go.Figure(
        [
            go.Scatter(x=seq_lens, y=ys, name=f"recompute={mode}", mode="lines+markers")
            for mode, ys in acts.items()
        ]
    )
    fig.update_layout(
        xaxis_type="log",
        yaxis_type="log",
        height=380,
        xaxis_title="sequence length s",
        yaxis_title=f"activation GB ({model}, b = 1)",
        title="Korthikanti et al. 2022: s·b·h·(34 + 5·a·s/h) per layer",
    )
    return fig


def custom_preset(n_layers: int, d_model: int) -> est.ModelPreset:
    """A GPT-3-style shape: 4h MLP, 128-wide heads, 32k vocabulary, 4k context."""
    return est.ModelPreset(
        f"custom L={n_layers} h={d_model}",
        n_layers,
        d_model,
        max(1, d_model // 128),
        32000,
        4096,
        4 * d_model,
        gated_mlp=False,
    )


class MemoryCalculator:
    """Memory per device under each ZeRO stage, for the model and hardware chosen.

    The stage picked is drawn solid, the others pale; ``summary`` says whether it
    fits. A callback that raises shows its traceback under the figure and is kept in
    ``failures``."""

    def __init__(self, model: str = "70B", gpus: int = 8, gpu: str = "H100-80GB"):
        self.model = W.Dropdown(
            options=[*est.MODELS, "custom"], value=model, description="model"
        )
        self.layers = W.IntSlider(
            value=32, min=2, max=128, step=2, description="layers"
        )
        self.width = W.SelectionSlider(
            options=[1024, 2048, 4096, 5120, 8192, 12288, 16384],
            value=4096,
            description="d_model",
        )
        self.precision = W.Dropdown(
            options=est.STATE_PRECISIONS, value="mixed", description="precision"
        )
        self.optimizer = W.Dropdown(
            options=est.OPTIMIZERS, value="adam", description="optimizer"
        )
        self.gpus = W.SelectionSlider(
            options=[2**k for k in range(13)], value=gpus, description="GPUs (DP)"
        )
        self.stage = W.ToggleButtons(
            options=STAGES,
            value=0,
            description="ZeRO stage",
            style={"button_width": "40px"},
        )
        self.gpu = W.Dropdown(options=list(est.GPUS), value=gpu, description="GPU")
        self.micro_batch = W.IntSlider(value=1, min=1, max=16, description="microbatch")
        self.recompute = W.Dropdown(
            options=["none", "selective", "full"],
            value="selective",
            description="recompute",
        )
        self.summary = W.HTML()
        self.errors = W.Output()
        self.failures: list[Exception] = []
        self.figure = self._figure()
        self.memory: dict[int, dict] = {}
        for control in self.controls:
            control.observe(self._on_change, names="value")
        self.update()
        self.widget = W.VBox(
            [
                W.HBox(
                    [
                        W.VBox(
                            [
                                self.model,
                                self.layers,
                                self.width,
                                self.precision,
                                self.optimizer,
                            ]
                        ),
                        W.VBox([self.gpus, self.gpu, self.micro_batch, self.recompute]),
                    ]
                ),
                self.stage,
                self.summary,
                self.figure,
                self.errors,
            ]
        )

    @property
    def controls(self) -> list:
        return [
            self.model,
            self.layers,
            self.width,
            self.precision,
            self.optimizer,
            self.gpus,
            self.stage,
            self.gpu,
            self.micro_batch,
            self.recompute,
        ]

    def _figure(self) -> go.FigureWidget:
        line = dict(type="line", xref="paper", x0=0, x1=1, y0=0, y1=0)
        label = dict(xref="paper", x=1, y=0, text="", showarrow=False)
        return go.FigureWidget(
            data=[
                go.Bar(
                    name=c,
                    x=[f"ZeRO-{s}" for s in STAGES],
                    y=[0] * len(STAGES),
                    marker_color=COLORS[c],
                )
                for c in CATEGORIES
            ],
            layout=go.Layout(
                barmode="stack",
                height=420,
                yaxis_title="GB per device",
                shapes=[{**line, "line": dict(dash="dash", color="black")}],
                annotations=[{**label, "xanchor": "right", "yanchor": "bottom"}],
            ),
        )

    def preset(self) -> est.ModelPreset:
        """The model the controls describe."""
        if self.model.value == "custom":
            return custom_preset(self.layers.value, self.width.value)
        return est.MODELS[self.model.value]

    def shown_gb(self, stage: int) -> float:
        """What the figure draws for ``stage``: its bar's height in GB."""
        return sum(trace.y[STAGES.index(stage)] for trace in self.figure.data)

    @property
    def fits(self) -> bool:
        return "does not fit" not in self.summary.value

    def update(self, change=None) -> None:
        preset, gpu = self.preset(), est.GPUS[self.gpu.value]
        self.memory = {
            s: est.memory_per_device(
                preset,
                world_size=self.gpus.value,
                stage=s,
                precision=self.precision.value,
                optimizer=self.optimizer.value,
                micro_batch=self.micro_batch.value,
                recompute=self.recompute.value,
            )
            for s in STAGES
        }
        capacity = gpu.memory_bytes / GB
        fig = self.figure
        with fig.batch_update():  # one redraw for all the changes below
            for trace, cat in zip(fig.data, CATEGORIES):
                trace.y = [self.memory[s][cat] / GB for s in STAGES]
                trace.marker.opacity = [
                    1.0 if s == self.stage.value else 0.35 for s in STAGES
                ]
            fig.layout.shapes[0].update(y0=capacity, y1=capacity)
            fig.layout.annotations[0].update(
                y=capacity, text=f"{gpu.name}: {capacity:.0f} GB"
            )
            fig.layout.title.text = (
                f"{preset.name}: {preset.n_params / 1e9:.1f}B parameters "
                f"on {self.gpus.value} GPUs"
            )
        total = self.memory[self.stage.value]["total"] / GB
        verdict = "fits" if total <= capacity else "does not fit"
        self.summary.value = (
            f"ZeRO-{self.stage.value}: <b>{total:,.1f} GB</b> per device of "
            f"{capacity:.0f} GB, <b>{verdict}</b>"
        )
        custom = self.model.value == "custom"
        self.layers.layout.display = self.width.layout.display = (
            None if custom else "none"
        )

    def _on_change(self, change) -> None:
        self.errors.clear_output()
        try:
            self.update(change)
        except Exception as exc:
            self.failures.append(exc)
            with self.errors:  # the traceback shows under the figure, not in a log
                raise


def fit_table(models=("7B", "13B", "70B", "405B"), gpu: str = "H100-80GB") -> str:
    """The fewest GPUs on which each model's mixed-precision Adam states fit under
    each ZeRO stage (``-``: none), as text."""
    memory = est.GPUS[gpu].memory_bytes
    rows = [
        f"{'':>5}" + "".join(f"{'ZeRO-' + str(s):>9}" for s in STAGES) + f"   ({gpu})"
    ]
    for key in models:
        psi = est.MODELS[key].n_params
        cells = [fitting_gpus(psi, memory, s) for s in STAGES]
        rows.append(f"{key:>5}" + "".join(f"{str(c) if c else '-':>9}" for c in cells))
    return "\n".join(rows)

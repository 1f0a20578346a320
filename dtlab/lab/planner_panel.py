"""The planner panel: a model, a GPU, a cluster and a batch in; the layouts that
fit out, with their memory per device and step time, and why the others do not.

Taught in chapter 09 (planning at scale).

    from dtlab.lab.planner_panel import PlannerPanel
    panel = PlannerPanel(model="70B", n_gpus=8)
    panel                          # controls, the figure and the table
    plan = panel.update(n_gpus=16, inter_GBps=12.5)   # what editing the boxes does

Every number comes from :func:`dtlab.estimate.plan`; the panel only turns its
assumptions into widgets. :meth:`PlannerPanel.update` sets any of them from code
(the notebook's checks call it, no clicks needed) and returns the new plan.
"""

from __future__ import annotations

import html
import traceback

import plotly.graph_objects as go
from ipywidgets import (
    HTML,
    Button,
    Checkbox,
    Dropdown,
    FloatSlider,
    FloatText,
    HBox,
    IntText,
    Output,
    VBox,
)
from plotly.subplots import make_subplots

from dtlab import estimate
from dtlab.events import PRECISIONS
from dtlab.lab.figures.base import MEMORY_COLORS
from dtlab.lab.figures.live import LiveFigure

__all__ = ["PlannerPanel", "plan_figure", "plan_table_html"]

PLAN_CATEGORIES = ("params", "grads", "optimizer", "activations")  # a PlanRow's
TIME_COLORS = {"compute_s": "#4c78a8", "comm_s": "#f58518", "bubble_s": "#bab0ac"}
CUSTOM = "custom"
SHAPE = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")  # a model's
# the widgets :meth:`PlannerPanel.update` may set, by name
SETTINGS = (
    "model",
    *SHAPE,
    *("gpu_GB", "tflops", "n_gpus", "gpus_per_node", "intra_GBps", "inter_GBps"),
    *("global_batch", "precision", "kernel_efficiency", "offload"),
    *("context_parallel", "expert_parallel"),
)


def _label(row: estimate.PlanRow) -> str:
    knobs = f"Z{row.zero_stage} b{row.micro_batch_size} {row.checkpointing[:3]}"
    return f"{row.layout}<br>{knobs}"


def plan_figure(plan: estimate.Plan, n: int = 8, title: str | None = None) -> go.Figure:
    """The ``n`` fastest layouts that fit: bytes per device by category (stacked,
    with the usable memory as a line) and the step time split into compute,
    exposed communication and pipeline bubble."""
    rows = plan.fits[:n]
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("memory per device (GB)", "step time (s)"),
        horizontal_spacing=0.12,
    )
    labels = [_label(r) for r in rows]
    for cat in PLAN_CATEGORIES:
        color = MEMORY_COLORS[cat]
        fig.add_trace(
            go.Bar(
                x=labels,
                y=[r.memory[cat] / estimate.GB for r in rows],
                name=cat,
                marker_color=color,
                legendgroup="memory",
            ),
            row=1,
            col=1,
        )
    if rows:
        usable = plan.assumptions["usable_GB"]
        fig.add_hline(y=usable, line_dash="dash", line_color="black", row=1, col=1)
    for key, color in TIME_COLORS.items():
        fig.add_trace(
            go.Bar(
                x=labels,
                y=[getattr(r, key) for r in rows],
                name=key[:-2],
                marker_color=color,
                legendgroup="time",
            ),
            row=1,
            col=2,
        )
    a = plan.assumptions
    fig.update_layout(
        barmode="stack",
        height=420,
        title=title
        or f"{a['model']} on {a['n_gpus']} × {a['gpu']}: "
        f"{len(plan.fits)} layouts fit, {len(plan.rejected)} do not",
        margin=dict(t=70, b=40),
    )
    return fig


def plan_table_html(plan: estimate.Plan, n: int = 8, n_rejected: int = 4) -> str:
    """The fastest layouts as an HTML table, then a few rejected ones and why."""
    cols = ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "m", "checkpointing")
    nums = ("total_GB", "step_s", "compute_s", "comm_s", "bubble_s", "mfu")
    head = "".join(f"<th>{c}</th>" for c in (*cols, *nums, "TFLOP/s"))
    body = []
    for row in plan.table(n):
        cells = [str(row[c]) for c in cols]
        cells += [f"{row[c]:.2f}" if c != "mfu" else f"{row[c]:.0%}" for c in nums]
        cells.append(f"{row['tflops_per_gpu']:.0f}")  # achieved, per GPU
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out = [f"<table><tr>{head}</tr>{''.join(body)}</table>"]
    if not plan.fits:
        out.append("<p><b>Nothing fits.</b></p>")
    if plan.rejected and n_rejected:
        out.append("<p>Rejected (closest to fitting first):</p><ul>")
        for row in plan.rejected[:n_rejected]:
            out.append(
                f"<li>{html.escape(str(row.layout))}, ZeRO-{row.zero_stage}, "
                f"{row.checkpointing} checkpointing: {html.escape(row.why)}</li>"
            )
        out.append("</ul>")
    return "".join(out)


class PlannerPanel:
    """Widgets for every assumption of :func:`dtlab.estimate.plan`, a figure and a
    table. Press *Plan* (or call :meth:`update`) to recompute; callback errors are
    printed into :attr:`output`."""

    def __init__(
        self,
        model: str = "70B",
        *,
        gpu: str = "H100-80GB",
        n_gpus: int = 8,
        gpus_per_node: int = 8,
        global_batch: int = 64,
        precision: str = "bf16",
        kernel_efficiency: float = 0.5,
        offload: bool = False,
        n_rows: int = 8,
    ):
        base = estimate.GPUS[gpu]
        self._base_gpu = base
        names = [*estimate.MODELS, *estimate.MOE_MODELS, CUSTOM]
        s = dict(style={"description_width": "initial"})
        self.n_rows = n_rows
        self.model = Dropdown(options=names, value=model, description="model", **s)
        first = estimate.model_spec(model if model != CUSTOM else "7B")
        self.n_layers = IntText(first.n_layers, description="layers", **s)
        self.d_model = IntText(first.d_model, description="hidden", **s)
        self.n_heads = IntText(first.n_heads, description="heads", **s)
        self.vocab_size = IntText(first.vocab_size, description="vocab", **s)
        self.seq_len = IntText(first.seq_len, description="sequence", **s)
        self.gpu_GB = FloatText(
            base.memory_bytes / estimate.GB, description="GPU GB", **s
        )
        self.tflops = FloatText(base.peak_bf16_flops / 1e12, description="TFLOP/s")
        self.n_gpus = IntText(n_gpus, description="GPUs", **s)
        self.gpus_per_node = IntText(gpus_per_node, description="per node", **s)
        # the GPU's own NVLink, each way (an A100's 300, an H100's 450)
        intra = estimate.gpu_link(base).bandwidth_Bps / estimate.GB
        self.intra_GBps = FloatText(intra, description="intra GB/s", **s)
        self.inter_GBps = FloatText(50.0, description="inter GB/s", **s)
        self.global_batch = IntText(global_batch, description="global batch", **s)
        self.precision = Dropdown(
            options=[*PRECISIONS, "pure_bf16"],  # pure_bf16: no fp32 master copy
            value=precision,
            description="precision",
            **s,
        )
        # the matmuls' share of peak: an input; each layout's MFU is an output
        self.kernel_efficiency = FloatSlider(
            value=kernel_efficiency, min=0.1, max=0.9, step=0.05,
            description="kernel efficiency", **s,
        )  # fmt: skip
        self.offload = Checkbox(value=offload, description="ZeRO-Offload")
        self.context_parallel = Checkbox(value=False, description="try cp")
        self.expert_parallel = Checkbox(value=False, description="try ep")
        self.button = Button(description="Plan", button_style="primary")
        self.output = Output()
        self.table = HTML()
        self.live = LiveFigure(figure=plan_figure(estimate.Plan([], [], _EMPTY)))
        self.figure = self.live.widget
        self.plan: estimate.Plan | None = None
        self.model.observe(self._on_model, names="value")
        self.button.on_click(lambda _: self._safe_update())
        custom = HBox([getattr(self, name) for name in SHAPE])
        hardware = HBox([self.gpu_GB, self.tflops, self.n_gpus, self.gpus_per_node])
        network = HBox([self.intra_GBps, self.inter_GBps, self.global_batch])
        knobs = HBox(
            [
                self.precision,
                self.kernel_efficiency,
                self.offload,
                self.context_parallel,
                self.expert_parallel,
            ]
        )
        self.widget = VBox(
            [
                HBox([self.model, self.button]),
                custom,
                hardware,
                network,
                knobs,
                self.figure,
                self.table,
                self.output,
            ]
        )
        self.update()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    # ---- reading the widgets ---------------------------------------------------
    def _on_model(self, change) -> None:
        if change["new"] == CUSTOM:
            return
        spec = estimate.model_spec(change["new"])
        for name in SHAPE:
            getattr(self, name).value = getattr(spec, name)

    def spec(self) -> estimate.ModelPreset:
        """The model as the widgets describe it: a preset, with its sequence length
        (and, for ``custom``, its shape) taken from the boxes."""
        shape = {name: getattr(self, name).value for name in SHAPE}
        if self.model.value == CUSTOM:
            return estimate.model_spec(shape)
        spec = estimate.model_spec(self.model.value)
        changed = {k: v for k, v in shape.items() if getattr(spec, k) != v}
        if not changed:
            return spec
        import dataclasses

        d_ff = spec.d_ff * shape["d_model"] // spec.d_model  # keep the ratio
        return dataclasses.replace(spec, **changed, d_ff=d_ff, name=spec.name + "*")

    def settings(self) -> dict:
        """The keyword arguments :func:`dtlab.estimate.plan` gets."""
        base = self._base_gpu
        gpu = estimate.GPU(
            f"{self.gpu_GB.value:g} GB GPU",
            self.gpu_GB.value * estimate.GB,
            self.tflops.value * 1e12,
            base.hbm_Bps,  # what the memory-bound passes of recomputation stream at
            self.intra_GBps.value * 2 * estimate.GB,
        )
        # the boxes set each link's bandwidth; its latency stays the preset's
        intra, inter = estimate.LINKS["nvlink"], estimate.LINKS["infiniband"]
        cluster = estimate.ClusterSpec(
            self.n_gpus.value,
            gpus_per_node=self.gpus_per_node.value,
            intra=estimate.Link(
                "intra-node", self.intra_GBps.value * estimate.GB, intra.alpha_s
            ),
            inter=estimate.Link(
                "inter-node", self.inter_GBps.value * estimate.GB, inter.alpha_s
            ),
        )
        return dict(
            gpu=gpu,
            cluster=cluster,
            global_batch=self.global_batch.value,
            precision=self.precision.value,
            kernel_efficiency=self.kernel_efficiency.value,
            offload=self.offload.value,
            cp_options=(1, 2, 4, 8) if self.context_parallel.value else (1,),
            ep_options=(1, 2, 4, 8) if self.expert_parallel.value else (1,),
        )

    # ---- recomputing -------------------------------------------------------------
    def update(self, **changes) -> estimate.Plan:
        """Set widgets by name (``n_gpus=16``, ``inter_GBps=12.5``,
        ``model="405B"``...), recompute, redraw; returns the plan. Raises
        ``ValueError`` for a name that is not a widget of the panel."""
        for name, value in changes.items():
            if name not in SETTINGS:
                raise ValueError(
                    f"{name!r} is not a setting of the planner panel: use one of "
                    f"{list(SETTINGS)}"
                )
            getattr(self, name).value = value
        self.plan = estimate.plan(self.spec(), **self.settings())
        self.live.draw(plan_figure(self.plan, self.n_rows))
        self.table.value = plan_table_html(self.plan, self.n_rows)
        return self.plan

    def _safe_update(self) -> None:
        self.output.clear_output()
        with self.output:
            try:
                self.update()
            except Exception:  # shown in the panel, not lost in a callback
                traceback.print_exc()


_EMPTY = {"model": "", "n_gpus": 0, "gpu": "", "usable_GB": 0.0}

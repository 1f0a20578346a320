"""Chapter 05's lesson helpers (``notebooks/05_pipeline_parallel.ipynb``): the
questions the chapter asks the learner to predict; :func:`idle_by_stage`, which
splits each stage's idle time of a timeline into before its first compute, between
computes and after its last; and the explorer of section 6, which runs the schedule
a learner picks on the engines and draws the measured step under the simulated
ideal, with the bubble and the microbatches each stage held, and checks that the
executor ran exactly what the schedule says.

Runs in the notebook's kernel; the pipeline run itself (``run_fn``) is the chapter's
own function, shipped to the engines by the cluster.
"""

from __future__ import annotations

import statistics

import ipywidgets as W

from dtlab import estimate, pipeline
from dtlab.events import SCHEDULES, schedule_name
from dtlab.lab.figures.pipeline import pipeline_ideal_vs_measured
from dtlab.lab.lessons.confirm import confirm
from dtlab.lab.predictions import Question
from dtlab.topology import Layout

__all__ = ["QUESTIONS", "PipelineExplorer", "idle_by_stage", "per_microbatch"]

QUESTIONS = [
    Question(
        "pp_bubble_1f1b",
        "05",
        "the share of a 1F1B step each stage spends idle at p=4, m=8 (the bubble), "
        "measured on the four engines",
        "fraction",
    ),
    Question(
        "pp_1f1b_activation_share",
        "05",
        "stage 0's peak activation bytes under 1F1B as a share of GPipe's "
        "(p=4, m=8, the same microbatches)",
        "fraction",
    ),
]


def idle_by_stage(spans) -> list[dict]:
    """Each stage's idle time in a timeline (``pipeline.simulate``'s or a measured
    one), in three parts: ``before`` its first compute, ``between`` computes and
    ``after`` its last, until the step ends (the last compute on any stage);
    ``total`` is their sum."""
    computes = [e for e in spans if e["name"] in ("F", "B", "W")]
    end = max(e["t_end"] for e in computes)
    start = min(e["t_start"] for e in computes)
    rows = []
    for stage in sorted({e["stage"] for e in computes}):
        mine = sorted(
            (e for e in computes if e["stage"] == stage), key=lambda e: e["t_start"]
        )
        before = mine[0]["t_start"] - start
        between = sum(b["t_start"] - a["t_end"] for a, b in zip(mine, mine[1:]))
        after = end - mine[-1]["t_end"]
        rows.append(
            dict(
                stage=stage,
                before=before,
                between=between,
                after=after,
                total=before + between + after,
            )
        )
    return rows


def per_microbatch(spans, name: str, v: int) -> float:
    """Median seconds of one microbatch's ``name`` span (F, B or W) through one
    stage; a chunk does 1/v of it."""
    times = [e["t_end"] - e["t_start"] for e in spans if e["name"] == name]
    return statistics.median(times) * v if times else 0.0


class PipelineExplorer:
    """Controls for stages p, microbatches m, the schedule and chunks v. Every
    change runs ``run_fn(config, schedule, p, m, v, steps=2)`` on every rank with
    telemetry on (step 0 warms up, step 1 is drawn) and shows the measured step
    under the ideal one :func:`dtlab.pipeline.simulate` plays with the measured
    median t_f and t_b. ``run_fn`` returns ``{"stats": Pipeline.step's}``."""

    def __init__(self, cluster, run_fn, config):
        self.cluster, self.run_fn, self.config = cluster, run_fn, config
        self.p = W.ToggleButtons(options=[2, 4], value=4, description="stages p")
        self.m = W.IntSlider(value=8, min=1, max=16, description="microbatches m")
        self.schedule = W.Dropdown(
            options=list(SCHEDULES), value="1f1b", description="schedule"
        )
        self.v = W.ToggleButtons(options=[1, 2], value=1, description="chunks v")
        self.status = W.HTML()
        self.view = W.Output()
        self.last: dict = {}  # the latest run
        self.failures: list[Exception] = []
        self._quiet = False  # set while verify() moves several controls at once
        for w in (self.p, self.m, self.schedule, self.v):
            w.observe(self._on_change, names="value")

    def _ipython_display_(self):
        from IPython.display import display

        display(
            W.VBox(
                [
                    W.HBox([self.p, self.v]),
                    W.HBox([self.m, self.schedule]),
                    self.status,
                    self.view,
                ]
            )
        )

    def _on_change(self, change=None) -> None:
        if not self._quiet:
            self.run()

    def run(self) -> dict:
        """One recorded run at the controls' setting, drawn under them; returns
        :attr:`last` (empty when the setting cannot run: the status says why)."""
        p, m, name = self.p.value, self.m.value, self.schedule.value
        self.measure(p, m, name, self.v.value)
        if self.last:
            self._draw()
        return self.last

    def measure(self, p: int, m: int, name: str, v: int = 1) -> dict:
        """One recorded run of schedule ``name`` at p, m (and v chunks when
        interleaved), without touching the controls or the figure; returns
        :attr:`last`, with the ideal and measured bubble and each stage's peak."""
        v = v if name == "interleaved" else 1
        self.last = {}
        try:
            schedule = pipeline.make_schedule(name, p, m, v)
            v = schedule.v  # 2 for the V schedules
            Layout(pp=p).validate(
                n_layers=self.config.n_layers, chunks=v, microbatches=m, schedule=name
            )
        except ValueError as exc:
            self.status.value = f"<b>not runnable:</b> {exc}"
            return self.last
        try:
            results = self.cluster.run(
                self.run_fn, self.config, name, p, m, v, 2, record=True, timeout=120
            )
        except Exception as exc:  # noqa: BLE001 - shown, and seen by verify()
            self.failures.append(exc)
            self.status.value = f"<b>error:</b> {exc}"
            return self.last
        measured = pipeline.measured_timeline(self.cluster.last_events, replica=0)
        t_f = per_microbatch(measured, "F", v)
        t_w = per_microbatch(measured, "W", v)
        t_b = per_microbatch(measured, "B", v) + t_w
        ideal = pipeline.simulate(schedule, t_f, t_b, t_w=t_w or None)
        b_ideal, b_meas = pipeline.bubble(ideal), pipeline.bubble(measured)
        bound = [max(t) for t in pipeline.in_flight(schedule)]
        dp = 4 // p  # the first replica's stages are ranks 0, dp, 2·dp, ...
        peaks = [res["stats"]["peak_in_flight"] for res in results[: p * dp : dp]]
        if schedule_name(name) == "zb_h1":  # (p−1)(t_f + t_B − t_W)
            formula = (p - 1) * (t_f + t_b - 2 * t_w) / max(e["t_end"] for e in ideal)
        elif schedule.placement == "v":  # the start-up bound, (p−1)·t_f/2
            formula = (p - 1) * t_f / 2 / max(e["t_end"] for e in ideal)
        else:
            formula = estimate.pipeline_bubble_fraction(p, m, v)
        self.last = dict(
            p=p,
            m=m,
            v=v,
            name=name,
            schedule=schedule,
            measured=measured,
            ideal=ideal,
            t_f=t_f,
            t_b=t_b,
            bound=bound,
            peaks=peaks,
            bubble=(b_ideal, b_meas),
            formula=formula,
        )
        return self.last

    def _draw(self) -> None:
        last = self.last
        p, m, v, name = last["p"], last["m"], last["v"], last["name"]
        t_f, t_b, formula = last["t_f"], last["t_b"], last["formula"]
        (b_ideal, b_meas), peaks, bound = last["bubble"], last["peaks"], last["bound"]
        self.status.value = (
            f"{name}, p={p}, m={m}, v={v}: bubble measured <b>{b_meas:.0%}</b>, "
            f"ideal with measured t_f={t_f * 1e3:.1f} ms, t_b={t_b * 1e3:.1f} ms "
            f"<b>{b_ideal:.0%}</b>, formula {formula:.0%}.<br>"
            f"peak microbatch-chunks in flight per stage: measured {peaks}, "
            f"schedule bound {bound}"
        )
        self.view.clear_output(wait=True)
        with self.view:
            pipeline_ideal_vs_measured(
                last["ideal"],
                last["measured"],
                bubbles=(b_ideal, b_meas),
                title=f"{name}, p={p}, m={m}, v={v}",
            ).show()

    def verify(self, p: int, m: int, name: str, v: int = 1) -> None:
        """Move the controls, run once, and check that every stage ran every F, B
        (and W) of the schedule in the schedule's order, holding exactly as many
        microbatches as the schedule says. The suite drives it
        (``tests/claims/ch05.py``), never the learner's page."""
        self._quiet = True
        try:
            self.v.value, self.p.value, self.m.value = v, p, m
            self.schedule.value = name
        finally:
            self._quiet = False
        last = self.run()
        if self.failures or not last:
            raise AssertionError(f"✗ {name} p={p} m={m} did not run: {self.failures}")
        self.check(last)

    def check(self, last: dict) -> None:
        """Check one run (what :meth:`measure` returned): every stage ran every F,
        B (and W) of the schedule in its order, and held exactly as many
        microbatches as the schedule says."""
        p, m, name = last["p"], last["m"], last["name"]
        where = f"{name:<11} p={p} m={m:>2}"
        confirm(
            last["peaks"] == last["bound"],
            f"{where}: each stage held at most {last['bound']} microbatch-chunks, "
            "as scheduled",
            "" if last["peaks"] == last["bound"] else f"measured {last['peaks']}",
        )
        wrong = []
        for stage in range(p):
            spans = [
                e
                for e in last["measured"]
                if e["stage"] == stage and e["name"] in ("F", "B", "W")
            ]
            spans.sort(key=lambda e: e["t_start"])
            ran = [(e["name"], e["microbatch"], e["chunk"]) for e in spans]
            order = last["schedule"].compute_order(stage)
            if ran != [(a.op, a.microbatch, a.chunk) for a in order]:
                wrong.append(stage)
        b_ideal, b_meas = last["bubble"]
        confirm(
            not wrong,
            f"{where}: every stage ran its compute in the schedule's order",
            f"bubble ideal {b_ideal:.0%}, measured {b_meas:.0%}"
            if not wrong
            else f"stages {wrong} did not",
        )

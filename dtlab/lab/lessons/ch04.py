"""Chapter 04's lesson helpers (``notebooks/04_tensor_parallel.ipynb``): the
questions the chapter asks the learner to predict, the visible checks every chapter
prints, and the explorer of section 4, which runs one training step of the
tensor-parallel GPT for the tp degree and sequence-parallel switch a learner picks
and counts every layer's collectives against ``dtlab.estimate``.

Runs in the notebook's kernel; the step itself (``step_fn``) is the chapter's own
function, shipped to the engines by the cluster.
"""

from __future__ import annotations

import math

import ipywidgets as W
import plotly.graph_objects as go

from dtlab import estimate
from dtlab.lab.figures.tensor_parallel import tp_layer_comm, tp_layer_comm_figure
from dtlab.lab.predictions import Question

__all__ = ["QUESTIONS", "confirm", "TPStepExplorer"]

QUESTIONS = [
    Question(
        "tp_layer_bytes",
        "04",
        "bytes rank 0 sends for one transformer layer in one training step at tp=2 "
        "(b=4, s=32, h=64, fp32 activations, plain TP)",
        "kB",
    ),
    Question(
        "tp_sp_activation_shrink",
        "04",
        "how many times fewer bytes one layer saves for backward on a rank at tp=4 "
        "with sequence parallelism than in one process (tp=1)",
        "x",
    ),
    Question(
        "tp4_param_share",
        "04",
        "the share of the unsplit model's parameter bytes one rank holds at tp=4 "
        "(the chapter's 2-layer GPT, vocabulary 50, h=64)",
        "fraction",
    ),
]


def confirm(ok, claim: str, detail: str = "") -> None:
    """Print ``✓ claim`` (and ``detail``) when ``ok`` holds; otherwise raise an
    ``AssertionError`` naming the claim and what was found. (The same contract as
    chapters 00-03's ``dtlab.lab.lessons.confirm.confirm``.)"""
    if not ok:
        raise AssertionError(f"✗ {claim}" + (f": {detail}" if detail else ""))
    print(f"✓ {claim}" + (f" ({detail})" if detail else ""))


class TPStepExplorer:
    """Controls for tp (1, 2, 4) and sequence parallelism, starting at ``tp`` and
    ``sp``; every change runs
    ``step_fn(config, tp, sp, batch)`` on every rank with telemetry on, redraws the
    per-layer collective counts of rank 0 (◆: ``estimate.tp_collectives_per_layer``)
    and reports the bytes per layer against ``estimate.tp_bytes_per_layer`` and the
    loss against ``single_loss``. ``step_fn`` returns ``{"loss", "param_bytes"}``."""

    def __init__(
        self,
        cluster,
        step_fn,
        config,
        batch: int,
        single_loss: float,
        *,
        tp: int = 4,
        sp: bool = False,
    ):
        self.cluster, self.step_fn = cluster, step_fn
        self.config, self.batch, self.single_loss = config, batch, single_loss
        self.tp = W.ToggleButtons(options=[1, 2, 4], value=tp, description="tp")
        self.sp = W.Checkbox(value=sp, description="sequence parallelism")
        self.status = W.HTML()
        self.errors = W.Output()
        self.figure = go.FigureWidget(tp_layer_comm_figure([]))  # redrawn in place
        self.last: dict = {}  # the latest run
        self.failures: list[Exception] = []
        self._quiet = False  # set while verify() moves both controls at once
        self.tp.observe(self._on_change, names="value")
        self.sp.observe(self._on_change, names="value")

    @property
    def widget(self) -> W.VBox:
        return W.VBox([W.HBox([self.tp, self.sp]), self.status, self.figure])

    def _ipython_display_(self):
        from IPython.display import display

        display(W.VBox([self.widget, self.errors]))

    def _on_change(self, change=None) -> None:
        if self._quiet:
            return
        self.errors.clear_output()
        try:
            self.run()
        except Exception as exc:  # shown under the controls, kept for the checks
            self.failures.append(exc)
            with self.errors:
                raise

    def run(self) -> dict:
        """One recorded step at the controls' setting; returns :attr:`last`."""
        cfg, batch = self.config, self.batch
        tp, sp = self.tp.value, self.sp.value and self.tp.value > 1
        results = self.cluster.run(
            self.step_fn, cfg, tp, sp, batch, record=True, timeout=120
        )
        events = self.cluster.last_events
        pred = estimate.tp_bytes_per_layer(
            batch, cfg.seq_len, cfg.d_model, tp, bytes_per_value=4, sequence_parallel=sp
        )
        table = tp_layer_comm([e for e in events if e["rank"] == 0])
        sent = {layer: 0.0 for layer in range(cfg.n_layers)}
        for (layer, _), ops in table.items():
            sent[layer] += sum(v["wire_bytes"] for v in ops.values())
        self.last = dict(
            tp=tp, sp=sp, results=results, table=table, sent=sent, pred=pred
        )
        tp_layer_comm_figure(events, sequence_parallel=sp, fig=self.figure)
        self.status.value = (
            (
                "tp=1: one rank holds everything, nothing to communicate. "
                if tp == 1
                else ""
            )
            + f"loss {results[0]['loss']:.6f} (single process {self.single_loss:.6f}); "
            f"per layer rank 0 sent {sent[0]:,.0f} B, predicted "
            f"{pred['wire_bytes']:,.0f} B; parameters per rank "
            f"{results[0]['param_bytes']:,} B"
        )
        return self.last

    def verify(self, tp: int, sp: bool) -> None:
        """Move the controls as a learner would, then check what came back: the
        collectives of every layer and pass, their bytes, and the loss. The suite
        drives it (``tests/claims/ch04.py``), never the learner's page."""
        self._quiet = True  # both controls move, the step runs once
        try:
            self.tp.value, self.sp.value = tp, sp
        finally:
            self._quiet = False
        self._on_change()
        if self.failures:
            raise AssertionError(f"✗ the step failed: {self.failures}")
        expected = estimate.tp_collectives_per_layer(sp)
        counts = {
            (layer, phase): {op: v["calls"] for op, v in ops.items()}
            for (layer, phase), ops in self.last["table"].items()
        }
        wrong = {k: v for k, v in counts.items() if v != expected[k[1]]}
        where = f"tp={tp}{' +SP' if sp else ''}"
        ok = len(counts) == 2 * self.config.n_layers and not wrong
        confirm(
            ok,
            f"{where}: every layer ran {_ops(expected['forward'])} forward and "
            f"{_ops(expected['backward'])} backward",
            "" if ok else f"found {wrong}",
        )
        pred = self.last["pred"]["wire_bytes"]
        sent = self.last["sent"]
        ok = all(math.isclose(b, pred) for b in sent.values())
        confirm(
            ok,
            f"{where}: each layer sent {pred:,.0f} B on rank 0, the ring formula's",
            "" if ok else f"sent {sent}",
        )
        losses = [r["loss"] for r in self.last["results"]]
        ok = all(math.isclose(x, self.single_loss, rel_tol=1e-6) for x in losses)
        confirm(
            ok,
            f"{where}: the loss on every rank is the single process's within 1e-6",
            "" if ok else f"losses {losses}",
        )


def _ops(calls: dict) -> str:
    """``{"all_reduce": 2}`` as ``2 all_reduce``."""
    return " + ".join(f"{n} {op}" for op, n in calls.items())

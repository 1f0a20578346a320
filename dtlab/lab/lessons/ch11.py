"""Chapter 11's lesson helpers (``notebooks/11_beyond_3d.ipynb``): the causal work
per rank under the two sequence layouts, ring against Ulysses as cp grows, what a
training run's telemetry says about its mixture-of-experts layers (the
tokens-per-expert histogram and the all-to-all matrix), the table of measured
bytes next to the estimate that every section prints, and the numbers the chapter
asks the learner to predict (``QUESTIONS``).

Runs in the notebook's kernel, on what the engines returned.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dtlab import estimate
from dtlab.context_parallel import local_positions
from dtlab.events import Kind
from dtlab.lab.predictions import Question

__all__ = [
    "QUESTIONS",
    "causal_scores",
    "causal_work_figure",
    "cp_bytes_figure",
    "moe_events",
    "count_matrix",
    "all_to_all_matrix",
    "moe_figure",
    "wire_by_tag",
    "compare_bytes",
]


# The chapter's predictions: each is measured live on the four engines and set
# against dtlab.estimate's figure (est.cp_bytes_per_layer, est.ep_bytes_per_layer).
QUESTIONS = [
    Question(
        "cp_ring_bytes_per_layer",
        "11",
        "bytes one rank sends per attention layer and training step under ring "
        "attention at cp=4 (32 tokens of width 32 per rank, fp32)",
        "kB",
    ),
    Question(
        "cp_ulysses_bytes_per_layer",
        "11",
        "bytes one rank sends per attention layer and training step under Ulysses "
        "at cp=4 (32 tokens of width 32 per rank, fp32)",
        "kB",
    ),
    Question(
        "ep_alltoall_bytes_per_layer",
        "11",
        "bytes an ep rank sends per MoE layer and training step at ep=4, top-2 of "
        "4 experts, 32 tokens of width 32 per rank, fp32, nothing dropped",
        "kB",
    ),
]


# ---- context parallelism -------------------------------------------------------------
def causal_scores(seq_len: int, cp: int, load_balanced: bool) -> list[int]:
    """Per cp rank, the causal (query, key) pairs its queries attend to: the scores
    it must compute, whoever holds the keys."""
    out = []
    for index in range(cp):
        pos = local_positions(seq_len, cp, index, load_balanced)
        out.append(int(sum(int(p) + 1 for p in pos)))  # query p sees keys 0..p
    return out


def causal_work_figure(seq_len: int, cp: int) -> go.Figure:
    """Bars: the causal scores of each rank, contiguous chunks vs the load-balanced
    pairs (chunk i and 2·cp-1-i)."""
    fig = go.Figure()
    ranks = [f"rank {i}" for i in range(cp)]
    for name, balanced, color in (
        ("contiguous (chunk i)", False, "#e45756"),
        ("load balanced (chunks i and 2·cp−1−i)", True, "#4c78a8"),
    ):
        fig.add_bar(
            x=ranks,
            y=causal_scores(seq_len, cp, balanced),
            name=name,
            marker_color=color,
        )
    fig.update_layout(
        barmode="group",
        height=320,
        title=f"Causal attention work per rank, {seq_len} tokens over cp={cp}",
        yaxis_title="(query, key) scores to compute",
    )
    return fig


def cp_bytes_figure(
    *, micro_batch, seq_len, d_model, n_heads, n_kv_heads=None, cps=(2, 4, 8, 16, 32)
) -> go.Figure:
    """Wire bytes per rank of one attention layer (forward + backward, bf16) for
    ring attention and Ulysses as cp grows (:func:`dtlab.estimate.cp_bytes_per_layer`);
    Ulysses only where cp divides the heads."""
    fig = go.Figure()
    for variant, color in (("ring", "#4c78a8"), ("ulysses", "#f58518")):
        xs = [cp for cp in cps if variant == "ring" or n_heads % cp == 0]
        ys = []
        for cp in xs:
            sent = estimate.cp_bytes_per_layer(
                micro_batch,
                seq_len,
                d_model,
                cp,
                variant=variant,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                bytes_per_value=2,
            )
            ys.append(sent["wire_bytes"] / estimate.GB)
        fig.add_scatter(
            x=xs, y=ys, name=variant, mode="lines+markers", line_color=color
        )
    kv = f", {n_kv_heads} K/V heads" if n_kv_heads else ""
    fig.update_layout(
        height=340,
        title=f"One layer at {seq_len:,} tokens, h={d_model}, {n_heads} heads{kv}",
        xaxis=dict(title="cp", type="log", tickvals=list(cps)),
        yaxis_title="GB sent per rank (forward + backward)",
    )
    return fig


# ---- mixture of experts --------------------------------------------------------------
def moe_events(events, *, step: int | None = None, layer: str | None = None):
    """The run's MoE events (one per layer, rank and microbatch), optionally of
    one step and one layer."""
    return [
        e
        for e in events
        if e.get("kind") == Kind.MOE
        and (step is None or e["step"] == step)
        and (layer is None or e["layer"] == layer)
    ]


def _by_rank(events, step, layer) -> list[dict]:
    found = sorted(moe_events(events, step=step, layer=layer), key=lambda e: e["rank"])
    if not found:
        raise ValueError(f"no MoE event of layer {layer!r} at step {step}")
    return found


def count_matrix(events, step: int, layer: str) -> list[list[int]]:
    """``counts[s][e]``: the rows rank s sent to expert e (its kept assignments) in
    ``layer`` at ``step``: the ``(ep, E)`` matrix the ranks all-gather."""
    return [list(e["tokens_per_expert"]) for e in _by_rank(events, step, layer)]


def all_to_all_matrix(events, step: int, layer: str) -> list[list[float]]:
    """``bytes[s][j]``: what rank s dispatched to rank j in ``layer`` at ``step``
    (each rank's recorded row; the diagonal stays on the rank)."""
    return [list(e["send_bytes"]) for e in _by_rank(events, step, layer)]


def moe_figure(events, step: int, layer: str) -> go.Figure:
    """Left: assignments per expert, routed and kept (summed over the ranks), the
    capacity of one rank as a line. Right: the dispatch all-to-all's matrix."""
    ranks = _by_rank(events, step, layer)
    E = len(ranks[0]["routed"])
    routed = [sum(e["routed"][x] for e in ranks) for x in range(E)]
    kept = [sum(e["tokens_per_expert"][x] for e in ranks) for x in range(E)]
    capacity = ranks[0]["capacity"]
    matrix = all_to_all_matrix(events, step, layer)
    n = len(matrix)
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        subplot_titles=(
            f"assignments per expert, all {n} ranks",
            "dispatch all-to-all: bytes from rank (row) to rank (column)",
        ),
    )
    experts = [f"expert {x}" for x in range(E)]
    fig.add_bar(
        x=experts, y=routed, name="routed", marker_color="#bab0ac", row=1, col=1
    )
    fig.add_bar(x=experts, y=kept, name="kept", marker_color="#4c78a8", row=1, col=1)
    fig.add_scatter(
        x=experts,
        y=[n * capacity] * E,
        mode="lines",
        name=f"capacity × {n} ranks",
        line=dict(color="#e45756", dash="dash"),
        row=1,
        col=1,
    )
    labels = [f"rank {r}" for r in range(n)]
    fig.add_heatmap(
        z=matrix,
        x=labels,
        y=labels,
        colorscale="Purples",
        text=[[f"{v:,.0f}" for v in row] for row in matrix],
        texttemplate="%{text}",
        showscale=False,
        row=1,
        col=2,
    )
    fig.update_yaxes(autorange="reversed", row=1, col=2)
    dropped = sum(e["dropped"] for e in ranks)
    fig.update_layout(
        barmode="group",
        height=380,
        title=f"{layer}, step {step}: {dropped} assignments dropped",
    )
    return fig


# ---- bytes next to the estimate ------------------------------------------------------
def wire_by_tag(events, rank: int, step: int, key=lambda e: e["axis"]) -> dict:
    """Wire bytes of ``rank`` at ``step``, summed by ``key(event)`` (the axis, by
    default)."""
    out: dict = {}
    for e in events:
        if e.get("kind") == Kind.COMM and e["rank"] == rank and e["step"] == step:
            k = key(e)
            out[k] = out.get(k, 0.0) + e["wire_bytes"]
    return out


def compare_bytes(rows: Sequence[tuple[str, float, float]]) -> float:
    """Print ``what | measured | estimate`` for each row, and return the largest
    gap in bytes (the suite's claims hold it to zero; the page shows the table)."""
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  {'measured':>12}  {'estimate':>12}")
    for what, got, want in rows:
        mark = "" if got == want else "   (differs)"
        print(f"{what:<{width}}  {got:>12,.0f}  {want:>12,.0f}{mark}")
    return max(abs(got - want) for _, got, want in rows)

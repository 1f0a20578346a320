"""Mixture-of-experts routing, live (chapter 11): how many tokens each expert
received on each rank, and how many assignments the capacity dropped. The
dashboard (:mod:`dtlab.lab.figures.dashboard`) shows it for a model with experts,
folding the ``moe`` events :class:`dtlab.moe.MoE` emits every forward."""

from __future__ import annotations

from collections.abc import Mapping


def experts_figure(routing: Mapping[int, Mapping]) -> dict:
    """Tokens each expert received on each rank (the newest ``moe`` event of every
    rank, its layers added up) as grouped bars, a figure dict; the title counts the
    dropped assignments (chapter 11: the router's balance, live)."""
    ranks = sorted(routing)
    n_experts = max((len(e["tokens_per_expert"]) for e in routing.values()), default=0)
    traces = [
        dict(
            type="bar",
            name=f"rank {r}",
            x=[f"expert {i}" for i in range(n_experts)],
            y=routing[r]["tokens_per_expert"],
            hovertemplate="%{x}: %{y} tokens<extra>rank " + str(r) + "</extra>",
        )
        for r in ranks
    ]
    dropped = sum(e["dropped"] for e in routing.values())
    layout = dict(
        barmode="group",
        title=dict(
            text=f"Tokens per expert, newest step ({dropped} assignments dropped)"
        ),
        yaxis=dict(title=dict(text="tokens routed")),
        height=320,
        margin=dict(t=50, b=40, l=50, r=10),
    )
    return {"data": traces, "layout": layout}


def add_routing(into: dict, e: Mapping) -> None:
    """Fold one ``moe`` event into ``into[rank]``: the newest forward's layers added
    up (a newer step, or a layer seen again, starts the rank's counts afresh)."""
    seen = into.get(e["rank"])
    if seen is None or seen["step"] != e.get("step") or e["layer"] in seen["layers"]:
        seen = into[e["rank"]] = {
            "step": e.get("step"),
            "layers": set(),
            "tokens_per_expert": [0] * len(e["tokens_per_expert"]),
            "dropped": 0,
        }
    seen["layers"].add(e["layer"])
    seen["tokens_per_expert"] = [
        a + b for a, b in zip(seen["tokens_per_expert"], e["tokens_per_expert"])
    ]
    seen["dropped"] += e["dropped"]

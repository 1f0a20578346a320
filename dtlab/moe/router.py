"""Top-k routing with an expert capacity: which expert each token goes to, which
assignments are dropped, and the load-balancing loss.

Taught in chapter 11 (mixture of experts). Sources:

- Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated
  Mixture-of-Experts Layer", §2.1: a router (a linear layer ``W_r``, h -> E) scores
  every expert for every token; each token goes to its top k.
- Lepikhin et al. 2020, "GShard", §2.2 and Algorithm 1: top-2 gates renormalised to
  sum to one; an *expert capacity* bounds the tokens an expert takes; a token's
  first choice is served before any token's second choice; an assignment beyond the
  capacity is *dropped* (the token skips that expert; the residual carries it on).
- Fedus et al. 2021, "Switch Transformers", §2.1-2.2: top-1 with the gate ``p_i(x)``
  kept as the output scale (so the router learns); capacity
  ``C = capacity_factor · tokens / experts`` (times k for top-k); the auxiliary loss
  ``α · E · Σ_i f_i · P_i`` with ``f_i`` the fraction of tokens whose first choice
  is expert i and ``P_i`` the mean router probability of expert i. It is smallest
  (α) when routing is uniform.

Tokens are ``(N, C)``: the batch's ``B·T`` tokens in order, the priority order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "expert_capacity",
    "Routing",
    "load_balancing_loss",
    "top_k_routing",
    "dispatch_order",
]


def expert_capacity(
    n_tokens: int, n_experts: int, top_k: int = 1, capacity_factor: float | None = 1.25
) -> int:
    """Assignments one expert accepts: ``ceil(capacity_factor · k · N / E)``
    (Switch §2.1 with GShard's k). ``capacity_factor=None`` drops nothing: an
    expert then takes up to every token (each token picks an expert once)."""
    if capacity_factor is None:
        return n_tokens
    return max(1, math.ceil(capacity_factor * top_k * n_tokens / n_experts))


@dataclass
class Routing:
    """Where the ``N`` tokens go. ``expert``, ``gate``, ``slot``, ``keep`` are
    ``(N, k)``: the chosen experts (best first), their gates (differentiable), the
    assignment's place in its expert's queue, and whether it fits the capacity.
    ``routed`` and ``kept`` are ``(E,)`` counts of assignments per expert, before
    and after the capacity; ``aux_loss`` is Switch's ``E · Σ f_i P_i`` (unscaled)."""

    expert: torch.Tensor
    gate: torch.Tensor
    slot: torch.Tensor
    keep: torch.Tensor
    capacity: int
    routed: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor

    @property
    def dropped(self) -> int:
        """Assignments over capacity."""
        return int(self.routed.sum() - self.kept.sum())


def load_balancing_loss(
    probs: torch.Tensor, first_choice: torch.Tensor
) -> torch.Tensor:
    """Switch Transformers' auxiliary loss (§2.2, eq. 4-6) without its α:
    ``E · Σ_i f_i · P_i``, ``f_i`` the fraction of tokens whose first choice is i
    (not differentiable), ``P_i`` the mean probability of i (differentiable).
    Equal to 1 under perfectly uniform routing."""
    N, E = probs.shape
    f = torch.bincount(first_choice, minlength=E).to(probs.dtype) / N  # (E,)
    P = probs.mean(dim=0)  # (E,)
    return E * (f * P).sum()


def top_k_routing(logits: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Route ``N`` tokens from their router logits ``(N, E)``: softmax, top k,
    gates (top-1: the probability, as Switch; top-2: renormalised, as GShard), then
    the capacity in priority order (every first choice, in token order, before any
    second choice)."""
    N, E = logits.shape
    probs = F.softmax(logits, dim=-1)  # (N, E)
    top_p, expert = probs.topk(top_k, dim=-1)  # (N, k)
    gate = top_p / top_p.sum(dim=-1, keepdim=True) if top_k > 1 else top_p
    flat = expert.t().reshape(-1)  # (k·N,): the priority order
    onehot = F.one_hot(flat, E)  # (k·N, E)
    # an assignment's place in its expert's queue: how many came before it there
    slot = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=1)  # (k·N,)
    keep = slot < capacity
    return Routing(
        expert=expert,
        gate=gate,
        slot=slot.view(top_k, N).t(),
        keep=keep.view(top_k, N).t(),
        capacity=capacity,
        routed=onehot.sum(dim=0),
        kept=torch.bincount(flat[keep], minlength=E),
        aux_loss=load_balancing_loss(probs, expert[:, 0]),
    )


def dispatch_order(routing: Routing):
    """The dispatch permutation: the kept assignments grouped by expert, each
    expert's in queue order. Returns ``(token, gate, counts)``: for the i-th
    assignment the token it carries ``(M,)`` and its gate ``(M,)``, and the
    assignments per expert ``(E,)`` (``M = counts.sum()``). ``x[token]`` is the
    buffer the experts read, expert 0's rows first."""
    N, k = routing.expert.shape
    expert = routing.expert.t().reshape(-1)  # (k·N,), priority order
    token = torch.arange(N, device=expert.device).repeat(k)  # (k·N,)
    kept = routing.keep.t().reshape(-1).nonzero().squeeze(1)  # (M,)
    # a stable sort keeps the priority order inside each expert: its queue order
    order = kept[torch.argsort(expert[kept], stable=True)]
    return token[order], routing.gate.t().reshape(-1)[order], routing.kept

"""A mixture-of-experts layer in place of the GPT's MLP.

Taught in chapter 11 (mixture of experts). ``GPTConfig(n_experts=E, top_k=k,
capacity_factor=c)`` with ``E > 1`` gives every block an :class:`MoE` instead of
an :class:`dtlab.model.MLP`: E experts of the MLP's shape, of which each token runs
k (Shazeer et al. 2017; Fedus et al. 2021). The parameters grow E-fold, the FLOPs
per token only k-fold: the point of sparsity.

One forward, in four visible steps:

1. **route** (:func:`~dtlab.moe.top_k_routing`): router logits, top k, gates, the
   capacity, the load-balancing loss;
2. **permute** (:func:`~dtlab.moe.dispatch_order`): the kept assignments' tokens,
   grouped by expert in queue order;
3. **compute**: each expert on its rows. Here every expert is local; under expert
   parallelism (:func:`~dtlab.moe.expert_parallel`) the rows travel to the rank
   of their expert by an all-to-all and come back by another;
4. **combine**: each token's output is the gate-weighted sum of its experts'
   outputs (an assignment that was dropped adds nothing).

The layer keeps its last load-balancing loss (times ``aux_loss_coef``) in
``aux_loss``; :class:`dtlab.model.GPT` adds every layer's to its loss
(:func:`moe_aux_loss`). With a telemetry recorder on, each forward records a
``Kind.MOE`` event: tokens per expert, dropped assignments, the capacity and, under
expert parallelism, this rank's row of the all-to-all matrix.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import telemetry
from dtlab.checks import integer
from dtlab.events import Kind
from dtlab.moe.router import dispatch_order, expert_capacity, top_k_routing

__all__ = ["Expert", "MoE", "LocalExperts", "moe_aux_loss", "check_moe_config"]


def check_moe_config(n_experts, top_k, capacity_factor, aux_loss_coef) -> None:
    """Refuse a mixture-of-experts setting that cannot work, saying why."""
    integer("n_experts", n_experts, 1)
    if isinstance(top_k, bool) or top_k not in (1, 2):
        raise ValueError(f"top_k must be 1 (Switch) or 2 (GShard), got {top_k!r}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            f"capacity_factor must be positive (or None: drop nothing), "
            f"got {capacity_factor!r}"
        )
    if not aux_loss_coef >= 0:
        raise ValueError(f"aux_loss_coef must be >= 0, got {aux_loss_coef!r}")


class Expert(nn.Module):
    """One expert: the GPT's MLP, ``proj(gelu(fc(x)))``, d -> d_ff -> d."""

    def __init__(self, config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))  # (n, d) -> (n, d)


class LocalExperts:
    """Step 3 with every expert on this rank: each expert reads its consecutive
    rows. (Off is an object that does nothing: no rank to talk to.)"""

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: torch.Tensor):
        chunks = rows.split(counts.tolist())  # expert e's rows, in queue order
        out = [moe.experts[str(e)](chunk) for e, chunk in enumerate(chunks)]
        return torch.cat(out), {}


class MoE(nn.Module):
    """A top-k mixture-of-experts layer: ``(B, T, C) -> (B, T, C)``.

    ``router`` is a Linear (C -> E, no bias); ``experts`` a ModuleDict keyed by the
    expert's global number (``experts.3.fc.weight``), so a rank that keeps only its
    own experts under expert parallelism keeps their names. ``dispatch`` runs the
    experts: :class:`LocalExperts` here, an all-to-all under expert parallelism.
    """

    def __init__(self, config, name: str = "mlp") -> None:
        super().__init__()
        check_moe_config(
            config.n_experts,
            config.top_k,
            config.capacity_factor,
            config.aux_loss_coef,
        )
        self.n_experts, self.top_k = config.n_experts, config.top_k
        self.capacity_factor = config.capacity_factor
        self.aux_loss_coef = config.aux_loss_coef
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleDict(
            {str(e): Expert(config) for e in range(config.n_experts)}
        )
        self.dispatch = LocalExperts()
        self.name = name
        self.aux_loss = torch.zeros(())  # the last forward's, times aux_loss_coef
        self.stats: dict = {}  # the last forward's routing, in numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # (N, C), in priority order
        capacity = expert_capacity(
            B * T, self.n_experts, self.top_k, self.capacity_factor
        )
        # 1. route
        routing = top_k_routing(self.router(tokens), self.top_k, capacity)
        self.aux_loss = self.aux_loss_coef * routing.aux_loss
        # 2. permute: the rows each expert reads, expert 0's first
        token, gate, counts = dispatch_order(routing)
        rows = tokens[token]  # (M, C)
        # 3. compute, wherever the experts live
        out_rows, extra = self.dispatch(self, rows, counts)  # (M, C)
        # 4. combine: a token's experts, weighted by their gates
        weighted = out_rows * gate.unsqueeze(1).to(out_rows.dtype)  # (M, C)
        out = torch.zeros_like(tokens).index_add(0, token, weighted)  # (N, C)
        self.stats = {
            "routed": routing.routed.tolist(),
            "tokens_per_expert": counts.tolist(),
            "dropped": routing.dropped,
            "capacity": capacity,
            **extra,
        }
        rec = telemetry.current()
        if rec.enabled:
            rec.emit(Kind.MOE, layer=self.name, **self.stats)
        return out.view(B, T, C)


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of every MoE layer's last load-balancing loss (times its
    ``aux_loss_coef``): what :class:`dtlab.model.GPT` adds to its loss."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(losses).sum() if losses else torch.zeros(())

"""Mixture of experts and expert parallelism.

Taught in chapter 11 (long context and mixture of experts). A mixture-of-experts
layer replaces the MLP by E experts of which each token runs k: parameters grow
E-fold, FLOPs per token k-fold (Shazeer et al. 2017; GShard, Lepikhin et al. 2020;
Switch Transformers, Fedus et al. 2021). Expert parallelism spreads the experts
over the ep ranks and moves the *tokens*: an all-to-all to the experts' ranks and
one back, per layer, forward and backward.

Where each piece lives:

- :mod:`~dtlab.moe.router`: :func:`top_k_routing` (top-k gates, the expert
  capacity, dropped assignments, Switch's load-balancing loss),
  :func:`expert_capacity`, :func:`dispatch_order` (the dispatch permutation);
- :mod:`~dtlab.moe.layer`: :class:`MoE` (route, permute, compute, combine) and its
  :class:`Expert`; ``GPTConfig(n_experts=E, top_k=k, capacity_factor=c)`` puts it in
  every block of :class:`dtlab.model.GPT` (:func:`moe_aux_loss` joins the loss);
- :mod:`~dtlab.moe.expert_parallel`: :func:`expert_parallel` (one layer) and
  :func:`expert_parallel_gpt` (every layer of a GPT) over an ep group, the
  all-to-all autograd function, and :func:`average_gradients`.

The estimates: :func:`dtlab.estimate.ep_bytes_per_layer`,
:func:`~dtlab.estimate.ep_traffic_from_counts`, :func:`~dtlab.estimate.ep_imbalance`
and :func:`~dtlab.estimate.dropped_assignments`.
"""

from dtlab.moe.expert_parallel import (
    AllToAll,
    ExpertParallelDispatch,
    average_gradients,
    expert_parallel,
    expert_parallel_gpt,
)
from dtlab.moe.layer import Expert, LocalExperts, MoE, check_moe_config, moe_aux_loss
from dtlab.moe.router import (
    Routing,
    dispatch_order,
    expert_capacity,
    load_balancing_loss,
    top_k_routing,
)

__all__ = [
    # router
    "expert_capacity",
    "Routing",
    "load_balancing_loss",
    "top_k_routing",
    "dispatch_order",
    # layer
    "check_moe_config",
    "Expert",
    "LocalExperts",
    "MoE",
    "moe_aux_loss",
    # expert parallelism
    "AllToAll",
    "ExpertParallelDispatch",
    "expert_parallel",
    "expert_parallel_gpt",
    "average_gradients",
]

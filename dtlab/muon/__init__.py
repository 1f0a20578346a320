"""Muon, the optimizer that does not shard like Adam: one process, and two ways
across data-parallel ranks.

Taught in chapter 12 (the frontier), after ZeRO (chapter 03). Jordan et al. 2024
(Muon); Liu et al. 2025, "Muon is Scalable for LLM Training" (Moonshot AI), for the
sharded step.

- :mod:`dtlab.muon.optimizer`: :func:`newton_schulz`, :class:`Muon` (equal to
  ``torch.optim.Muon``), :func:`split_params` (which parameters Muon takes, which go
  to AdamW);
- :mod:`dtlab.muon.sharded`: :class:`ShardedMuon`, ``design="naive"`` (gather each
  matrix whole, NS on every rank) or ``design="owner"`` (NS once, by the matrix's
  owner);
- :mod:`dtlab.muon.estimate`: owners, bytes per rank and NS FLOPs per rank of each
  design, from the shapes alone (:func:`muon_traffic`, :func:`muon_flops`).
"""

from dtlab.muon.estimate import (
    MuonTraffic,
    assign_owners,
    muon_flops,
    muon_traffic,
    ns_flops,
)
from dtlab.muon.optimizer import Muon, ParamSplit, newton_schulz, split_params
from dtlab.muon.sharded import ShardedMuon

__all__ = [
    "newton_schulz",
    "Muon",
    "ParamSplit",
    "split_params",
    "ShardedMuon",
    "MuonTraffic",
    "assign_owners",
    "muon_traffic",
    "muon_flops",
    "ns_flops",
]

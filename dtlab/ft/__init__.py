"""Fault tolerance in data parallelism (chapter 13): a quorum every step with
replicas lost and healed while the job runs (:mod:`dtlab.ft.quorum`, the design of
torchft), low-communication LocalSGD and DiLoCo (:mod:`dtlab.ft.local_sgd`,
Douillard et al. 2023), and the Young–Daly checkpoint interval
(:mod:`dtlab.ft.young_daly`, Young 1974, Daly 2006)."""

from dtlab.ft.local_sgd import DiLoCo, LocalSGD, local_sgd_bytes_per_step
from dtlab.ft.quorum import FaultTolerantReplica, Quorum
from dtlab.ft.young_daly import (
    cluster_mtbf,
    daly_interval,
    expected_waste,
    young_daly_interval,
)

__all__ = [
    "Quorum",
    "FaultTolerantReplica",
    "LocalSGD",
    "DiLoCo",
    "local_sgd_bytes_per_step",
    "young_daly_interval",
    "daly_interval",
    "expected_waste",
    "cluster_mtbf",
]

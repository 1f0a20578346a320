"""The graded parts of the drill's cards on chapter 13's resilience: how often to
checkpoint, what LocalSGD and DiLoCo send, what a resharding checkpoint must record.
Vocabulary and constructors: :mod:`~dtlab.drill.parts`; each number comes from
:mod:`dtlab.ft` (the Young–Daly interval, LocalSGD's bytes) or :mod:`dtlab.estimate`
(DDP's bytes, ZeRO-3's optimizer states per rank)."""

from __future__ import annotations

from dtlab import estimate as est
from dtlab import ft
from dtlab.drill.parts import C, N

__all__ = ["PARTS"]

DAY = 86_400.0
NODE_MTBF = 264 * DAY  # one 8-GPU server, from Llama 3's 419 failures in 54 days
CHECKPOINT_S = 120.0  # a checkpoint that stalls training for 2 minutes
SERVERS = 1024 // 8


def _job_mtbf() -> float:
    """128 servers of :data:`NODE_MTBF` each: failures add, M = m / n."""
    return ft.cluster_mtbf(NODE_MTBF, SERVERS)


def _psi_7b() -> float:
    return est.MODELS["7B"].n_params


PARTS: dict[str, tuple] = {
    "checkpoint_interval": (
        N(
            "interval",
            "A job on 1,024 GPUs, 128 servers of 8, each server failing every 264 "
            "days on average; a checkpoint stalls training for 2 minutes: the "
            "Young–Daly interval between checkpoints",
            "h",
            lambda: ft.young_daly_interval(CHECKPOINT_S, _job_mtbf()),
        ),
        N(
            "waste",
            "The same job, checkpointing at that interval: the share of its time "
            "lost to writing checkpoints and to work redone after failures",
            "%",
            lambda: ft.expected_waste(
                ft.young_daly_interval(CHECKPOINT_S, _job_mtbf()),
                CHECKPOINT_S,
                _job_mtbf(),
            ),
        ),
        C(
            "four_times",
            "The job grows to four times the servers; the checkpoint costs the "
            "same. At the new best interval:",
            ["the interval halves", "the share of time lost doubles"],
            ["the interval doubles"],
            {
                "the interval shrinks fourfold": "the interval goes with the square "
                "root of the MTBF, and a quarter of the MTBF is not a quarter of "
                "its root",
                "nothing changes: each server fails no more often than before": (
                    "independent failures add up: n servers fail n times as often "
                    "as one"
                ),
            },
        ),
    ),
    "diloco_traffic": (
        N(
            "bytes_per_step",
            "LLaMA-2 7B's parameters on 8 replicas, fp32 values, DiLoCo meeting every "
            "H = 500 inner steps: bytes each replica sends per inner step",
            "MB",
            lambda: ft.local_sgd_bytes_per_step(_psi_7b(), 8, 500),
        ),
        N(
            "ddp_over_diloco",
            "The same job: DDP's bytes per step (fp32 gradients) over DiLoCo's",
            "x",
            lambda: (
                est.ddp_bytes_per_step(_psi_7b(), 8)
                / ft.local_sgd_bytes_per_step(_psi_7b(), 8, 500)
            ),
        ),
        C(
            "meeting",
            "What does one DiLoCo meeting all-reduce?",
            ["the replicas' pseudo-gradients, θ_global − θ_replica"],
            ["the replicas' losses"],
            {
                "the inner AdamW moments": "the inner optimizer's state never "
                "leaves its replica: a meeting moves one value per parameter",
                "every inner step's gradient": "sending every step's gradients is "
                "DDP; DiLoCo sends once per H steps",
            },
        ),
    ),
    "reshard_checkpoint": (
        N(
            "bytes_read",
            "Ψ = 7e9, fp32 master weights and Adam's two moments (12 bytes a "
            "parameter) saved by ZeRO-3 on 64 GPUs and loaded by ZeRO-3 on 32: "
            "bytes each GPU reads",
            "GB",
            lambda: est.zero_memory_per_device(7e9, 32, 3)["optimizer"],
        ),
        C(
            "records",
            "What must the checkpoint have recorded so that 32 GPUs can load what "
            "64 wrote?",
            [
                "the offsets of each piece in the full tensor",
                "the shape of each full tensor",
            ],
            ["the hostname of each writer"],
            {
                "nothing more: concatenate the rank files in order": "ZeRO's "
                "shards are slices of flattened, padded buffers and tensor "
                "parallelism cuts boxes, so the files in rank order are not the "
                "tensors",
                "the world size, which the new job must match": "a checkpoint "
                "that only loads at its own world size is the problem, not the "
                "answer",
            },
        ),
        C(
            "reads",
            "When the layout changes, what does each loading rank read?",
            ["the overlaps of saved pieces with the piece it now holds"],
            ["the file of the rank with its number"],
            {
                "the whole checkpoint, keeping its own slice": "every rank reading "
                "everything multiplies the storage traffic by the rank count; "
                "the index says where each byte is",
            },
        ),
    ),
}

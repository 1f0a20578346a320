"""One training run as the estimates see it: :class:`Run`, built once.

Taught in chapter 07 (prediction beside measurement) and chapter 09 (the dry run):
the live dashboard (:mod:`dtlab.measure`) and the dry run (:mod:`dtlab.dryrun`)
predict the same run, so they must hand the estimates the same arguments. A
:class:`Run` holds them, read once from a :class:`dtlab.config.TrainConfig` (any
object with its fields: the estimates import nothing of the trainer), and asks
:func:`~dtlab.estimate.layout_memory` and :func:`~dtlab.estimate.layout_traffic`
with them.

Two counts of microbatches differ and both matter: memory holds one pipeline
flush's activations at a time (``per_flush``), while traffic pays ZeRO-2/3's
per-microbatch collectives for every microbatch of the step (``per_step``: the
flushes of gradient accumulation times the microbatches of each).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.estimate.layouts import layout_memory
from dtlab.estimate.traffic import layout_traffic

__all__ = ["Run"]


@dataclass(frozen=True)
class Run:
    """The estimates' arguments for one run on ``layout`` (see the module
    docstring). ``zero_stage`` 0 is DDP, as in every estimate."""

    model: object
    layout: object
    zero_stage: int = 0
    precision: str = "fp32"
    micro_batch_size: int = 1
    per_flush: int = 1
    per_step: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    checkpointing: str = "none"
    sequence_parallel: bool = False
    offload: bool = False
    cp_variant: str = "ring"
    zero_shard_size: int | None = None

    @classmethod
    def of(cls, config, layout=None, model=None) -> Run:
        """The run ``config`` describes on ``layout`` (default: the config's own,
        which must then be set), for ``model`` (default: the config's; the dry run
        passes a published preset to predict the papers' model on the same
        layout)."""
        layout = layout if layout is not None else config.layout
        if layout is None:
            raise ValueError(
                "the config has no layout (it means dp = world size): pass the "
                "layout, e.g. Run.of(config, config.resolve_layout(world_size))"
            )
        k, m = config.grad_accum_steps, config.resolve_microbatches(layout)
        return cls(
            model=config.model if model is None else model,
            layout=layout,
            zero_stage=config.zero_stage or 0,
            precision=config.precision,
            micro_batch_size=config.global_batch_size // (layout.dp * k * m),
            per_flush=m,
            per_step=k * m,
            schedule=config.schedule,
            chunks=config.chunks,
            checkpointing=config.activation_checkpointing,
            sequence_parallel=config.sequence_parallel,
            offload=config.offload,
            cp_variant=config.cp_variant,
            zero_shard_size=config.zero_shard_size,
        )

    def memory(self, stage: int | None = None, **options) -> dict[str, float]:
        """:func:`~dtlab.estimate.layout_memory` of this run at pipeline stage
        ``stage`` (default: the most loaded); ``options`` are its other keywords
        (``states``, ``activations``, ``dropout_mask_bytes``)."""
        return layout_memory(
            self.model, self.layout, zero_stage=self.zero_stage,
            precision=self.precision, micro_batch_size=self.micro_batch_size,
            microbatches=self.per_flush, schedule=self.schedule, chunks=self.chunks,
            checkpointing=self.checkpointing,
            sequence_parallel=self.sequence_parallel, offload=self.offload,
            stage=stage, cp_variant=self.cp_variant,
            zero_shard_size=self.zero_shard_size, **options,
        )  # fmt: skip

    def traffic(self, stage: int | None = None) -> dict[str, float]:
        """:func:`~dtlab.estimate.layout_traffic` of this run: wire bytes per
        optimizer step by axis, at ``stage`` (default: the busiest rank per axis)."""
        return layout_traffic(
            self.model, self.layout, zero_stage=self.zero_stage,
            precision=self.precision, micro_batch_size=self.micro_batch_size,
            microbatches=self.per_step, sequence_parallel=self.sequence_parallel,
            chunks=self.chunks, stage=stage, cp_variant=self.cp_variant,
            checkpointing=self.checkpointing,
        )  # fmt: skip

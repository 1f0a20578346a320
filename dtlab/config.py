"""What a training run is: :class:`TrainConfig`, checked before any process starts.

Taught in chapter 02 (its first fields) and chapter 07 (every axis and option at
once, from the control panel). The same config gives the same numbers on any
launcher: the lab's engines, :func:`dtlab.launch.spawn`, torchrun, ``dtlab run``.
:class:`dtlab.train.Trainer` runs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dtlab.checks import integer, positive_int
from dtlab.events import (
    CHECKPOINTING,
    CP_VARIANTS,
    PRECISIONS,
    SCHEDULES,
    SPLIT_BACKWARD,
    STRATEGIES,
    V_SCHEDULES,
    zero_stage,
)
from dtlab.model import GPTConfig
from dtlab.topology import Layout

__all__ = ["TrainConfig", "check_strategy", "check_composition"]


# ---- configuration -------------------------------------------------------------------
@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the same config gives the same numbers on any launcher.

    - ``model``: the GPT to train; ``seed`` its init, ``data_seed`` the data.
    - ``layout``: ``Layout(dp, tp, pp)``; ``None`` means data parallel over the whole
      world (``dp = world size``). Tensor and pipeline parallelism come from the
      layout, not from the strategy name.
    - ``strategy``: the data-parallel flavour over the dp axis, a name in
      :data:`STRATEGIES`: ``"ddp"`` (chapter 02) or ``"zero1"``/``"zero2"``/
      ``"zero3"`` (chapter 03).
    - ``steps``, ``global_batch_size`` (sequences per optimizer step, all ranks
      together), ``grad_accum_steps`` (microbatches per rank and step; with pp > 1,
      pipeline flushes per step).
    - Pipeline (chapter 05, when ``pp > 1``): ``schedule`` (``gpipe``, ``1f1b``,
      ``interleaved``, ``zb_h1``, and the V schedules ``zb_v`` and ``dualpipe_v``,
      which hold two chunks per rank: chapter 12), ``microbatches`` per flush and
      dp rank (None: pp; DualPipeV needs at least 2·pp), ``chunks`` (virtual stages
      per rank, interleaved only).
    - Tensor parallelism (chapter 04): ``sequence_parallel`` (needs tp > 1).
    - Context parallelism (chapter 11, when the layout's ``cp > 1``):
      ``cp_variant``, ``"ring"`` or ``"ulysses"``. Expert parallelism (``ep > 1``)
      needs a mixture of experts in ``model`` (``n_experts > 1``).
    - ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (chapter 06, :mod:`dtlab.amp`:
      16-bit compute with fp32 master weights; fp16 adds the dynamic loss scaler).
    - ``activation_checkpointing``: ``"none"``, ``"selective"`` (recompute the
      attention core) or ``"full"`` (recompute each block), chapter 08.
    - AdamW: ``lr``, ``weight_decay``, ``betas``; ``grad_clip`` (global norm) or None.
    - DDP: ``bucket_cap_mb``, ``find_unused_parameters``. ZeRO: ``offload``, and
      ``zero_shard_size`` for HSDP (shard within groups of that many data-parallel
      ranks, replicate across the groups; None: shard over all of them).

    :meth:`check` says before any process starts whether a world can run it;
    :meth:`to_dict` / :meth:`from_dict` round-trip it through JSON.
    """

    model: GPTConfig = field(default_factory=GPTConfig)
    layout: Layout | None = None
    strategy: str = "ddp"
    steps: int = 20
    global_batch_size: int = 8
    grad_accum_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = None
    seed: int = 0
    data_seed: int = 0
    # ---- pipeline (chapter 05)
    schedule: str = "1f1b"
    microbatches: int | None = None
    chunks: int = 1
    # ---- tensor parallelism (chapter 04)
    sequence_parallel: bool = False
    # ---- context parallelism (chapter 11, when cp > 1)
    cp_variant: str = "ring"
    # ---- precision (chapter 06) and activation memory (chapter 08)
    precision: str = "fp32"
    activation_checkpointing: str = "none"
    # ---- DDP (chapter 02)
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    # ---- ZeRO (chapter 03): master weights, gradients, optimizer state on the host
    offload: bool = False
    # ---- HSDP (chapter 11): ZeRO shards within groups of this many replicas
    zero_shard_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, GPTConfig):
            raise ValueError(f"model must be a GPTConfig, got {type(self.model)}")
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise ValueError(f"layout must be a Layout or None, got {self.layout!r}")
        if not isinstance(self.strategy, str):
            raise ValueError(f"strategy must be a name, got {self.strategy!r}")
        for name in ("seed", "data_seed"):
            integer(name, getattr(self, name))
        for name in ("steps", "global_batch_size", "grad_accum_steps", "chunks"):
            positive_int(name, getattr(self, name))
        if self.microbatches is not None:
            positive_int("microbatches", self.microbatches)
        if self.zero_shard_size is not None:
            positive_int("zero_shard_size", self.zero_shard_size)
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        choices = (
            ("schedule", SCHEDULES),
            ("precision", PRECISIONS),
            ("activation_checkpointing", CHECKPOINTING),
            ("cp_variant", CP_VARIANTS),
        )
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                value = getattr(self, name)
                raise ValueError(f"{name} must be one of {list(allowed)}: {value!r}")
        for name in ("sequence_parallel", "offload", "find_unused_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @property
    def zero_stage(self) -> int | None:
        """The ZeRO stage of :attr:`strategy` (1-3), or ``None`` for DDP: the one
        place the strategy's name is decoded."""
        return zero_stage(self.strategy)

    # ---- JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-safe dict (model and layout nested as dicts of their fields)."""
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The inverse of :meth:`to_dict`; unknown keys are an error, missing ones
        take their defaults."""
        if not isinstance(d, dict):
            raise ValueError(f"from_dict needs a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown TrainConfig fields {unknown}: expected some of "
                f"{sorted(known)}"
            )
        d = dict(d)
        if isinstance(d.get("model"), dict):
            d["model"] = GPTConfig(**d["model"])
        if isinstance(d.get("layout"), dict):
            d["layout"] = Layout(**d["layout"])
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)

    # ---- what a world can run -----------------------------------------------------
    def resolve_layout(self, world_size: int) -> Layout:
        return self.layout or Layout(dp=world_size)

    def resolve_microbatches(self, layout: Layout) -> int:
        """Pipeline microbatches per flush and dp rank (1 without a pipeline)."""
        if layout.pp == 1:
            return 1
        return self.microbatches if self.microbatches is not None else layout.pp

    def check(self, world_size: int) -> Layout:
        """Raise ``ValueError`` if this config cannot run on ``world_size`` ranks
        (saying what to change); return the layout it will use."""
        check_strategy(self.strategy)
        layout = self.resolve_layout(world_size)
        m = self.resolve_microbatches(layout)
        layout.validate(
            world_size,
            n_layers=self.model.n_layers,
            n_heads=self.model.n_heads,
            microbatches=m if layout.pp > 1 else None,
            schedule=self.schedule if layout.pp > 1 else None,
            # a V schedule holds two stages per rank: layers split over 2·pp
            chunks=2 if layout.pp > 1 and self.schedule in V_SCHEDULES else self.chunks,
        )
        per_step = layout.dp * self.grad_accum_steps
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split into "
                f"dp={layout.dp} ranks x grad_accum_steps={self.grad_accum_steps} "
                f"equal microbatches: use a multiple of {per_step}"
            )
        if layout.pp == 1:
            for name, default in (("microbatches", None), ("chunks", 1)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)} is a pipeline option, but the "
                        f"layout {layout} has pp=1: leave {name} at {default!r} or "
                        "use pp > 1"
                    )
        else:
            per_flush = self.global_batch_size // per_step
            if per_flush % m:
                raise ValueError(
                    f"each pipeline flush gets {per_flush} sequences per dp rank "
                    f"(global_batch_size / (dp x grad_accum_steps)), which does not "
                    f"split into microbatches={m}: use a global_batch_size that is a "
                    f"multiple of {per_step * m}"
                )
            if self.schedule == "dualpipe_v" and m < 2 * layout.pp:
                raise ValueError(
                    f"dualpipe_v feeds microbatches from both ends of the V: it "
                    f"needs microbatches >= 2·pp = {2 * layout.pp}, got {m}"
                )
            if self.chunks > 1 and self.schedule != "interleaved":
                raise ValueError(
                    f"chunks={self.chunks} needs schedule='interleaved' (the other "
                    "schedules run one stage per rank)"
                )
            if self.schedule == "interleaved" and self.chunks > 1 and m % layout.pp:
                raise ValueError(
                    f"interleaved 1F1B sends microbatches in groups of pp={layout.pp}: "
                    f"use microbatches that are a multiple of {layout.pp}"
                )
        if self.sequence_parallel:
            if layout.tp == 1:
                raise ValueError(
                    "sequence_parallel splits the LayerNorm/dropout regions over "
                    f"the tp ranks, but the layout {layout} has tp=1: use tp > 1 or "
                    "sequence_parallel=False"
                )
            if self.model.seq_len % layout.tp:
                raise ValueError(
                    f"sequence parallelism splits seq_len={self.model.seq_len} over "
                    f"tp={layout.tp}: make seq_len a multiple of tp"
                )
        check_composition(self, layout)
        return layout


def check_strategy(name: str) -> str:
    """``name`` if it is a data-parallel strategy; else a ``ValueError`` that says
    what the strategy names are (and that tp and pp come from the layout)."""
    if name in STRATEGIES:
        return name
    if name in ("tp", "pp"):
        raise ValueError(
            f"strategy {name!r} is not a data-parallel flavour: tensor and pipeline "
            f"parallelism come from the layout (e.g. layout=Layout(dp=2, {name}=2)); "
            f"strategy picks what runs over dp, one of {list(STRATEGIES)}"
        )
    raise ValueError(
        f"unknown strategy {name!r}: expected one of {list(STRATEGIES)} "
        "(tensor and pipeline parallelism come from the layout)"
    )


# ---- what composes -------------------------------------------------------------------
def check_composition(config, layout) -> None:
    """Raise ``ValueError`` for a combination that cannot run, saying why and what
    to change (called by :meth:`TrainConfig.check`)."""
    zero = config.zero_stage is not None
    if zero and layout.pp > 1 and config.schedule in SPLIT_BACKWARD:
        raise ValueError(
            f"schedule {config.schedule!r} does not compose with ZeRO: it computes "
            "input and weight gradients in two backward passes, while ZeRO "
            "reduce-scatters a unit's gradient when the unit's backward ends; use "
            f"strategy='ddp' with {config.schedule}, or 1f1b/interleaved with ZeRO"
        )
    if config.zero_shard_size is not None:
        replicas = layout.dp * layout.cp
        if not zero:
            raise ValueError(
                "zero_shard_size is HSDP's shard group: it needs a ZeRO strategy "
                f"(zero1-zero3), not {config.strategy!r}"
            )
        if replicas % config.zero_shard_size:
            raise ValueError(
                f"zero_shard_size={config.zero_shard_size} does not divide the "
                f"{replicas} data-parallel ranks: HSDP cuts them into equal shard "
                "groups"
            )
    if config.offload and not zero:
        raise ValueError(
            f"offload keeps ZeRO's master shards on the host; strategy "
            f"{config.strategy!r} has none: use a zero strategy or offload=False"
        )
    _check_beyond_3d(config, layout, zero)


def _check_beyond_3d(config, layout, zero: bool) -> None:
    """What context and expert parallelism compose with (chapter 11)."""
    mc, cp, ep = config.model, layout.cp, layout.ep
    if cp > 1:
        if config.schedule in SPLIT_BACKWARD and layout.pp > 1:
            raise ValueError(
                f"schedule {config.schedule!r} with cp={cp} is not composed in dtlab: "
                "its deferred weight-gradient pass would run the ring's backward (and "
                "its collectives) a second time; use '1f1b' or 'interleaved'"
            )
        if config.activation_checkpointing == "selective":
            raise ValueError(
                "selective recomputation with cp > 1 is not composed in dtlab: ring "
                "attention already keeps no score matrix (it recomputes its blocks "
                "in backward), and recomputing Ulysses' core would rerun its "
                "all-to-alls; use 'full' (the block's forward, collectives and all, "
                "runs again) or 'none'"
            )
        if config.cp_variant == "ring" and mc.seq_len % (2 * cp):
            raise ValueError(
                f"ring attention gives each of cp={cp} ranks two of 2*cp equal "
                f"chunks of the sequence: seq_len={mc.seq_len} must be a multiple "
                f"of {2 * cp}"
            )
        heads = mc.n_heads // layout.tp  # the heads a tp rank computes
        if config.cp_variant == "ulysses" and (mc.seq_len % cp or heads % cp):
            raise ValueError(
                f"Ulysses gives each of cp={cp} ranks seq_len/cp tokens, then "
                f"1/cp of the heads a rank computes: seq_len={mc.seq_len} and "
                f"n_heads/tp={heads} must be multiples of {cp}"
            )
        if config.sequence_parallel and (mc.seq_len // cp) % layout.tp:
            raise ValueError(
                f"sequence parallelism splits a cp rank's seq_len/cp="
                f"{mc.seq_len // cp} tokens over tp={layout.tp}: make it a multiple"
            )
    if mc.n_experts > 1:
        for axis in ("tp", "pp"):
            if layout.size(axis) > 1:
                raise ValueError(
                    f"a mixture of experts with {axis}={layout.size(axis)} is not "
                    "composed in dtlab: tensor-parallel blocks and pipeline stages "
                    "build the dense MLP; use n_experts=1 there, or tp=pp=1"
                )
    if ep > 1:
        if mc.n_experts == 1:
            raise ValueError(
                f"ep={ep} shards a mixture of experts, but the model has none: "
                "give it GPTConfig(n_experts=E) with E a multiple of ep, or ep=1"
            )
        if mc.n_experts % ep:
            raise ValueError(
                f"ep={ep} ranks each hold n_experts/ep experts: n_experts="
                f"{mc.n_experts} must be a multiple of {ep}"
            )
        if zero:
            raise ValueError(
                f"ep={ep} with {config.strategy} is not composed in dtlab: ZeRO "
                "would reduce the experts over every replica, but each expert lives "
                "on one rank of each ep group; use strategy='ddp' with ep > 1"
            )

"""One training loop for every strategy: a :class:`TrainConfig` in, per-step records
out, on the current process group.

Taught in chapter 02 (its first user, DDP); chapter 03 adds the ZeRO stages, and
chapters 07 (3D parallelism) and 08 (memory techniques) drive every composition
through it, so the lab, the benchmarks and the parity tests run all of them the same
way. ``strategy`` names what runs over the data-parallel axis (``ddp``,
``zero1``-``zero3``); tensor and pipeline parallelism come from ``layout``. Plain fp32
data parallelism runs the classes below; any other layout or option (tp, pp,
bf16/fp16, activation checkpointing) is composed by :mod:`dtlab.parallelize`, in one
fixed order, with the same strategy name.

``train(config, topo=None)`` runs on *every* rank of the world: under the lab's
engines (``dtlab.lab.training.train(cluster, config)``), under
:func:`dtlab.launch.spawn`, or under torchrun. Each step:

1. every rank draws the same global batch (:class:`dtlab.model.SyntheticTokens`, a
   pure function of the step) and keeps its data-parallel slice, cut into
   ``grad_accum_steps`` micro-batches;
2. forward and backward on each micro-batch, the loss divided by the number of
   micro-batches so that their gradients add up to the gradient of the slice's mean;
   all but the last under the strategy's ``no_sync()``;
3. the strategy finishes its gradient synchronization, the global gradient norm is
   measured (and clipped, if asked), and the optimizer steps;
4. a record ``{step, rank, strategy, loss, local_loss, grad_norm, lr, tokens,
   time_s, ...}`` is returned, and emitted as a telemetry event of kind ``"step"``
   (what the notebook's live plots listen to). ``loss`` is the mean over the global
   batch (the local losses averaged over the data-parallel ranks), the number to
   compare with :func:`dtlab.reference.train_reference`.

Adding a data-parallel strategy: subclass :class:`Strategy`, implement ``build`` (and
whatever of ``no_sync``, ``finish_gradient_synchronization``, ``grad_norm``,
``full_parameters`` and ``train_step`` differs), decorate it with
``@register_strategy("name")``, add the config fields it needs to
:class:`TrainConfig` with defaults, and teach :mod:`dtlab.parallelize` to wrap a
(tensor-parallel) stage with it.

Resuming: :meth:`Trainer.state_dict` is this rank's whole training state (its
shards, optimizer, loss scaler, step, random state); a fresh trainer of the same
config at the same coordinates continues from it with the same losses.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dtlab import comm, telemetry
from dtlab.model import GPT, GPTConfig, SyntheticTokens, shard_batch
from dtlab.reference import grad_norm, make_optimizer
from dtlab.topology import Layout, Topology

__all__ = [
    "TrainConfig",
    "Strategy",
    "DDPStrategy",
    "STRATEGIES",
    "register_strategy",
    "Trainer",
    "train",
]

STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(name: str):
    """Class decorator: make a :class:`Strategy` available as
    ``TrainConfig(strategy=name)``."""

    def wrap(cls):
        cls.name = name
        STRATEGIES[name] = cls
        return cls

    return wrap


PRECISIONS = ("fp32", "bf16", "fp16")  # dtlab.amp policies
CHECKPOINTING = ("none", "selective", "full")
# dtlab.pipeline.SCHEDULES, spelled as configs spell them
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {what}, got {value!r}")


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
      together), ``grad_accum_steps`` (micro-batches per rank and step; with pp > 1,
      pipeline flushes per step).
    - Pipeline (chapter 05, when ``pp > 1``): ``schedule`` (``gpipe``, ``1f1b``,
      ``interleaved``, ``zb_h1``), ``microbatches`` per flush and dp rank (None: pp),
      ``chunks`` (virtual stages per rank, interleaved only).
    - Tensor parallelism (chapter 04): ``sequence_parallel`` (needs tp > 1).
    - ``precision``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (chapter 06, :mod:`dtlab.amp`:
      16-bit compute with fp32 master weights; fp16 adds the dynamic loss scaler).
    - ``activation_checkpointing``: ``"none"``, ``"selective"`` (recompute the
      attention core) or ``"full"`` (recompute each block), chapter 08.
    - AdamW: ``lr``, ``weight_decay``, ``betas``; ``grad_clip`` (global norm) or None.
    - DDP: ``bucket_cap_mb``, ``find_unused_parameters``. ZeRO: ``offload``.

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
    # ---- precision (chapter 06) and activation memory (chapter 08)
    precision: str = "fp32"
    activation_checkpointing: str = "none"
    # ---- DDP (chapter 02)
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    # ---- ZeRO (chapter 03): master weights, gradients, optimizer state on the host
    offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, GPTConfig):
            raise ValueError(f"model must be a GPTConfig, got {type(self.model)}")
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise ValueError(f"layout must be a Layout or None, got {self.layout!r}")
        if not isinstance(self.strategy, str):
            raise ValueError(f"strategy must be a name, got {self.strategy!r}")
        for name in ("steps", "seed", "data_seed"):
            _check_int(name, getattr(self, name), 0)
        for name in ("global_batch_size", "grad_accum_steps", "chunks"):
            _check_int(name, getattr(self, name), 1)
        if self.microbatches is not None:
            _check_int("microbatches", self.microbatches, 1)
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        choices = (
            ("schedule", PIPELINE_SCHEDULES),
            ("precision", PRECISIONS),
            ("activation_checkpointing", CHECKPOINTING),
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
        cls = strategy_class(self.strategy)
        layout = self.resolve_layout(world_size)
        m = self.resolve_microbatches(layout)
        layout.validate(
            world_size,
            n_layers=self.model.n_layers,
            n_heads=self.model.n_heads,
            microbatches=m if layout.pp > 1 else None,
            schedule=self.schedule if layout.pp > 1 else None,
            chunks=self.chunks,
        )
        per_step = layout.dp * self.grad_accum_steps
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split into "
                f"dp={layout.dp} ranks x grad_accum_steps={self.grad_accum_steps} "
                f"equal micro-batches: use a multiple of {per_step}"
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
        cls.check(self, layout)
        return layout


def strategy_class(name: str) -> type[Strategy]:
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name in ("tp", "pp"):
        raise ValueError(
            f"strategy {name!r} is not a data-parallel flavour: tensor and pipeline "
            f"parallelism come from the layout (e.g. layout=Layout(dp=2, {name}=2)); "
            f"strategy picks what runs over dp, one of {sorted(STRATEGIES)}"
        )
    raise ValueError(
        f"unknown strategy {name!r}: expected one of {sorted(STRATEGIES)} "
        "(tensor and pipeline parallelism come from the layout)"
    )


# ---- strategies ----------------------------------------------------------------------
class Strategy:
    """How one strategy builds the model on this rank and runs a step.

    The default :meth:`train_step` is the data-parallel loop (accumulation, sync,
    clip, step); strategies whose step is different (a pipeline schedule) override
    it. ``self.dp`` is the data-parallel :class:`~dtlab.topology.Axis`.
    """

    name = ""
    emits_backward_spans = False  # True if the wrapper records its own "B" spans

    def __init__(self, config: TrainConfig, topo: Topology):
        self.config = config
        self.topo = topo
        self.dp = topo.axis("dp")
        cfg = config.model
        self.data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=config.data_seed)
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.device = default_device()
        self._counted_steps, self._activation_peak = 0, 0

    @classmethod
    def check(cls, config: TrainConfig, layout: Layout) -> None:
        """Raise ``ValueError`` if this strategy cannot run ``config`` on ``layout``."""

    def build(self) -> None:
        """Create ``self.model`` (what forward is called on) and ``self.optimizer``."""
        raise NotImplementedError

    def no_sync(self):
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self) -> None:
        pass

    def parameters(self):
        return self.model.parameters()

    def clip_and_norm(self) -> float:
        """The global gradient norm before clipping (clipped in place if asked); the
        same call the reference makes, on gradients every rank holds in full."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self.config.grad_clip is not None:
            return float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
        return grad_norm(params)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """``{name: full tensor}`` as in the unwrapped GPT (parity tests)."""
        model = getattr(self.model, "module", self.model)
        return {n: p.detach() for n, p in model.named_parameters()}

    def step_extras(self) -> dict:
        """Strategy-specific fields added to each step's record."""
        return {}

    # ---- this rank's training state (resume) -----------------------------------------
    def state_dict(self) -> dict:
        """This rank's model state and optimizer state, as copies."""
        return copy.deepcopy(
            {"model": self.model_state(), "optimizer": self.optimizer.state_dict()}
        )

    def load_state_dict(self, state: dict) -> None:
        self.load_model_state(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))

    def model_state(self) -> dict:
        return getattr(self.model, "module", self.model).state_dict()

    def load_model_state(self, state: dict) -> None:
        getattr(self.model, "module", self.model).load_state_dict(state)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of the global batch of ``step``, in equal micro-batches."""
        x, y = self.data.batch(step, self.config.global_batch_size)  # (B, T) each
        x, y = shard_batch(x, y, self.dp.index, self.dp.size)  # (B/dp, T)
        x, y = x.to(self.device), y.to(self.device)
        k = self.config.grad_accum_steps
        return list(zip(x.chunk(k), y.chunk(k)))  # k x (B/(dp·k), T)

    # Saved-tensor hooks see every tensor autograd keeps, which costs about 10 % of
    # a small CPU step, and a config saves the same activations every step: count
    # the first recorded steps, then report what they counted.
    COUNTED_STEPS = 2

    def activation_counter(self, rec, weights) -> _SavedBytes | None:
        """A counter of this step's saved activations, or None when not needed."""
        if not rec.enabled or self._counted_steps >= self.COUNTED_STEPS:
            return None
        self._counted_steps += 1
        return _SavedBytes(weights)

    def activation_peak(self, counter: _SavedBytes | None) -> int:
        if counter is not None:
            self._activation_peak = counter.peak
        return self._activation_peak

    def mean_over_dp(self, value: float) -> float:
        if self.dp.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, group=self.dp, tag="metrics")
        return float(t[0]) / self.dp.size

    def train_step(self, step: int) -> dict:
        rec = telemetry.current()
        t0 = telemetry.clock()
        micro = self.micro_batches(step)
        k = len(micro)
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        weights = getattr(self.model, "module", self.model).parameters()
        counter = self.activation_counter(rec, weights)
        for m, (x, y) in enumerate(micro):
            # every micro-batch but the last accumulates without communicating
            with self.no_sync() if m < k - 1 else contextlib.nullcontext():
                with rec.span("F", microbatch=m), counter or contextlib.nullcontext():
                    _, loss = self.model(x, y)
                # mean over the slice = mean of the equal micro-batch means
                scaled = loss / k if k > 1 else loss
                if self.emits_backward_spans:
                    scaled.backward()
                else:
                    with rec.span("B", microbatch=m):
                        scaled.backward()
            losses.append(loss.detach())
        self.finish_gradient_synchronization()
        norm = self.clip_and_norm()
        with rec.span("opt"):
            self.optimizer.step()
        local = float(sum(losses) / k) if k > 1 else float(losses[0])
        if rec.enabled:
            mem = self.memory(self.activation_peak(counter))
            mem.setdefault("buffers", 0)
            # what this rank holds at once, at most: state plus a step's activations
            mem.setdefault("peak", sum(v for k, v in mem.items() if k in _HELD))
            rec.memory("step", **mem)
        return self.record(step, self.mean_over_dp(local), local, norm, t0)

    def record(self, step, loss, local, norm, t0) -> dict:
        """The step's record (see the module docstring), with this rank's layout
        coordinates and the global throughput of the step."""
        cfg = self.config
        seconds = telemetry.clock() - t0
        tokens_step = cfg.global_batch_size * cfg.model.seq_len
        return {
            "step": step,
            "rank": self.topo.rank,
            "strategy": self.name,
            "loss": loss,
            "local_loss": local,
            "grad_norm": norm,
            "lr": cfg.lr,
            "tokens": (step + 1) * tokens_step,
            "time_s": seconds,
            "tokens_per_s": tokens_step / seconds if seconds > 0 else float("inf"),
            "coords": dict(self.topo.coords),
            **self.step_extras(),
        }

    def memory(self, activations: int) -> dict[str, int]:
        """Bytes this rank holds, by category (after the optimizer step)."""
        params = list(self.parameters())
        state = self.optimizer.state.values() if self.optimizer else []
        return {
            "params": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params),
            "optimizer": sum(
                _nbytes(v) for s in state for v in s.values() if torch.is_tensor(v)
            ),
            "activations": activations,
        }


_HELD = ("params", "grads", "optimizer", "buffers", "activations")


def default_device() -> torch.device:
    """Where this rank computes: its GPU under nccl (the launcher chose it with
    ``torch.cuda.set_device``), the CPU under gloo or without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a forward (activations;
    the weights it saves are not counted). ``peak`` is the largest forward seen.

    ``params``: the weights the model computes with. Their storage can move (ZeRO-3
    gathers a block's weights into a fresh allocation before its forward), so an
    unknown storage is checked against where the weights are *now*."""

    def __init__(self, params):
        self._params = list(params)
        self.peak = 0

    def _weight_ptrs(self) -> set:
        return {p.untyped_storage().data_ptr() for p in self._params}

    def __enter__(self):
        counted = set()
        self._now = 0

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in counted and key not in self._weight_ptrs():
                counted.add(key)
                self._now += t.untyped_storage().nbytes()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.peak = max(self.peak, self._now)


class _DataParallel(Strategy):
    """DDP and ZeRO split only the batch: every rank runs the whole model. These
    classes run the plain case (dp only, fp32, no recomputation) exactly as chapters
    02 and 03 teach it; any other layout or option is composed by
    :mod:`dtlab.parallelize` with the same strategy name over the dp axis."""

    @classmethod
    def check(cls, config, layout):
        if config.offload and not cls.name.startswith("zero"):
            raise ValueError(
                f"offload keeps ZeRO's master shards on the host; strategy "
                f"{cls.name!r} has none: use a zero strategy or offload=False"
            )
        if needs_composition(config, layout):
            from dtlab.parallelize import check_composition

            check_composition(config, layout)


def needs_composition(config: TrainConfig, layout: Layout) -> bool:
    """Whether ``config`` goes through :mod:`dtlab.parallelize` (anything beyond plain
    fp32 data parallelism)."""
    return (
        layout.tp > 1
        or layout.pp > 1
        or config.precision != "fp32"
        or config.activation_checkpointing != "none"
    )


@register_strategy("ddp")
class DDPStrategy(_DataParallel):
    """Data parallelism with :class:`dtlab.ddp.DistributedDataParallel` over the dp
    axis: full replicas, the batch split, gradients all-reduced in buckets."""

    emits_backward_spans = True

    def build(self):
        from dtlab.ddp import DistributedDataParallel

        cfg = self.config
        model = GPT(cfg.model, seed=cfg.seed).to(self.device)
        model.train()
        self.model = DistributedDataParallel(
            model,
            bucket_cap_mb=cfg.bucket_cap_mb,
            process_group=self.dp,
            find_unused_parameters=cfg.find_unused_parameters,
        )
        self.optimizer = make_optimizer(
            self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.betas
        )

    def no_sync(self):
        return self.model.no_sync()

    def finish_gradient_synchronization(self):
        self.model.finish_gradient_synchronization()

    def memory(self, activations):
        out = super().memory(activations)
        out["buffers"] = sum(
            _nbytes(b.buffer) for b in self.model.buckets if b.buffer is not None
        )
        return out

    def step_extras(self):
        s = self.model.last_sync
        with torch.no_grad():
            # identical on every rank iff the replicas are identical
            digest = sum(
                float(p.double().sum()) * (i + 1)
                for i, p in enumerate(self.model.module.parameters())
            )
        return {
            "buckets": s.get("buckets", 0),
            "wire_bytes": s.get("wire_bytes", 0.0),
            "backward_s": s.get("backward_s", 0.0),
            "comm_s": s.get("comm_s", 0.0),
            "exposed_comm_s": s.get("exposed_s", 0.0),
            "overlap": s.get("overlap", 1.0),
            "replica_digest": digest,
        }


class _ZeroStrategy(_DataParallel):
    """ZeRO over the dp axis with :class:`dtlab.zero.FullyShardedDataParallel`:
    stage 1 shards optimizer states, 2 also gradients, 3 also parameters. Each
    rank's optimizer steps only its fp32 shard (chapter 03)."""

    stage = 3

    def build(self):
        from dtlab.zero import FullyShardedDataParallel

        cfg = self.config
        model = GPT(cfg.model, seed=cfg.seed).to(self.device)
        model.train()
        self.model = FullyShardedDataParallel(
            model,
            None,  # fp32 here; 16-bit runs are composed by dtlab.parallelize
            self.dp,
            stage=self.stage,
            offload=cfg.offload,
        )
        self.optimizer = make_optimizer(
            self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.betas
        )

    def no_sync(self):
        # stages 0-1 hold the full gradient anyway: accumulate, reduce once per
        # step; stages 2-3 reduce-scatter after every micro-batch (dtlab.zero)
        if self.stage <= 1:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def finish_gradient_synchronization(self):
        self.model.finish_gradient_synchronization()

    def clip_and_norm(self) -> float:
        # the norm of the full gradient, from the shards (one all-reduce of squares)
        return float(self.model.clip_grad_norm_(self.config.grad_clip))

    def full_parameters(self):
        return self.model.gather_full_params()

    def model_state(self):
        return self.model.state_dict()  # this rank's local shards

    @torch.no_grad()
    def load_model_state(self, state):
        for name, shard in self.model.named_parameters():
            shard.copy_(state[name])
        self.model.sync_params()  # the full weights follow the shards

    def memory(self, activations):
        from dtlab.memory import count_bytes

        out = count_bytes(self.model.memory_tensors(self.optimizer))
        out["activations"] = activations
        return out


@register_strategy("zero1")
class Zero1Strategy(_ZeroStrategy):
    stage = 1


@register_strategy("zero2")
class Zero2Strategy(_ZeroStrategy):
    stage = 2


@register_strategy("zero3")
class Zero3Strategy(_ZeroStrategy):
    stage = 3


# ---- running -------------------------------------------------------------------------
class Trainer:
    """Build ``config``'s strategy on this rank (a collective call: every rank of the
    world constructs one) and train with :meth:`fit`.

    ``topo`` reuses an existing :class:`~dtlab.topology.Topology` (its layout must be
    the config's); without one, a topology is built (creating process groups).
    """

    def __init__(self, config: TrainConfig, topo: Topology | None = None):
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config must be a TrainConfig, got {type(config)}")
        live = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if live else 1
        if topo is not None and config.layout is None:
            config = config.replace(layout=topo.layout)
        layout = config.check(world)
        if topo is None:
            topo = Topology(layout, None if live else 0)
        elif topo.layout != layout:
            raise ValueError(
                f"topo has layout {topo.layout} but the config asks for {layout}: "
                "pass a matching topology, or topo=None"
            )
        self.config = config
        self.topo = topo
        if needs_composition(config, layout):
            from dtlab.parallelize import ParallelStrategy

            self.strategy = ParallelStrategy(config, topo)
        else:
            self.strategy = strategy_class(config.strategy)(config, topo)
        self.strategy.build()
        self.records: list[dict] = []
        self.step = 0

    def fit(self, steps: int | None = None) -> list[dict]:
        """Run ``steps`` more steps (default: the config's); return all records."""
        rec = telemetry.current()
        steps = self.config.steps if steps is None else steps
        for _ in range(steps):
            rec.step = self.step
            record = self.strategy.train_step(self.step)
            self.records.append(record)
            rec.emit("step", **record)
            self.step += 1
        return self.records

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.strategy.full_parameters()

    def state_dict(self) -> dict:
        """Everything this rank needs to continue the run: its model state (its
        shards, under ZeRO, TP or PP), its optimizer state (master weights and the
        loss scaler under 16 bits), the step counter and the random state. Per
        rank: every rank saves its own, and loads it back into a trainer built with
        the same config at the same coordinates; :meth:`fit` then continues with
        the losses of the run that never stopped."""
        return {
            "step": self.step,
            "config": self.config.to_dict(),
            "coords": dict(self.topo.coords),
            "rng": torch.get_rng_state(),
            "strategy": self.strategy.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (of this rank, same config)."""
        mine = self.config.to_dict()
        theirs = state["config"]
        changed = sorted(
            k for k in mine if k not in ("steps",) and mine[k] != theirs.get(k)
        )
        if changed:
            raise ValueError(
                f"the state was saved from another config (differs in {changed}): "
                "build the trainer with the config it was saved from"
            )
        if state["coords"] != self.topo.coords:
            raise ValueError(
                f"the state belongs to the rank at {state['coords']}, this rank is at "
                f"{self.topo.coords}: load each rank's own state"
            )
        self.strategy.load_state_dict(state["strategy"])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])


def train(config: TrainConfig, topo: Topology | None = None) -> list[dict]:
    """Train ``config`` on the current process group; this rank's per-step records."""
    return Trainer(config, topo).fit()

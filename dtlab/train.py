"""One training loop for every strategy: a :class:`TrainConfig` in, per-step records
out, on the current process group.

Taught in chapter 02 (its first user, DDP); each later chapter registers its strategy
here, so the lab, the benchmarks and the parity tests drive all of them the same way.

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

Adding a strategy: subclass :class:`Strategy`, implement ``build`` (and whatever of
``no_sync``, ``finish_gradient_synchronization``, ``grad_norm``, ``full_parameters``
and ``train_step`` differs), decorate it with ``@register_strategy("name")``, and add
the config fields it needs to :class:`TrainConfig` with defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
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
    "PLANNED_STRATEGIES",
    "register_strategy",
    "Trainer",
    "train",
    "bench",
    "format_bench",
]

STRATEGIES: dict[str, type[Strategy]] = {}
# names the course will teach, not registered yet: asking for one is not a typo
PLANNED_STRATEGIES = ("tp", "pp")


def register_strategy(name: str):
    """Class decorator: make a :class:`Strategy` available as
    ``TrainConfig(strategy=name)``."""

    def wrap(cls):
        cls.name = name
        STRATEGIES[name] = cls
        return cls

    return wrap


COMPUTE_DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- configuration -------------------------------------------------------------------
@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs; the same config gives the same numbers on any launcher.

    - ``model``: the GPT to train; ``seed`` its init, ``data_seed`` the data.
    - ``layout``: ``Layout(dp, tp, pp)``; ``None`` means data parallel over the whole
      world (``dp = world size``).
    - ``strategy``: a name in :data:`STRATEGIES` (``"ddp"``; the ZeRO stages, tensor
      and pipeline parallelism register themselves in later chapters).
    - ``steps``, ``global_batch_size`` (sequences per optimizer step, all ranks
      together), ``grad_accum_steps`` (micro-batches per rank and step).
    - AdamW: ``lr``, ``weight_decay``, ``betas``; ``grad_clip`` (global norm) or None.
    - DDP: ``bucket_cap_mb``, ``find_unused_parameters``.
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
    # ---- DDP (chapter 02)
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    # ---- ZeRO (chapter 03): 16-bit compute with fp32 master shards; CPU offload
    compute_dtype: str | None = None
    offload: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, GPTConfig):
            raise ValueError(f"model must be a GPTConfig, got {type(self.model)}")
        if self.layout is not None and not isinstance(self.layout, Layout):
            raise ValueError(f"layout must be a Layout or None, got {self.layout!r}")
        if not isinstance(self.strategy, str):
            raise ValueError(f"strategy must be a name, got {self.strategy!r}")
        for name in ("steps", "seed", "data_seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("global_batch_size", "grad_accum_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, "
                f"got {self.compute_dtype!r}"
            )

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def resolve_layout(self, world_size: int) -> Layout:
        return self.layout or Layout(dp=world_size)

    def check(self, world_size: int) -> Layout:
        """Raise ``ValueError`` (or ``NotImplementedError`` for a strategy the course
        has not reached yet) if this config cannot run on ``world_size`` ranks;
        return the layout it will use."""
        cls = strategy_class(self.strategy)
        layout = self.resolve_layout(world_size)
        layout.validate(
            world_size, n_layers=self.model.n_layers, n_heads=self.model.n_heads
        )
        per_step = layout.dp * self.grad_accum_steps
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} does not split into "
                f"dp={layout.dp} ranks x grad_accum_steps={self.grad_accum_steps} "
                f"equal micro-batches: use a multiple of {per_step}"
            )
        cls.check(self, layout)
        return layout


def strategy_class(name: str) -> type[Strategy]:
    if name in STRATEGIES:
        return STRATEGIES[name]
    if name in PLANNED_STRATEGIES:
        raise NotImplementedError(
            f"strategy {name!r} is not implemented yet: its chapter registers it "
            f"with @register_strategy({name!r}); available now: {sorted(STRATEGIES)}"
        )
    raise ValueError(
        f"unknown strategy {name!r}: expected one of {sorted(STRATEGIES)} "
        f"(coming later: {', '.join(PLANNED_STRATEGIES)})"
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

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of the global batch of ``step``, in equal micro-batches."""
        x, y = self.data.batch(step, self.config.global_batch_size)  # (B, T) each
        x, y = shard_batch(x, y, self.dp.index, self.dp.size)  # (B/dp, T)
        k = self.config.grad_accum_steps
        return list(zip(x.chunk(k), y.chunk(k)))  # k x (B/(dp·k), T)

    def mean_over_dp(self, value: float) -> float:
        if self.dp.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        comm.all_reduce(t, group=self.dp, tag="metrics")
        return float(t[0]) / self.dp.size

    def train_step(self, step: int) -> dict:
        cfg, rec = self.config, telemetry.current()
        t0 = telemetry.clock()
        micro = self.micro_batches(step)
        k = len(micro)
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        counter = _SavedBytes(self.parameters()) if rec.enabled else None
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
            rec.memory("step", **self.memory(counter.peak if counter else 0))
        return {
            "step": step,
            "rank": self.topo.rank,
            "strategy": self.name,
            "loss": self.mean_over_dp(local),
            "local_loss": local,
            "grad_norm": norm,
            "lr": cfg.lr,
            "tokens": (step + 1) * cfg.global_batch_size * cfg.model.seq_len,
            "time_s": telemetry.clock() - t0,
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


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a forward (activations;
    the weights it saves are not counted). ``peak`` is the largest forward seen."""

    def __init__(self, params):
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self.peak = 0

    def __enter__(self):
        seen = set(self._skip)
        self._now = 0

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                self._now += t.untyped_storage().nbytes()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.peak = max(self.peak, self._now)


class _DataParallel(Strategy):
    """DDP and ZeRO split only the batch: every rank runs the whole model."""

    @classmethod
    def check(cls, config, layout):
        if layout.tp != 1 or layout.pp != 1:
            raise ValueError(
                f"strategy {cls.name!r} is data parallel only: it needs tp=1 and "
                f"pp=1, got layout {layout}; use Layout(dp=world_size)"
            )


@register_strategy("ddp")
class DDPStrategy(_DataParallel):
    """Data parallelism with :class:`dtlab.ddp.DistributedDataParallel` over the dp
    axis: full replicas, the batch split, gradients all-reduced in buckets."""

    emits_backward_spans = True

    def build(self):
        from dtlab.ddp import DistributedDataParallel

        cfg = self.config
        model = GPT(cfg.model, seed=cfg.seed)
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
        model = GPT(cfg.model, seed=cfg.seed)
        model.train()
        self.model = FullyShardedDataParallel(
            model,
            COMPUTE_DTYPES[cfg.compute_dtype],
            self.dp,
            stage=self.stage,
            offload=cfg.offload,
        )
        self.optimizer = make_optimizer(
            self.model.parameters(), cfg.lr, cfg.weight_decay, cfg.betas
        )

    def finish_gradient_synchronization(self):
        self.model.finish_gradient_synchronization()

    def clip_and_norm(self) -> float:
        # the norm of the full gradient, from the shards (one all-reduce of squares)
        return float(self.model.clip_grad_norm_(self.config.grad_clip))

    def full_parameters(self):
        return self.model.gather_full_params()

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


def train(config: TrainConfig, topo: Topology | None = None) -> list[dict]:
    """Train ``config`` on the current process group; this rank's per-step records."""
    return Trainer(config, topo).fit()


# ---- benchmarks (``dtlab bench``) ---------------------------------------------------
BENCH_MODEL = GPTConfig(vocab_size=256, seq_len=64, n_layers=4, n_heads=4, d_model=128)


def _bench_ddp_rank(model_cfg, steps, warmup, micro_batch, bucket_cap_mb):
    """On every rank: dtlab DDP and PyTorch DDP on the same model and data, their
    steps interleaved so both see the same machine load."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from dtlab.ddp import DistributedDataParallel

    r, n = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(model_cfg.vocab_size, model_cfg.seq_len)
    impls = {
        "dtlab": DistributedDataParallel(GPT(model_cfg), bucket_cap_mb=bucket_cap_mb),
        "torch": TorchDDP(GPT(model_cfg), bucket_cap_mb=bucket_cap_mb),
    }
    opts = {k: make_optimizer(m.parameters()) for k, m in impls.items()}
    times: dict[str, list[float]] = {k: [] for k in impls}
    overlap, exposed, buckets = [], [], 0
    for step in range(warmup + steps):
        x, y = data.shard(step, micro_batch * n, r, n)
        for name, model in impls.items():
            dist.barrier()
            t0 = telemetry.clock()
            opts[name].zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            opts[name].step()
            if step >= warmup:
                times[name].append(telemetry.clock() - t0)
                if name == "dtlab":
                    overlap.append(model.last_sync["overlap"])
                    exposed.append(model.last_sync["exposed_s"])
                    buckets = model.last_sync["buckets"]
    return {
        "world_size": n,
        "dtlab_step_s": statistics.median(times["dtlab"]),
        "torch_step_s": statistics.median(times["torch"]),
        "overlap": statistics.median(overlap),
        "exposed_s": statistics.median(exposed),
        "buckets": buckets,
        "params": sum(p.numel() for p in impls["dtlab"].parameters()),
    }


def bench(
    strategy: str = "ddp",
    world_sizes=(2, 4),
    *,
    steps: int = 20,
    warmup: int = 3,
    micro_batch: int = 4,
    bucket_cap_mb: float = 0.25,
    model: GPTConfig = BENCH_MODEL,
) -> list[dict]:
    """Step time of dtlab's implementation against PyTorch's, same model, same run,
    on fresh processes (:func:`dtlab.launch.spawn`); one row per world size (rank
    0's medians). A benchmark, not a test: the numbers depend on the machine."""
    from dtlab.launch import spawn

    if strategy != "ddp":
        strategy_class(strategy)  # a clear error for unknown names
        raise NotImplementedError(f"no benchmark for strategy {strategy!r} yet")
    rows = []
    for n in world_sizes:
        out = spawn(
            _bench_ddp_rank, n, model, steps, warmup, micro_batch, bucket_cap_mb,
            timeout=120,
        )  # fmt: skip
        rows.append(out[0])
    return rows


def format_bench(rows) -> str:
    lines = [
        f"{'N':>3} {'params':>9} {'buckets':>8} {'dtlab ms':>9} {'torch ms':>9} "
        f"{'ratio':>6} {'overlap':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['world_size']:>3} {r['params']:>9,} {r['buckets']:>8} "
            f"{r['dtlab_step_s'] * 1e3:>9.1f} {r['torch_step_s'] * 1e3:>9.1f} "
            f"{r['dtlab_step_s'] / r['torch_step_s']:>6.2f} {r['overlap']:>8.0%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m dtlab.train  (same as `dtlab bench ddp`)
    print(format_bench(bench()))

"""3D parallelism: data × tensor × pipeline, with activation checkpointing and mixed
precision, composed in one place and in one fixed order.

Taught in chapter 07 (3D parallelism: how the axes compose, and what each costs) and
chapter 08 (memory techniques: activation checkpointing, its measured saving against
Korthikanti et al.'s formula, gradient accumulation).

:class:`dtlab.train.Trainer` hands every config that is more than plain fp32 data
parallelism to :class:`ParallelStrategy`, whose :meth:`~ParallelStrategy.build`
applies, on each rank (torchtitan's ``parallelize_llama`` keeps the same order):

1. **Tensor parallelism** (Shoeybi et al. 2019; chapter 04) on the model's weights,
   first, because everything after it must see the *sharded* parameters: the
   pipeline sends tp-sized activations, checkpointing recomputes the tp collectives,
   ZeRO flattens the tp shards, the optimizer steps them.
2. **Pipeline partitioning** (chapter 05): this rank keeps its stage(s) only. With
   tp > 1 each plain :class:`~dtlab.pipeline.StageModule` (built by parameter name,
   so it matches the single-process GPT) is split over tp
   (:class:`~dtlab.tensor_parallel.TensorParallelStage`): vocab-parallel embedding
   on the first stage, column-parallel head and vocab-parallel cross-entropy on the
   last; a tied embedding is summed over the first and last stage, shard by shard.
3. **Activation checkpointing** (Chen et al. 2016; Korthikanti et al. 2022, §5;
   :mod:`dtlab.recompute`) on each transformer block, before any wrapper, so the
   wrappers' hooks see the blocks' outputs: ``full`` keeps a block's input and
   recomputes the block in backward; ``selective`` recomputes only the attention
   core ``softmax(QKᵀ/√d)·V`` (the ``5·a·s/h`` term of Korthikanti's per-layer
   ``s·b·h·(34 + 5·a·s/h)`` bytes) and keeps the rest (the 34).
4. **Data parallelism** over the dp axis: ``ddp`` (chapter 02; with a pipeline, one
   flat all-reduce after the last flush, as Megatron does) or ZeRO stage 1/2/3
   (chapter 03, :class:`~dtlab.zero.FullyShardedDataParallel` over each stage,
   FSDP + TP being the standard 2D layout). It comes after TP and PP because it
   replicates or shards *whatever this rank holds*: a stage's tp slice.
5. **Precision** (chapter 06): the policy's compute dtype (DDP casts the module
   before its buckets are built; ZeRO casts at each all-gather) and the fp32
   master weights of :class:`dtlab.amp.MixedPrecisionOptimizer`, with fp16's loss
   scaler. Overflow is agreed over the whole world: every rank skips the same step.

The global gradient norm counts each gradient element once: tp shards on every tp
rank, tp-replicated parameters on tp index 0 only, a tied head copy only on the
first stage; the squares are summed over tp and pp (and over dp under ZeRO, where
the dp ranks hold disjoint slices).

Gradient accumulation (``grad_accum_steps = k``): without a pipeline, k forward and
backward passes per step (DDP and ZeRO 0-1 under ``no_sync`` until the last); with
one, k pipeline flushes per step, each loss scaled by 1/k, and the tied-embedding and
dp sums once, after the last flush. ZeRO 2-3 hold only their gradient slice, so they
reduce-scatter after every (pipeline) micro-batch's backward instead.

What does not compose, and why (:func:`check_composition` says so before anything
runs): ZB-H1 with ZeRO (its split backward computes input and weight gradients in
two passes, while ZeRO reduce-scatters a unit's gradient when the unit's backward
ends).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from dtlab import amp, comm, telemetry
from dtlab.model import GPT, shard_batch
from dtlab.recompute import apply_activation_checkpointing
from dtlab.train import Strategy, _nbytes

__all__ = [
    "ParallelStrategy",
    "check_composition",
]


# ---- what composes -------------------------------------------------------------------
def check_composition(config, layout) -> None:
    """Raise ``ValueError`` for a combination that cannot run, saying why and what
    to change (called by :meth:`dtlab.train.TrainConfig.check`)."""
    zero = config.strategy.startswith("zero")
    if zero and layout.pp > 1 and config.schedule == "zb_h1":
        raise ValueError(
            "schedule 'zb_h1' does not compose with ZeRO: it computes input and "
            "weight gradients in two backward passes, while ZeRO reduce-scatters a "
            "unit's gradient when the unit's backward ends; use strategy='ddp' with "
            "zb_h1, or another schedule with ZeRO"
        )


# ---- the composed strategy -----------------------------------------------------------
def _blocks(module):
    blocks = module.blocks
    return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


class ParallelStrategy(Strategy):
    """Any layout ``dp × tp × pp`` with DDP or ZeRO 1/2/3 over dp, activation
    checkpointing, gradient accumulation and a precision policy (see the module
    docstring for the order and the reasons). Built by :class:`dtlab.train.Trainer`
    on every rank; ``name`` is the config's data-parallel strategy."""

    def __init__(self, config, topo):
        super().__init__(config, topo)
        self.name = config.strategy
        self.tp, self.pp = topo.axis("tp"), topo.axis("pp")
        self.policy = amp.policy(config.precision)
        self.zero_stage = (
            int(config.strategy[-1]) if config.strategy.startswith("zero") else None
        )
        self.m = config.resolve_microbatches(topo.layout)
        self.pipe = None
        self.modules: list[nn.Module] = []  # this rank's unwrapped model or stages
        self.wrapped: list[nn.Module] = []  # the same, inside their dp wrappers

    # ---- build: the fixed order ----------------------------------------------------
    def build(self) -> None:
        cfg, layout = self.config, self.topo.layout
        mc, sp = cfg.model, cfg.sequence_parallel
        tp_axis = self.tp
        # 1. tensor parallelism, 2. pipeline partitioning. Every rank first builds
        # the plain module (its weights drawn per parameter name, so any slice of
        # the model matches the single-process GPT), then keeps its tp slices.
        if layout.pp == 1:
            from dtlab.tensor_parallel import tensor_parallel_gpt

            model = GPT(mc, seed=cfg.seed)
            if layout.tp > 1:
                model = tensor_parallel_gpt(
                    model, self.topo, sequence_parallel=sp, seed=cfg.seed
                )
            self.modules = [model]
        else:
            from dtlab.pipeline import build_stages
            from dtlab.tensor_parallel import TensorParallelStage

            stages = build_stages(
                mc, layout.pp, self.pp.index, v=cfg.chunks, seed=cfg.seed
            )
            if layout.tp > 1:
                stages = [
                    TensorParallelStage.from_stage(
                        s, tp_axis, sequence_parallel=sp, seed=cfg.seed
                    )
                    for s in stages
                ]
            self.modules = stages
        for module in self.modules:
            module.to(self.device).train()  # its GPU under nccl
            if sp:
                self._sum_sequence_parallel_grads(module)
        # 3. activation checkpointing (dtlab.recompute), per block, before any
        # wrapper hooks in
        for module in self.modules:
            apply_activation_checkpointing(module, cfg.activation_checkpointing)
        # 4. data parallelism over dp, in 5.'s compute dtype
        dtype = self.policy.compute_dtype
        if self.zero_stage is None:
            for module in self.modules:
                module.to(dtype)  # DDP's buckets are built for the cast module
            if layout.pp == 1:
                from dtlab.ddp import DistributedDataParallel

                self.wrapped = [
                    DistributedDataParallel(
                        self.modules[0],
                        bucket_cap_mb=cfg.bucket_cap_mb,
                        process_group=self.dp,
                        find_unused_parameters=cfg.find_unused_parameters,
                    )
                ]
            else:  # the pipeline all-reduces over dp once, after the last flush
                self.wrapped = list(self.modules)
        else:
            from dtlab.zero import FullyShardedDataParallel

            cdtype = dtype if self.policy.has_master_copy else None
            self.wrapped = [
                FullyShardedDataParallel(
                    module,
                    cdtype,
                    self.dp,
                    stage=self.zero_stage,
                    units=self._zero_units(module),
                    offload=cfg.offload,
                )  # fmt: skip
                for module in self.modules
            ]
        self.model = self.wrapped[0] if layout.pp == 1 else None
        if layout.pp > 1:
            from dtlab.pipeline import Pipeline

            self.pipe = Pipeline(
                mc, self.topo, cfg.schedule, microbatches=self.m, chunks=cfg.chunks,
                seed=cfg.seed, stages=self.wrapped, loss_fn=self._loss_fn(),
                act_dtype=dtype, seq_split=layout.tp if sp else 1,
            )  # fmt: skip
        # 5. precision: fp32 masters and the loss scaler. ZeRO's shards already are
        # fp32 masters, so its optimizer runs the fp32 policy with the scaler
        params = [p for w in self.wrapped for p in w.parameters()]
        precision = "fp32" if self.zero_stage is not None else self.policy
        self.optimizer = amp.MixedPrecisionOptimizer(
            params, torch.optim.AdamW, precision, scaler=self.policy.scaler(),
            groups=None, grad_clip=cfg.grad_clip, norm_fn=self._make_norm_fn(),
            lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=1e-8,
        )  # fmt: skip

    def _zero_units(self, module):
        """ZeRO units: each block; with a tied embedding across pipeline stages, also
        the embedding (first stage) or the head (last stage) alone, so that both
        ranks' flat slices of it line up element for element and can be summed."""
        units = _blocks(module)
        if self.pp.size > 1 and self.config.model.tied_head:
            if module.first:
                units.append(module.wte)
            if module.last:
                units.append(module.head)
        return units

    def _loss_fn(self):
        last = self.modules[-1]
        return last.loss  # StageModule.loss, or vocab-parallel cross-entropy

    def _sum_sequence_parallel_grads(self, module) -> None:
        """Under sequence parallelism the LayerNorms, row-parallel biases and position
        embedding see only this rank's tokens: their gradients are partial sums over
        tp. Summing each as it is produced (a hook before accumulation) keeps every
        later stage (accumulation, DDP buckets, ZeRO's reduce-scatter) unaware."""
        axis = self.tp

        def hook(grad):
            grad = grad.clone(memory_format=torch.contiguous_format)
            comm.all_reduce(grad, group=axis, tag="sp_grads")
            return grad

        for p in module.parameters():
            if getattr(p, "sequence_parallel", False):
                p.register_hook(hook)

    # ---- the global gradient norm --------------------------------------------------
    def _counted(self, module, param) -> bool:
        """Whether this rank counts ``param``'s gradient in the global norm."""
        if getattr(param, "tensor_parallel_dim", None) is None and self.tp.index:
            return False  # replicated over tp: tp index 0 counts it
        tied_copy = (
            self.pp.size > 1
            and self.config.model.tied_head
            and getattr(module, "last", False)
            and not getattr(module, "first", False)
            and param is getattr(getattr(module, "head", None), "weight", None)
        )
        return not tied_copy  # the first stage counts the tied embedding

    def _make_norm_fn(self):
        if self.zero_stage is None:
            weights = []
            for module in self.modules:
                seen = set()
                for p in module.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        weights.append(1.0 if self._counted(module, p) else 0.0)
            axes = (self.tp, self.pp)
        else:
            weights = []  # per local shard: 1 where this rank counts it
            for module, wrapper in zip(self.modules, self.wrapped):
                for shard in wrapper.local_shards():
                    if shard.tensor.requires_grad:  # what the optimizer steps
                        counted = self._counted(module, shard.param)
                        weights.append(1.0 if counted else 0.0)
            axes = (self.dp, self.tp, self.pp)

        def norm_fn(grads) -> float:
            sq = torch.zeros((), dtype=torch.float64, device=self.device)
            for g, w in zip(grads, weights):
                if g is None:
                    continue
                g2 = g.detach().double().pow(2)
                sq += (g2 * w).sum() if torch.is_tensor(w) else w * g2.sum()
            for axis in axes:
                if axis.size > 1:
                    comm.all_reduce(sq, group=axis, tag="grad_norm")
            return float(sq.sqrt())

        return norm_fn

    # ---- one step ------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        rec = telemetry.current()
        t0 = telemetry.clock()
        self.optimizer.zero_grad()
        for w in self.wrapped:
            w.zero_grad(set_to_none=True)
        if self.pipe is None:
            local, activations = self._flat_step(step, rec)
        else:
            local, activations = self._pipeline_step(step, rec)
        with rec.span("opt"):
            stepped = self.optimizer.step()
        if rec.enabled:
            rec.memory("step", **self.memory(activations))
        out = self.record(
            step, self.mean_over_dp(local), local, self.optimizer.last_grad_norm, t0
        )
        out["skipped"] = not stepped
        out["loss_scale"] = self.optimizer.scaler.scale_value
        return out

    def _flat_step(self, step, rec):
        """No pipeline: k micro-batches through the (tensor-parallel) model."""
        micro = self.micro_batches(step)
        k = len(micro)
        model, scaler = self.model, self.optimizer.scaler
        ddp = self.zero_stage is None
        counter = self.activation_counter(rec, self._weights())
        losses = []
        for m, (x, y) in enumerate(micro):
            # every micro-batch but the last accumulates without communicating
            # (DDP, ZeRO 0-1; ZeRO 2-3 reduce-scatter each one, see dtlab.zero)
            last = m == k - 1
            with self._no_sync(model) if not last else contextlib.nullcontext():
                with rec.span("F", microbatch=m), counter or contextlib.nullcontext():
                    _, loss = model(x, y)
                scaled = scaler.scale(loss / k if k > 1 else loss)
                # DDP records its own "B" span (with its bucket timings)
                with contextlib.nullcontext() if ddp else rec.span("B", microbatch=m):
                    scaled.backward()
            losses.append(float(loss.detach()))
        model.finish_gradient_synchronization()
        return sum(losses) / k, self.activation_peak(counter)

    def _no_sync(self, model):
        """DDP and ZeRO stages 0-1 hold full gradients: micro-batches before the
        last accumulate into them without communicating. ZeRO 2-3 shard the
        gradients, so they reduce-scatter after every backward."""
        if self.zero_stage is None or self.zero_stage <= 1:
            return model.no_sync()
        return contextlib.nullcontext()

    def _pipeline_step(self, step, rec):
        """k pipeline flushes (one per accumulation step), then the gradient sums."""
        cfg = self.config
        k = cfg.grad_accum_steps
        x, y = self.data.batch(step, cfg.global_batch_size)  # (B, T) each
        x, y = shard_batch(x, y, self.dp.index, self.dp.size)  # (B/dp, T)
        x, y = x.to(self.device), y.to(self.device)
        scale = self.optimizer.scaler.scale_value
        losses, peak = [], 0
        # ZeRO 0-1: every backward of every flush only accumulates (see _no_sync)
        with contextlib.ExitStack() as stack:
            if self.zero_stage is not None and self.zero_stage <= 1:
                for w in self.wrapped:
                    stack.enter_context(w.no_sync())
            for xf, yf in zip(x.chunk(k), y.chunk(k)):  # k x (B/(dp·k), T)
                out = self.pipe.step(xf, yf, loss_scale=scale / k, sync=False)
                losses.append(out["loss"] if out["loss"] is not None else 0.0)
                peak = max(peak, out["peak_activation_bytes"])
        if self.zero_stage is None:
            self.pipe.sync_gradients()  # tied embedding, then one all-reduce over dp
        else:
            for w in self.wrapped:
                w.reduce_gradients()  # ZeRO 0-1: once per step, unit by unit
            self._sum_tied_shards()  # ZeRO averaged over dp, unit by unit
        # the loss lives on the last stage: send it along the pipe
        t = torch.tensor([sum(losses) / k], dtype=torch.float64, device=self.device)
        if self.pp.size > 1:
            comm.broadcast(t, src=self.pp.size - 1, group=self.pp, tag="loss")
        return float(t[0]), peak

    def _sum_tied_shards(self) -> None:
        tied = self.pipe.axes["tied"]
        if not self.config.model.tied_head or tied is None:
            return
        for wrapper in self.wrapped:
            for shard in wrapper.local_shards():  # the same piece on either end
                grad = shard.tensor.grad
                if shard.name in ("wte.weight", "head.weight") and grad is not None:
                    comm.all_reduce(grad, group=tied, tag="tied-embedding")

    # ---- reporting -----------------------------------------------------------------
    def _weights(self):
        return [p for m in self.modules for p in m.parameters()]

    def parameters(self):
        return self.optimizer.masters

    def memory(self, activations: int) -> dict[str, int]:
        """Bytes this rank holds by category after the step, and their sum."""
        from dtlab.memory import count_bytes

        if self.zero_stage is not None:
            out = dict.fromkeys(("params", "grads", "optimizer", "buffers"), 0)
            for w in self.wrapped:
                for key, value in count_bytes(
                    w.memory_tensors(self.optimizer.optimizer)
                ).items():
                    out[key] = out.get(key, 0) + value
        else:
            weights = self._weights()
            state = self.optimizer.optimizer.state.values()
            masters = self.optimizer.masters if self.policy.has_master_copy else []
            out = {
                "params": sum(_nbytes(p) for p in weights),
                "grads": sum(_nbytes(p.grad) for p in weights),
                "optimizer": sum(_nbytes(m) for m in masters)
                + sum(
                    _nbytes(v) for s in state for v in s.values() if torch.is_tensor(v)
                ),
                "buffers": sum(
                    _nbytes(b.buffer)
                    for w in self.wrapped
                    for b in getattr(w, "buckets", [])
                    if b.buffer is not None
                ),
            }
        out["activations"] = activations
        # what this rank holds at once, at most: state plus a step's activations
        out["peak"] = sum(v for k, v in out.items() if not k.startswith("host_"))
        return out

    # ---- resume ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's weights (its tp/pp slices, or its ZeRO shards) and its
        optimizer state: inner AdamW state, fp32 masters, loss scaler."""
        if self.zero_stage is None:
            model = [m.state_dict() for m in self.modules]
        else:
            model = [w.state_dict() for w in self.wrapped]  # the local shards
        return copy.deepcopy({"model": model, "optimizer": self.optimizer.state_dict()})

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if self.zero_stage is None:
            for module, sd in zip(self.modules, state["model"], strict=True):
                module.load_state_dict(sd)
        # the masters (ZeRO: the shards themselves) and the 16-bit copies of them
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        for w in self.wrapped:
            if hasattr(w, "sync_params"):
                w.sync_params()  # ZeRO: the full weights follow the shards

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """``{name in GPT: full fp32 tensor}`` of the parameters this rank's pipeline
        stage holds (all of them without a pipeline): gathered over tp, and over dp
        under ZeRO. A collective over tp and dp."""
        from dtlab.tensor_parallel import _all_gather

        pairs = []  # (the module's own parameter, its name, the full tensor)
        if self.zero_stage is not None:
            for wrapper in self.wrapped:
                full = wrapper.gather_full_params()
                own = wrapper.compute_parameters()  # whatever the module shows now
                pairs += [(own[n], n, full[n]) for n in full]
        else:
            for module, named in self._masters_by_module():
                params = dict(module.named_parameters())
                pairs += [(params[n], n, t) for n, t in named]
        out = {}
        for p, name, t in pairs:
            dim = getattr(p, "tensor_parallel_dim", None)
            if dim is not None and self.tp.size > 1:
                t = _all_gather(t.contiguous(), dim, self.tp, "gather_full")
            if name in ("wte.weight", "head.weight"):
                t = t[: self.config.model.vocab_size]  # drop the padding rows
            if name == "head.weight" and self.config.model.tied_head:
                name = "wte.weight"
            out[name] = t.detach().float()
        return out

    def _masters_by_module(self):
        masters = iter(self.optimizer.masters)
        for module in self.modules:
            named = []
            seen = set()
            for n, p in module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                named.append((n, next(masters).detach()))
            yield module, named

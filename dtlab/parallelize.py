"""Every layout, one way: data × tensor × pipeline parallelism with activation
checkpointing and mixed precision, applied to the model in one fixed order.

Taught in chapter 07 (3D parallelism: how the axes compose, and what each costs) and
chapter 08 (memory techniques); chapters 02 and 03 run their plain DDP and ZeRO
through the same function, with tp = pp = 1 and fp32.

:func:`parallelize` takes a :class:`~dtlab.train.TrainConfig` and this rank's
:class:`~dtlab.topology.Topology` and returns the :class:`Parallelized` parts: this
rank's modules, their data-parallel wrappers, the pipeline executor and the optimizer.
:class:`dtlab.train.Trainer` runs the steps on them. The order, written here once
(torchtitan's ``parallelize_llama`` keeps the same one):

1. **Tensor parallelism** (Shoeybi et al. 2019; chapter 04) on the model's weights,
   first, because everything after it must see the *sharded* parameters: the
   pipeline sends tp-sized activations, checkpointing recomputes the tp collectives,
   ZeRO flattens the tp shards, the optimizer steps them.
2. **Pipeline partitioning** (chapter 05): this rank keeps its stage(s) only, placed
   as the schedule places them (interleaved chunks ``c·p + r``, or a V's ``r`` and
   ``2p-1-r``: chapter 12). With
   tp > 1 each stage (built by parameter name, so it matches the single-process GPT)
   is split over tp: vocab-parallel embedding on the first stage, column-parallel
   head and vocab-parallel cross-entropy on the last; a tied embedding is summed
   over the first and last stage, shard by shard. Beyond 3D (chapter 11), this
   step is also **expert parallelism** (tp = pp = 1: each rank keeps its experts)
   and, last, **context parallelism** (every sequence split over cp; with tp and pp
   too: attention's core, on the rank's own heads, runs over the cp ranks).
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
the dp ranks hold disjoint slices). A plain replica (DDP over dp alone) measures it
as ``clip_grad_norm_`` does, so chapter 02's run equals the reference bit for bit.

What does not compose, and why (:func:`dtlab.config.check_composition` says so
before anything runs): a split-backward schedule (ZB-H1, ZB-V, DualPipeV) with
ZeRO (its backward computes input and weight gradients in two passes, while ZeRO
reduce-scatters a unit's gradient when the unit's backward ends).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from dtlab import amp, comm
from dtlab.global_norm import global_norm_fn
from dtlab.gradsync import GradSync, Replicated, Sharded, all_reduce_flat
from dtlab.memory import count_bytes
from dtlab.model import GPT
from dtlab.recompute import apply_activation_checkpointing
from dtlab.topology import Topology

__all__ = [
    "Parallelized",
    "parallelize",
    "apply_model_parallel",
    "apply_ddp",
    "apply_zero",
    "apply_pipeline",
    "apply_precision",
    "replica_axis",
    "expert_parameters",
    "reduce_expert_gradients",
]


# ---- the parts -----------------------------------------------------------------------
@dataclass
class Parallelized:
    """What :func:`parallelize` built on this rank.

    ``modules``: this rank's unwrapped model, or its pipeline stages (one per
    chunk); ``wrapped``: the same inside their data-parallel wrappers (a pipeline
    under DDP keeps the bare stages: it all-reduces once, after its last flush);
    ``pipe``: the pipeline executor, or ``None``; ``sync``: who finishes the
    gradient synchronization (:class:`dtlab.gradsync.Replicated` or
    :class:`dtlab.gradsync.Sharded`, one interface); ``optimizer``: the
    :class:`~dtlab.amp.MixedPrecisionOptimizer` over every parameter this rank
    steps (ZeRO's flat fp32 shards, or the model's own parameters).
    """

    config: object
    topo: Topology
    device: torch.device
    policy: amp.Policy
    zero_stage: int | None
    modules: list[nn.Module]
    wrapped: list[nn.Module]
    pipe: object | None = None
    shard_group: object | None = None  # what ZeRO shards over (dp, or HSDP's shard)
    sync: GradSync | None = None
    optimizer: amp.MixedPrecisionOptimizer | None = field(default=None, repr=False)

    @property
    def model(self) -> nn.Module | None:
        """What forward is called on without a pipeline (``None`` with one)."""
        return self.wrapped[0] if self.pipe is None else None

    def weights(self) -> list[nn.Parameter]:
        """The weights the modules compute with (what activations are not)."""
        return [p for m in self.modules for p in m.parameters()]

    # ---- what this rank holds ------------------------------------------------------
    def memory(self, activations: int) -> dict[str, int]:
        """Bytes this rank holds by category after the step, and their ``peak``:
        what the synchronization holds (weights, gradients, buffers, the inner
        optimizer's state) and the 16-bit policies' fp32 masters, each storage
        once."""
        masters = self.optimizer.masters if self.policy.has_master_copy else []
        out = count_bytes(
            [*self.sync.memory_tensors(self.optimizer.optimizer)]
            + [("optimizer", m) for m in masters]
        )
        out["activations"] = activations
        # what this rank holds at once, at most: state plus a step's activations
        out["peak"] = sum(v for k, v in out.items() if not k.startswith("host_"))
        return out

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """``{name in GPT: full fp32 tensor}`` of the parameters this rank's pipeline
        stage holds (all of them without a pipeline): gathered over tp, and over dp
        under ZeRO. A collective over tp and dp."""
        from dtlab.tensor_parallel import all_gather_along

        tp = self.topo.axis("tp")
        pairs = []  # (the module's own parameter, its name, the full tensor)
        if self.zero_stage is not None:
            for wrapper in self.wrapped:
                full = wrapper.gather_full_params()
                own = wrapper.compute_parameters()  # whatever the module shows now
                pairs += [(own[n], n, full[n]) for n in full]
        else:
            masters = iter(self.optimizer.masters)
            for module in self.modules:
                seen = set()
                for n, p in module.named_parameters():
                    if id(p) not in seen and p.requires_grad:
                        seen.add(id(p))
                        pairs.append((p, n, next(masters).detach()))
        out = {}
        mc = self.config.model
        for p, name, t in pairs:
            dim = getattr(p, "tensor_parallel_dim", None)
            if dim is not None and tp.size > 1:
                t = all_gather_along(t.contiguous(), dim, tp, "gather_full")
            if name in ("wte.weight", "head.weight"):
                t = t[: mc.vocab_size]  # drop the padding rows
            if name == "head.weight" and mc.tied_head:
                name = "wte.weight"
            out[name] = t.detach().float()
        return out

    # ---- resume ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's weights (its tp/pp slices, or its ZeRO shards) and its
        optimizer state: inner AdamW state, fp32 masters, loss scaler. Copies."""
        return copy.deepcopy(
            {"model": self.sync.state_dict(), "optimizer": self.optimizer.state_dict()}
        )

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        # the masters (ZeRO: the shards themselves), then the weights they feed
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.sync.load_state_dict(state["model"])


# ---- the fixed order -----------------------------------------------------------------
def parallelize(config, topo: Topology, device: torch.device) -> Parallelized:
    """Build ``config``'s model on this rank of ``topo``, parallelized in the order
    of the module docstring, one ``apply_*`` function per step. A collective call:
    every rank of the world calls it."""
    modules = apply_model_parallel(config, topo, device)  # 1 and 2
    for module in modules:  # 3, per block, before any wrapper hooks in
        apply_activation_checkpointing(module, config.activation_checkpointing)
    if config.zero_stage is None:  # 4, in 5.'s compute dtype
        parts = apply_ddp(config, topo, device, modules)
    else:
        parts = apply_zero(config, topo, device, modules)
    if topo.layout.pp > 1:
        apply_pipeline(parts)
    apply_precision(parts)  # 5
    return parts


def apply_model_parallel(config, topo: Topology, device) -> list[nn.Module]:
    """Steps 1 and 2: this rank's modules. Every rank first builds the plain module
    (its weights drawn per parameter name, so any slice of the model matches the
    single-process GPT), keeps its pipeline stage(s), then its tp slices. Beyond 3D:
    expert parallelism (tp = pp = 1) keeps this rank's experts; context parallelism,
    last, splits every sequence on whatever this rank holds (the GPT, or its tp
    stages): each attention core then reaches the other cp ranks."""
    mc, layout, sp = config.model, topo.layout, config.sequence_parallel
    tp, pp = topo.axis("tp"), topo.axis("pp")
    if layout.pp == 1:
        modules = [GPT(mc, seed=config.seed)]
        if layout.ep > 1:
            from dtlab.moe import expert_parallel_gpt

            expert_parallel_gpt(modules[0], topo.axis("ep"))
    else:  # the stages as the schedule places them (interleaved, or a V)
        from dtlab.pipeline import build_stages, make_schedule

        m = config.resolve_microbatches(layout)
        sched = make_schedule(config.schedule, layout.pp, m, config.chunks)
        modules = build_stages(
            mc, layout.pp, pp.index, sched.v, config.seed, sched.placement
        )
    if layout.tp > 1:
        from dtlab.tensor_parallel import TensorParallelStage, tensor_parallel_gpt

        if layout.pp == 1:
            modules = [
                tensor_parallel_gpt(
                    modules[0], topo, sequence_parallel=sp, seed=config.seed
                )
            ]
        else:
            modules = [
                TensorParallelStage.from_stage(
                    s, tp, sequence_parallel=sp, seed=config.seed
                )
                for s in modules
            ]
    if layout.cp > 1:  # on what this rank holds: the GPT, or its (tp) stages
        from dtlab.context_parallel import apply_context_parallel

        for module in modules:
            apply_context_parallel(module, topo.axis("cp"), config.cp_variant)
    for module in modules:
        module.to(device).train()  # its GPU under nccl
        if sp:  # before any wrapper takes gradients during backward
            module.sum_sequence_parallel_grads_in_backward()
    return modules


def apply_ddp(config, topo: Topology, device, modules) -> Parallelized:
    """Step 4 under DDP: the modules cast to the compute dtype (DDP's buckets are
    built for the cast module) and wrapped, or, under a pipeline, kept bare: the
    pipeline all-reduces over dp once, after its last flush (:func:`apply_pipeline`
    sets that synchronization)."""
    policy = amp.policy(config.precision)
    for module in modules:
        module.to(policy.compute_dtype)
    wrapped = list(modules)
    if topo.layout.pp == 1:
        from dtlab.ddp import DistributedDataParallel

        wrapped = [
            DistributedDataParallel(
                modules[0],
                bucket_cap_mb=config.bucket_cap_mb,
                process_group=replica_axis(topo),
                find_unused_parameters=config.find_unused_parameters,
                ignored_parameters=expert_parameters(modules[0]),
            )
        ]
    parts = Parallelized(config, topo, device, policy, None, modules, wrapped)
    parts.sync = Replicated(  # DDP, then ep > 1's experts
        modules,
        wrapped[0] if topo.layout.pp == 1 else None,
        after=[lambda: reduce_expert_gradients(parts)],
    )
    return parts


def apply_zero(config, topo: Topology, device, modules) -> Parallelized:
    """Step 4 under ZeRO: one :class:`~dtlab.zero.FullyShardedDataParallel` per
    module, sharded over dp (or HSDP's shard groups), casting to the compute dtype
    at each all-gather while its shards stay the fp32 masters."""
    from dtlab.zero import FullyShardedDataParallel

    policy = amp.policy(config.precision)
    cdtype = policy.compute_dtype if policy.has_master_copy else None
    shard, replicate = replica_axis(topo), None
    if config.zero_shard_size is not None:  # HSDP: shard in groups, replicate
        from dtlab.zero import hsdp_groups

        grid = hsdp_groups(config.zero_shard_size, topo.layout.groups(shard.name))
        shard, replicate = grid.shard, grid.replicate
    tied_across_stages = topo.layout.pp > 1 and config.model.tied_head
    wrapped = [
        FullyShardedDataParallel(
            module,
            cdtype,
            shard,
            stage=config.zero_stage,
            units=_zero_units(module, tied_across_stages),
            offload=config.offload,
            replicate_group=replicate,
        )
        for module in modules
    ]
    parts = Parallelized(
        config, topo, device, policy, config.zero_stage, modules, wrapped
    )
    parts.shard_group = shard
    parts.sync = Sharded(wrapped, after=[lambda: _sum_tied_shards(parts)])
    return parts


def apply_pipeline(parts: Parallelized) -> None:
    """The executor of step 2's stages, running the wrapped stages in the config's
    schedule; under DDP it also finishes the synchronization (the tied embedding,
    then one flat all-reduce over dp)."""
    from dtlab.pipeline import Pipeline

    config, topo = parts.config, parts.topo
    parts.pipe = Pipeline(
        config.model,
        topo,
        config.schedule,
        microbatches=config.resolve_microbatches(topo.layout),
        chunks=config.chunks,
        seed=config.seed,
        stages=parts.wrapped,
        loss_fn=parts.modules[-1].loss,  # StageModule.loss or vocab-parallel CE
        act_dtype=parts.policy.compute_dtype,
        seq_split=topo.layout.tp if config.sequence_parallel else 1,
    )
    if parts.zero_stage is None:
        parts.sync = Replicated(parts.modules, after=[parts.pipe.sync_gradients])


def apply_precision(parts: Parallelized) -> None:
    """Step 5: the optimizer with fp32 masters and the loss scaler. ZeRO's shards
    already are fp32 masters, so its optimizer runs the fp32 policy with the
    scaler."""
    config, policy = parts.config, parts.policy
    params = [p for w in parts.wrapped for p in w.parameters()]
    parts.optimizer = amp.MixedPrecisionOptimizer(
        params,
        torch.optim.AdamW,
        "fp32" if parts.zero_stage is not None else policy,
        scaler=policy.scaler(),
        groups=None,
        grad_clip=config.grad_clip,
        norm_fn=global_norm_fn(parts),
        lr=config.lr,
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=1e-8,
    )


def replica_axis(topo: Topology):
    """The ranks that hold the same dense weights (:meth:`Topology.replicas
    <dtlab.topology.Topology.replicas>`)."""
    return topo.replicas()


def expert_parameters(module) -> list[nn.Parameter]:
    """The parameters expert parallelism placed on this rank (reduced over the
    ranks holding the same experts, not by DDP)."""
    return [p for p in module.parameters() if getattr(p, "expert_parallel", False)]


@torch.no_grad()
def reduce_expert_gradients(parts: Parallelized) -> None:
    """After backward under ep > 1: each expert's gradient already sums the
    tokens of its whole ep group (the all-to-all carried them back); summed over
    the ranks that hold the same expert (edp) and divided by the dp·cp replicas,
    it is the gradient of the mean loss, as the single process computes it."""
    experts = [p for m in parts.modules for p in expert_parameters(m)]
    if not experts:
        return
    edp, n = parts.topo.axis("edp"), replica_axis(parts.topo).size
    grads = [p.grad for p in experts if p.grad is not None]
    all_reduce_flat(grads, edp, tag="ep/expert-grads", divide_by=n)


def _sum_tied_shards(parts: Parallelized) -> None:
    """A tied embedding across pipeline stages under ZeRO: the first stage's
    embedding unit and the last stage's head unit hold matching local shards;
    their gradients are summed over the two ranks."""
    tied = parts.pipe.axes["tied"] if parts.pipe is not None else None
    if not parts.config.model.tied_head or tied is None:
        return
    for wrapper in parts.wrapped:
        for shard in wrapper.local_shards():  # the same piece on either end
            grad = shard.tensor.grad
            if shard.name in ("wte.weight", "head.weight") and grad is not None:
                comm.all_reduce(grad, group=tied, tag="tied-embedding")


def _blocks(module) -> list[nn.Module]:
    blocks = module.blocks
    return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


def _zero_units(module, tied_across_stages: bool) -> list[nn.Module]:
    """ZeRO units: each block; with a tied embedding across pipeline stages, also
    the embedding (first stage) or the head (last stage) alone, so that both
    ranks' flat slices of it line up element for element and can be summed."""
    units = _blocks(module)
    if tied_across_stages:
        if module.first:
            units.append(module.wte)
        if module.last:
            units.append(module.head)
    return units

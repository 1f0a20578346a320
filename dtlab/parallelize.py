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
2. **Pipeline partitioning** (chapter 05): this rank keeps its stage(s) only. With
   tp > 1 each stage (built by parameter name, so it matches the single-process GPT)
   is split over tp: vocab-parallel embedding on the first stage, column-parallel
   head and vocab-parallel cross-entropy on the last; a tied embedding is summed
   over the first and last stage, shard by shard. Beyond 3D (tp = pp = 1, chapter
   11), this step is **expert parallelism** (each rank keeps its experts) and then
   **context parallelism** (every sequence split over cp) on the whole model.
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

What does not compose, and why (:func:`check_composition` says so before anything
runs): ZB-H1 with ZeRO (its split backward computes input and weight gradients in
two passes, while ZeRO reduce-scatters a unit's gradient when the unit's backward
ends).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from dtlab import amp, comm
from dtlab.events import zero_stage
from dtlab.global_norm import global_norm_fn
from dtlab.memory import count_bytes
from dtlab.model import GPT
from dtlab.recompute import apply_activation_checkpointing
from dtlab.topology import Topology

__all__ = [
    "Parallelized",
    "parallelize",
    "check_composition",
    "replica_axis",
    "expert_parameters",
    "reduce_expert_gradients",
]


# ---- what composes -------------------------------------------------------------------
def check_composition(config, layout) -> None:
    """Raise ``ValueError`` for a combination that cannot run, saying why and what
    to change (called by :meth:`dtlab.train.TrainConfig.check`)."""
    zero = zero_stage(config.strategy) is not None
    if zero and layout.pp > 1 and config.schedule == "zb_h1":
        raise ValueError(
            "schedule 'zb_h1' does not compose with ZeRO: it computes input and "
            "weight gradients in two backward passes, while ZeRO reduce-scatters a "
            "unit's gradient when the unit's backward ends; use strategy='ddp' with "
            "zb_h1, or another schedule with ZeRO"
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
        for axis in ("tp", "pp"):
            if layout.size(axis) > 1:
                raise ValueError(
                    f"cp={cp} with {axis}={layout.size(axis)} is not composed in "
                    "dtlab: context parallelism runs a whole GPT's attention over "
                    f"the cp ranks; put the ranks on dp, cp and ep, with {axis}=1"
                )
        if config.activation_checkpointing != "none":
            raise ValueError(
                "activation checkpointing with cp > 1 is not composed in dtlab: the "
                "recomputation would run the ring's collectives again in backward; "
                "use activation_checkpointing='none'"
            )
        if config.cp_variant == "ring" and mc.seq_len % (2 * cp):
            raise ValueError(
                f"ring attention gives each of cp={cp} ranks two of 2*cp equal "
                f"chunks of the sequence: seq_len={mc.seq_len} must be a multiple "
                f"of {2 * cp}"
            )
        if config.cp_variant == "ulysses" and (mc.seq_len % cp or mc.n_heads % cp):
            raise ValueError(
                f"Ulysses gives each of cp={cp} ranks seq_len/cp tokens, then "
                f"n_heads/cp heads: seq_len={mc.seq_len} and n_heads={mc.n_heads} "
                f"must be multiples of {cp}"
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


# ---- the parts -----------------------------------------------------------------------
@dataclass
class Parallelized:
    """What :func:`parallelize` built on this rank.

    ``modules``: this rank's unwrapped model, or its pipeline stages (one per
    chunk); ``wrapped``: the same inside their data-parallel wrappers (a pipeline
    under DDP keeps the bare stages: it all-reduces once, after its last flush);
    ``pipe``: the pipeline executor, or ``None``; ``optimizer``: the
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
    optimizer: amp.MixedPrecisionOptimizer | None = field(default=None, repr=False)

    @property
    def model(self) -> nn.Module | None:
        """What forward is called on without a pipeline (``None`` with one)."""
        return self.wrapped[0] if self.pipe is None else None

    @property
    def accumulates_locally(self) -> bool:
        """Whether gradients of several backward passes can add up before any
        communication: DDP and ZeRO 0-1 hold full gradients; ZeRO 2-3 shard them
        and reduce-scatter after every backward (see :mod:`dtlab.zero`)."""
        return self.zero_stage is None or self.zero_stage <= 1

    def weights(self) -> list[nn.Parameter]:
        """The weights the modules compute with (what activations are not)."""
        return [p for m in self.modules for p in m.parameters()]

    # ---- what this rank holds ------------------------------------------------------
    def memory(self, activations: int) -> dict[str, int]:
        """Bytes this rank holds by category after the step, and their ``peak``."""
        inner = self.optimizer.optimizer
        if self.zero_stage is not None:
            out = dict.fromkeys(("params", "grads", "optimizer", "buffers"), 0)
            for w in self.wrapped:
                for key, value in count_bytes(w.memory_tensors(inner)).items():
                    out[key] = out.get(key, 0) + value
        else:
            # by storage: DDP's gradients are views of its buckets (one Ψ, not two)
            weights = self.weights()
            masters = self.optimizer.masters if self.policy.has_master_copy else []
            states = [v for s in inner.state.values() for v in s.values()]
            buckets = [
                b.buffer for w in self.wrapped for b in getattr(w, "buckets", [])
            ]
            out = count_bytes(
                [("params", p) for p in weights]
                + [("grads", p.grad) for p in weights if p.grad is not None]
                + [("optimizer", m) for m in masters]
                + [("optimizer", v) for v in states if torch.is_tensor(v)]
                + [("buffers", b) for b in buckets if b is not None]
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


# ---- the fixed order -----------------------------------------------------------------
def parallelize(config, topo: Topology, device: torch.device) -> Parallelized:
    """Build ``config``'s model on this rank of ``topo``, parallelized in the order
    of the module docstring. A collective call: every rank of the world calls it."""
    mc, layout = config.model, topo.layout
    sp = config.sequence_parallel
    tp, pp = topo.axis("tp"), topo.axis("pp")
    dp = replica_axis(topo)
    policy = amp.policy(config.precision)
    stage = zero_stage(config.strategy)
    # 1. tensor parallelism, 2. pipeline partitioning. Every rank first builds the
    # plain module (its weights drawn per parameter name, so any slice of the model
    # matches the single-process GPT), then keeps its tp slices. Beyond 3D (tp = pp
    # = 1): expert parallelism keeps this rank's experts, context parallelism
    # splits every sequence (attention then reaches the other cp ranks).
    if layout.pp == 1:
        modules = [GPT(mc, seed=config.seed)]
        if layout.ep > 1:
            from dtlab.moe import expert_parallel_gpt

            expert_parallel_gpt(modules[0], topo.axis("ep"))
        if layout.cp > 1:
            from dtlab.context_parallel import apply_context_parallel

            apply_context_parallel(modules[0], topo.axis("cp"), config.cp_variant)
    else:
        from dtlab.pipeline import build_stages

        modules = build_stages(
            mc, layout.pp, pp.index, v=config.chunks, seed=config.seed
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
    for module in modules:
        module.to(device).train()  # its GPU under nccl
        if sp:
            _sum_sequence_parallel_grads(module, tp)
    # 3. activation checkpointing, per block, before any wrapper hooks in
    for module in modules:
        apply_activation_checkpointing(module, config.activation_checkpointing)
    # 4. data parallelism over dp, in 5.'s compute dtype
    dtype = policy.compute_dtype
    if stage is None:
        for module in modules:
            module.to(dtype)  # DDP's buckets are built for the cast module
        if layout.pp == 1:
            from dtlab.ddp import DistributedDataParallel

            wrapped = [
                DistributedDataParallel(
                    modules[0],
                    bucket_cap_mb=config.bucket_cap_mb,
                    process_group=dp,
                    find_unused_parameters=config.find_unused_parameters,
                    ignored_parameters=expert_parameters(modules[0]),
                )
            ]
        else:  # the pipeline all-reduces over dp once, after the last flush
            wrapped = list(modules)
    else:
        from dtlab.zero import FullyShardedDataParallel

        cdtype = dtype if policy.has_master_copy else None
        shard, replicate = dp, None
        if config.zero_shard_size is not None:  # HSDP: shard in groups, replicate
            from dtlab.zero import hsdp_groups

            grid = hsdp_groups(config.zero_shard_size, topo.layout.groups(dp.name))
            shard, replicate = grid.shard, grid.replicate
        wrapped = [
            FullyShardedDataParallel(
                module,
                cdtype,
                shard,
                stage=stage,
                units=_zero_units(module, pp.size > 1 and mc.tied_head),
                offload=config.offload,
                replicate_group=replicate,
            )
            for module in modules
        ]
    parts = Parallelized(config, topo, device, policy, stage, modules, wrapped)
    if stage is not None:
        parts.shard_group = shard
    if layout.pp > 1:
        from dtlab.pipeline import Pipeline

        parts.pipe = Pipeline(
            mc,
            topo,
            config.schedule,
            microbatches=config.resolve_microbatches(layout),
            chunks=config.chunks,
            seed=config.seed,
            stages=wrapped,
            loss_fn=modules[-1].loss,  # StageModule.loss or vocab-parallel CE
            act_dtype=dtype,
            seq_split=layout.tp if sp else 1,
        )
    # 5. precision: fp32 masters and the loss scaler. ZeRO's shards already are
    # fp32 masters, so its optimizer runs the fp32 policy with the scaler
    params = [p for w in wrapped for p in w.parameters()]
    parts.optimizer = amp.MixedPrecisionOptimizer(
        params,
        torch.optim.AdamW,
        "fp32" if stage is not None else policy,
        scaler=policy.scaler(),
        groups=None,
        grad_clip=config.grad_clip,
        norm_fn=global_norm_fn(parts),
        lr=config.lr,
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=1e-8,
    )
    return parts


def replica_axis(topo: Topology):
    """The ranks that hold the same dense weights: dp, or dp·cp with context
    parallelism (its ranks split sequences, not weights)."""
    return topo.axis("dp_cp") if topo.layout.cp > 1 else topo.axis("dp")


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
    if edp.size > 1 and grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=edp, tag="ep/expert-grads")
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    for g in grads:
        g.div_(n)


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


def _sum_sequence_parallel_grads(module, tp) -> None:
    """Under sequence parallelism the LayerNorms, row-parallel biases and position
    embedding see only this rank's tokens: their gradients are partial sums over
    tp. Summing each as it is produced (a hook before accumulation) keeps every
    later stage (accumulation, DDP buckets, ZeRO's reduce-scatter) unaware."""

    def hook(grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(grad, group=tp, tag="sp_grads")
        return grad

    for p in module.parameters():
        if getattr(p, "sequence_parallel", False):
            p.register_hook(hook)

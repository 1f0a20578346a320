"""ZeRO stages 0-3 (stage 3 is FSDP) and CPU offload, each stage adding one thing.

Taught in chapter 03 (``notebooks/03_zero.ipynb``); chapter 07 runs it over the dp
axis of tensor-parallel models and pipeline stages (:mod:`dtlab.parallelize`).

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC20). Plain data parallelism keeps the whole *model state* on
each of the N_d ranks: 2Ψ bytes of fp16 weights, 2Ψ of gradients and KΨ of optimizer
state (K = 12 for mixed-precision Adam: fp32 master weights, momentum, variance).
ZeRO-DP removes the copies, one kind at a time (§5):

- stage 1, P_os: each rank keeps the optimizer state of 1/N_d of the parameters and
  updates only that slice; the updated slices are all-gathered (§5.1);
- stage 2, P_os+g: gradients too are reduce-scattered into slices, bucket by bucket
  while backward runs, and the full gradient of a bucket is freed once reduced (§5.2);
- stage 3, P_os+g+p: parameters too. Each *unit* (a transformer block) keeps a flat
  slice; its full weights are all-gathered just before its forward and again before
  its backward, and freed after use; the next unit is prefetched (§5.3). PyTorch
  calls this FSDP (Zhao et al. 2023, "PyTorch FSDP", §3).

Communication per step (§7): an all-reduce is a reduce-scatter plus an all-gather,
2Ψ; stages 1 and 2 do exactly those two, also 2Ψ; stage 3 gathers the weights twice,
3Ψ. :func:`dtlab.estimate.zero_comm_per_step` has the numbers, the tests check them.

Gradient accumulation (several backward passes per optimizer step): stages 0 and 1
keep the full gradient anyway, so under :meth:`FullyShardedDataParallel.no_sync`
they add each micro-batch's gradient into it and communicate once per step, like
DDP. Stages 2 and 3 exist to *not* hold the full gradient, so they reduce-scatter
after every backward and add the slices; ``no_sync`` refuses them (DeepSpeed's
engine refuses it for its stages 2 and 3 too).

Two drop-ins, with PyTorch's shapes:

- :class:`ShardedOptimizer` (stage 1 alone, like ``ZeroRedundancyOptimizer``): wraps
  any element-wise torch optimizer; use it after something averaged the gradients.
- :class:`FullyShardedDataParallel` (``stage=3`` by default, like FSDP2's
  ``fully_shard``; ``stage=0, 1, 2`` are the same machinery with less sharded): its
  ``.parameters()`` are this rank's flat fp32 shards, so a plain ``torch.optim.AdamW``
  over them *is* the sharded optimizer. ``compute_dtype`` runs forward and backward in
  bf16/fp16 with fp32 master weights; ``offload=True`` keeps master weights, their
  gradients and the optimizer state on the host (ZeRO-Offload, Ren et al. 2021).

Layout: a unit's parameters are flattened in ``named_parameters`` order and padded
with zeros to a multiple of N_d; rank r owns elements ``[r·S, (r+1)·S)``, S = padded/N.
Element-wise optimizers (SGD, Adam, AdamW, ...) give the same numbers on a slice as on
the whole, so the sharded update equals the unsharded one bit for bit.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from dtlab import comm, memory

__all__ = ["STAGES", "ShardedOptimizer", "FullyShardedDataParallel"]

STAGES = (0, 1, 2, 3)
# optimizers whose update of one element depends on other elements of its tensor
# (factored or matrix-wise statistics): a flat slice would change their math
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon")


def _padded(numel: int, n: int) -> int:
    return math.ceil(numel / n) * n


def _check_elementwise(optimizer_cls) -> None:
    if not (
        isinstance(optimizer_cls, type)
        and issubclass(optimizer_cls, torch.optim.Optimizer)
    ):
        raise ValueError(
            f"optimizer_cls must be a torch.optim.Optimizer class (e.g. "
            f"torch.optim.AdamW), got {optimizer_cls!r}"
        )
    if optimizer_cls.__name__ in _NOT_ELEMENTWISE:
        raise ValueError(
            f"{optimizer_cls.__name__} updates each element from statistics of the "
            "whole tensor, so it cannot step a flat slice: use an element-wise "
            "optimizer (SGD, Adam, AdamW, RMSprop, ...)"
        )


# ---- stage 1 as a drop-in optimizer -------------------------------------------------
class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 (P_os) as an optimizer: the shape of PyTorch's
    ``ZeroRedundancyOptimizer(params, optimizer_class, process_group, **defaults)``.

    The parameters of each group are moved into one flat buffer (each ``p.data``
    becomes a view of it, so the model is untouched). Rank r's inner
    ``optimizer_cls`` steps only the slice ``[r·S, (r+1)·S)``, so its state takes
    ``K·Ψ/N`` bytes instead of ``K·Ψ``; after the update the slices are all-gathered
    into every rank's buffer (Ψ of traffic).

    Gradients must already be averaged across ranks when :meth:`step` runs (by DDP,
    as with ``ZeroRedundancyOptimizer``). The optimizer must be element-wise. A
    parameter without a gradient inside a slice that has others is stepped with a
    zero gradient (the inner optimizer sees one flat tensor).

    ``state_dict()`` holds this rank's shard only (see :mod:`dtlab.checkpoint` for
    whole-model checkpoints). LR schedulers work: they edit :attr:`param_groups`,
    which are copied into the inner optimizer before each step.
    """

    def __init__(self, params, optimizer_cls, process_group=None, **defaults):
        _check_elementwise(optimizer_cls)
        super().__init__(params, defaults)
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.rank = comm.group_rank(process_group)
        self._flats: list[dict] = []
        inner_groups = []
        for gi, group in enumerate(self.param_groups):
            ps = list(group["params"])
            dtypes = {p.dtype for p in ps}
            devices = {p.device for p in ps}
            if len(dtypes) > 1 or len(devices) > 1:
                raise ValueError(
                    f"param group {gi} mixes dtypes {dtypes} or devices {devices}: "
                    "put parameters of different dtype/device in separate groups"
                )
            numel = sum(p.numel() for p in ps)
            padded = _padded(numel, self.world_size)
            S = padded // self.world_size
            flat = torch.zeros(padded, dtype=ps[0].dtype, device=ps[0].device)
            entries, off = [], 0
            for p in ps:
                n = p.numel()
                flat[off : off + n].copy_(p.detach().reshape(-1))
                with torch.no_grad():
                    p.data = flat[off : off + n].view_as(p)  # same Parameter object
                entries.append((p, off, n))
                off += n
            lo = self.rank * S
            # aliases the flat buffer: the inner optimizer updates it in place
            shard = nn.Parameter(flat[lo : lo + S], requires_grad=True)
            self._flats.append(
                dict(flat=flat, entries=entries, shard=shard, lo=lo, S=S, numel=numel)
            )
            inner_groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [shard]}
            )
        self.optim = optimizer_cls(inner_groups, **defaults)
        self.state = self.optim.state  # what memory accounting and users look at

    def _slice_grad(self, f) -> torch.Tensor | None:
        """This rank's slice of the (already averaged) gradients, or None if no
        parameter in it has one."""
        lo, hi = f["lo"], f["lo"] + f["S"]
        g = f["shard"].grad
        if g is None:
            g = f["shard"].grad = torch.zeros_like(f["shard"])
        found = False
        for p, off, n in f["entries"]:
            a, b = max(lo, off), min(hi, off + n)
            if a >= b:
                continue
            dst = g[a - lo : b - lo]
            if p.grad is None:
                dst.zero_()
            else:
                found = True
                dst.copy_(p.grad.reshape(-1)[a - off : b - off])
        return g if found else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.optim.param_groups):
            # schedulers change the outer groups; the inner ones must follow
            inner.update({k: v for k, v in group.items() if k != "params"})
        for f in self._flats:
            f["shard"].grad = self._slice_grad(f)
        self.optim.step()
        for f in self._flats:
            # the input must not alias the output buffer, hence the copy
            comm.all_gather(
                f["flat"], f["shard"].detach().clone(), self.process_group,
                tag="zero1/ag-params",
            )  # fmt: skip
        return loss

    def state_dict(self):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "inner": self.optim.state_dict(),
        }

    def load_state_dict(self, state_dict):
        if state_dict.get("world_size") != self.world_size:
            raise ValueError(
                f"this shard was saved at world size {state_dict.get('world_size')}, "
                f"the group now has {self.world_size}: use dtlab.checkpoint to reshard"
            )
        self.optim.load_state_dict(state_dict["inner"])
        for group, inner in zip(self.param_groups, self.optim.param_groups):
            group.update({k: v for k, v in inner.items() if k != "params"})


# ---- stages 0-3: the wrapper ---------------------------------------------------------
class _Unit:
    """The parameters of one module (a transformer block, or what the root keeps),
    flattened; this rank's slice of them; and the unit's state within a step."""

    def __init__(self, name, module, named_params):
        self.name = name
        self.module = module
        self.named = named_params  # [(qualified name, Parameter)]
        self.numel = sum(p.numel() for _, p in named_params)
        self.n_grads = sum(p.requires_grad for _, p in named_params)
        # filled in by the wrapper
        self.padded = self.S = self.lo = 0
        self.entries: list[tuple] = []  # (name, param, offset, numel)
        self.full: torch.Tensor | None = None  # compute dtype, padded; views = params
        self.shard: nn.Parameter | None = None  # master slice (what optimizers step)
        self.shard_lp: torch.Tensor | None = None  # stage 3: compute-dtype slice
        self.alias = False  # shard is a view of full (fp32, no offload, stage <= 2)
        self.handle = None  # pending all-gather
        self.gathered = True
        self.ready = 0  # gradients accumulated in this backward
        self.reduced = False
        self.flat_grad: torch.Tensor | None = None  # stages 0-1: full grads kept


class FullyShardedDataParallel(nn.Module):
    """ZeRO-DP on any ``nn.Module``: ``stage=3`` is FSDP (the default), ``stage=2``
    shards gradients and optimizer state, ``stage=1`` optimizer state only,
    ``stage=0`` nothing (plain data parallelism, the baseline the others are
    measured against).

    ``units``: which submodules get their own flat parameter (gathered and freed
    together under stage 3; one gradient bucket under every stage). ``None`` makes
    every element of every ``nn.ModuleList`` a unit (a GPT's blocks); a tuple of
    module classes or a list of modules picks others. What no unit owns belongs to
    the root unit (embeddings, final norm, head).

    ``compute_dtype`` (bf16/fp16): the weights are cast before the all-gather, so the
    traffic and the forward/backward run in it; gradients are reduced in it; the
    optimizer steps fp32 master slices. ``offload=True``: master slices, their
    gradients and therefore the optimizer state live on the CPU (the host).
    ``keep_root_gathered=True`` keeps the root unit's weights between forward and
    backward as FSDP2 does for its root (saving one all-gather of it; the traffic is
    then 3Ψ minus the root). ``sync_module_states=True`` broadcasts rank 0's weights
    first, for models not initialised identically on every rank.

    After ``loss.backward()`` returns, each shard's ``.grad`` holds its slice of the
    gradient averaged over ranks (:meth:`finish_gradient_synchronization` runs at
    the end of backward and is idempotent). The weights are refreshed from the
    shards at the next forward, after any optimizer step over them.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        process_group=None,
        *,
        stage: int = 3,
        units=None,
        offload: bool = False,
        prefetch: bool = True,
        keep_root_gathered: bool = False,
        sync_module_states: bool = False,
    ):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"unknown ZeRO stage {stage!r}: use 0, 1, 2 or 3")
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"module must be an nn.Module, got {type(module).__name__}"
            )
        if compute_dtype is not None and not (
            isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        ):
            raise ValueError(
                f"compute_dtype must be a floating torch.dtype (torch.bfloat16, "
                f"torch.float16) or None, got {compute_dtype!r}"
            )
        params = list(module.parameters())
        if not params:
            raise ValueError("the module has no parameters: nothing to shard")
        if len({p.device for p in params}) > 1:
            raise ValueError("all parameters must be on one device; move the module")
        self.module = module
        self.stage = stage
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.rank = comm.group_rank(process_group)
        self.offload = bool(offload)
        self.prefetch = bool(prefetch)
        self.keep_root_gathered = bool(keep_root_gathered)
        self.device = params[0].device
        self.master_device = torch.device("cpu") if offload else self.device
        self._units = self._make_units(module, units)
        self.compute_dtype = compute_dtype
        for u in self._units:
            self._flatten(u, compute_dtype, sync_module_states)
        self._buffers_live: dict[int, torch.Tensor] = {}
        self._pending: list[tuple] = []  # (unit, handle, input, output)
        self.max_inflight = 2  # reductions in flight before backward waits
        self._in_backward = False
        self._fwd_order: list[_Unit] = []
        self._last_fwd_order: list[_Unit] = []
        self._dirty = False  # an optimizer stepped the shards since the last gather
        # False under no_sync(): backward passes accumulate without communicating
        self.require_backward_grad_sync = True
        self._unsynced = False  # a bucket holds gradients not yet reduced
        self._install_hooks()

    # ---- construction ----------------------------------------------------------
    def _make_units(self, module, units) -> list[_Unit]:
        if units is None:
            # every element of every ModuleList: a GPT's blocks
            lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
            picked = [block for lst in lists for block in lst]
        elif isinstance(units, type) or (
            isinstance(units, tuple) and all(isinstance(t, type) for t in units)
        ):
            picked = [
                m for m in module.modules() if isinstance(m, units) and m is not module
            ]
        else:
            picked = list(units)
            for m in picked:
                if not isinstance(m, nn.Module) or m is module:
                    raise ValueError(
                        "units must be None, module classes, or submodules of the "
                        f"wrapped module (not the module itself); got {m!r}"
                    )
        names = {m: n for n, m in module.named_modules()}
        for m in picked:
            if m not in names:
                raise ValueError(f"unit {type(m).__name__} is not inside the module")
        # a parameter belongs to the innermost unit that contains it
        prefixes = sorted(((names[m], m) for m in picked), key=lambda x: -len(x[0]))

        def owner(qualname):
            for pre, m in prefixes:
                if qualname.startswith(pre + "."):
                    return m
            return module

        by_module: dict[nn.Module, list] = {module: []}
        for m in picked:
            by_module.setdefault(m, [])
        seen: dict[int, nn.Module] = {}
        for qualname, p in module.named_parameters(remove_duplicate=False):
            m = owner(qualname)
            if id(p) in seen:
                if seen[id(p)] is not m:
                    raise ValueError(
                        f"parameter {qualname} is shared by two units: tied weights "
                        "must live in one unit (leave them to the root)"
                    )
                continue  # a tied weight: flattened once, under its first name
            seen[id(p)] = m
            by_module[m].append((qualname, p))
        position = {m: i for i, m in enumerate(names)}  # named_modules order
        ordered = [module] + sorted(picked, key=position.__getitem__)
        return [
            _Unit(names[m] or "root", m, by_module[m])
            for m in ordered
            if by_module[m] or m is module
        ]

    @torch.no_grad()
    def _flatten(self, u: _Unit, compute_dtype, sync) -> None:
        if not u.named:
            return
        dtypes = {p.dtype for _, p in u.named}
        if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"unit {u.name!r} has parameters of dtypes {dtypes}: one floating "
                "dtype per unit (cast the module first)"
            )
        master_dtype = next(iter(dtypes))
        cdtype = compute_dtype or master_dtype
        n = self.world_size
        n_shards = n if self.stage >= 1 else 1
        # padding to a multiple of N even at stage 0 keeps the all-reduce's chunks
        # where the reduce-scatter's slices are: stages then sum in the same order
        u.padded = _padded(u.numel, n)
        u.S = u.padded // n_shards
        u.lo = self.rank * u.S if n_shards > 1 else 0
        master_full = torch.zeros(u.padded, dtype=master_dtype, device=self.device)
        off = 0
        for name, p in u.named:
            k = p.numel()
            master_full[off : off + k].copy_(p.reshape(-1))
            u.entries.append((name, p, off, k))
            off += k
        if sync:
            comm.broadcast(master_full, 0, self.process_group, tag="zero/sync")
        u.alias = cdtype == master_dtype and not self.offload and self.stage <= 2
        u.full = master_full if cdtype == master_dtype else master_full.to(cdtype)
        for _, p, off, k in u.entries:
            p.data = u.full[off : off + k].view(p.shape)  # the module computes on these
        mine = master_full[u.lo : u.lo + u.S]
        if u.alias:
            u.shard = nn.Parameter(mine)  # the slice *is* part of the weights
        else:
            u.shard = nn.Parameter(mine.to(self.master_device, copy=True))
        u.shard.requires_grad_(u.n_grads > 0)
        if self.stage == 3:
            if cdtype != master_dtype or self.offload:
                # the compute-dtype slice that is gathered (2Ψ/N under bf16)
                u.shard_lp = torch.empty(u.S, dtype=cdtype, device=self.device)
            self._free_full(u)

    def _install_hooks(self) -> None:
        for u in self._units:
            for _, p, _, _ in u.entries:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._make_grad_hook(u))
            if u.module is not self.module:
                u.module.register_forward_pre_hook(self._make_pre_forward(u))
                u.module.register_forward_hook(self._make_post_forward(u))
        me = weakref.ref(self)
        ids = {id(u.shard) for u in self._units if u.shard is not None}

        def after_step(optimizer, args, kwargs):
            self_ = me()
            if self_ is None:
                return
            if any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
                self_._dirty = True
                self_._drop_full_grads()  # stages 0-1: the step consumed them

        def before_step(optimizer, args, kwargs):
            self_ = me()
            if self_ is None or not self_._unsynced:
                return
            if any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
                raise RuntimeError(
                    "the optimizer would step with gradients that backward passes "
                    "under no_sync() accumulated but nobody reduced: run the last "
                    "micro-batch's backward outside no_sync(), or call "
                    "reduce_gradients() before the step"
                )

        # any torch optimizer (fused ones too) that steps our shards marks them dirty
        self._step_hook = register_optimizer_step_post_hook(after_step)
        self._pre_step_hook = register_optimizer_step_pre_hook(before_step)
        weakref.finalize(self, self._step_hook.remove)
        weakref.finalize(self, self._pre_step_hook.remove)

    # ---- what users see -------------------------------------------------------
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """This rank's flat master shards, one per unit: ``<unit>.flat_shard``."""
        for u in self._units:
            if u.shard is not None:
                yield (
                    prefix + ("." if prefix else "") + f"{u.name}.flat_shard",
                    u.shard,
                )

    def forward(self, *args, **kwargs):
        self._begin_forward()
        root = self._units[0]
        self._before_unit(root, "fwd")
        out = self.module(*args, **kwargs)
        self._after_unit_forward(root, out)
        if torch.is_grad_enabled():
            me = weakref.ref(self)

            def on_output_grad(_grad):  # fires first in a backward from this output
                if me() is not None:
                    me()._start_backward()

            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(on_output_grad)
        return out

    def sync_params(self) -> None:
        """All-gather the updated slices into the full weights now (stages 0-2 do it
        by themselves at the next forward after an optimizer step)."""
        self._dirty = True
        if self.stage <= 2:
            self._refresh_all()

    @property
    def units(self) -> list[dict]:
        """Each unit's name, parameter count, padded size and slice ``[lo, lo+S)``."""
        return [
            dict(name=u.name, numel=u.numel, padded=u.padded, lo=u.lo, S=u.S,
                 params=[(n, tuple(p.shape), off) for n, p, off, _ in u.entries])
            for u in self._units
        ]  # fmt: skip

    def shards(self) -> list[tuple]:
        """``(shard, lo, entries, module)`` per unit holding one: the flat master
        slice ``[lo, lo + len(shard))`` of the unit's flat parameter, whose entries
        are ``(name, param, offset, numel)``, and the unit's module. What composed
        layouts need to weigh each element (a tensor-parallel replica counted once
        in a norm) or to sum one unit's shard with another rank's (a tied
        embedding across pipeline stages, :mod:`dtlab.parallelize`)."""
        return [
            (u.shard, u.lo, list(u.entries), u.module)
            for u in self._units
            if u.shard is not None
        ]

    @property
    def padded_numel(self) -> int:
        """Ψ as the shards see it: every unit padded to a multiple of N."""
        return sum(u.padded for u in self._units)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self._units)

    def state_dict(self, *args, **kwargs):
        """This rank's shards only (a whole-model state dict is
        :meth:`gather_full_params`; checkpoints: :mod:`dtlab.checkpoint`)."""
        return {n: p.detach() for n, p in self.named_parameters()}

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """``{name: full tensor}`` from the master shards, as the unwrapped module
        would name them (tied weights once). A collective: every rank calls it."""
        out = {}
        for u in self._units:
            if u.shard is None:
                continue
            src = u.shard.detach().to(self.device)  # nccl gathers device tensors
            if self._n_shards > 1:
                full = torch.empty(
                    u.S * self._n_shards, dtype=src.dtype, device=src.device
                )
                comm.all_gather(full, src, self.process_group, tag="zero/gather-full")
            else:
                full = src
            full = full.cpu()
            for name, p, off, k in u.entries:
                out[name] = full[off : off + k].view(p.shape).clone()
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | None = None) -> torch.Tensor:
        """The global L2 norm of the gradient, from the shards: each rank sums the
        squares of its slices (padding is zero), one all-reduce adds them. With
        ``max_norm``, scales every shard's gradient by ``min(1, max_norm/norm)``
        as ``torch.nn.utils.clip_grad_norm_`` does. A collective."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64)
        for g in grads:
            sq += g.detach().double().pow(2).sum().cpu()
        if self._n_shards > 1:
            sq = sq.to(self.device)
            comm.all_reduce(sq, group=self.process_group, tag="zero/grad-norm")
        norm = sq.sqrt().float().cpu()
        if max_norm is not None:
            if max_norm <= 0:
                raise ValueError(f"max_norm must be positive, got {max_norm}")
            scale = min(1.0, max_norm / (float(norm) + 1e-6))
            for g in grads:
                g.mul_(scale)
        return norm

    @property
    def _n_shards(self) -> int:
        return self.world_size if self.stage >= 1 else 1

    # ---- memory accounting (dtlab.memory) --------------------------------------
    def memory_tensors(self, optimizer=None):
        """``(category, tensor)`` pairs of what this rank holds, for
        :class:`dtlab.memory.MemoryTracker`. A master copy that differs from the
        weights the model computes with counts as optimizer state (the ZeRO paper's
        K includes it); ``host_`` marks what offload keeps on the CPU."""
        host = "host_" if self.offload else ""
        for u in self._units:
            if u.full is not None:
                yield "params", u.full
            if u.shard_lp is not None:
                yield "params", u.shard_lp
            if u.shard is None:
                continue
            separate = not u.alias and (self.offload or u.shard.dtype != u.full.dtype)
            if separate:
                yield host + "optimizer", u.shard
            else:
                yield "params", u.shard
            if u.flat_grad is not None:
                yield "grads", u.flat_grad
            for _, p, _, _ in u.entries:
                if p.grad is not None:
                    yield "grads", p.grad
            if u.shard.grad is not None:
                yield host + "grads", u.shard.grad
            if optimizer is not None:
                for v in optimizer.state.get(u.shard, {}).values():
                    if torch.is_tensor(v):
                        yield host + "optimizer", v
        for t in list(self._buffers_live.values()):
            yield "buffers", t

    def _buf(self, t: torch.Tensor) -> torch.Tensor:
        self._buffers_live[id(t)] = t
        return t

    def _unbuf(self, t) -> None:
        if t is not None:
            self._buffers_live.pop(id(t), None)

    # ---- gathering and freeing the weights -------------------------------------
    def _free_full(self, u: _Unit) -> None:
        # the params keep their shapes and views; only the bytes go (FSDP's trick:
        # tensors saved for backward point at this storage and see it come back)
        if u.full is None:  # a unit without parameters (a pipeline stage's root)
            return
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    def _gather(self, u: _Unit, why: str) -> None:
        """Start the all-gather of ``u``'s weights (no-op if there or on the way)."""
        if u.shard is None or u.gathered or u.handle is not None:
            return
        if self.stage == 0:  # every rank holds everything: a local copy at most
            if not u.alias:
                u.full.copy_(u.shard.detach())
            u.gathered = True
            return
        if u.shard_lp is not None:
            if why != "bwd":  # backward reuses the forward's cast: no step between
                u.shard_lp.copy_(u.shard.detach())
            src = u.shard_lp
        elif self.stage == 3:
            src = u.shard.detach()
        else:  # stages 1-2: full stays allocated; the input must not alias it
            src = self._buf(
                u.shard.detach().to(u.full.dtype, copy=True).to(self.device)
            )
        nbytes = u.padded * u.full.element_size()
        if u.full.untyped_storage().nbytes() != nbytes:
            u.full.untyped_storage().resize_(nbytes)
        u.handle = (
            comm.all_gather(
                u.full, src, self.process_group, async_op=True,
                tag=f"zero{self.stage}/ag-{why}/{u.name}",
            ),
            src,
        )  # fmt: skip
        memory.current().update()

    def _wait_gather(self, u: _Unit) -> None:
        if u.handle is None:
            return
        work, src = u.handle
        work.wait()
        if src is not u.shard_lp:
            self._unbuf(src)
        u.handle = None
        u.gathered = True

    def _refresh_all(self) -> None:
        """Stages 0-2: after an optimizer step, start gathering every unit's updated
        slices (each forward hook waits only for its own unit: overlap)."""
        if not self._dirty:
            return
        self._dirty = False
        for u in self._units:
            u.gathered = False
            self._gather(u, "step")

    # ---- forward ---------------------------------------------------------------
    def _begin_forward(self) -> None:
        if self._fwd_order:
            self._last_fwd_order = self._fwd_order
        self._fwd_order = []
        self._in_backward = False
        for u in self._units:
            u.ready, u.reduced = 0, False
        self._drop_full_grads()
        if self.stage <= 2:
            self._refresh_all()

    def _drop_full_grads(self) -> None:
        """Stages 0-1 keep a unit's full gradient bucket (the module's ``.grad``)
        from its reduction until the optimizer step, like DDP (and across the
        micro-batches of a step under :meth:`no_sync`)."""
        if self._unsynced:
            return  # accumulating: the buckets hold this step's sum so far
        for u in self._units:
            if u.flat_grad is not None:
                for _, p, _, _ in u.entries:
                    p.grad = None
                u.flat_grad = None

    def _before_unit(self, u: _Unit, why: str) -> None:
        if why == "fwd":
            self._fwd_order.append(u)
        self._gather(u, why)
        self._wait_gather(u)
        if self.stage == 3 and self.prefetch:
            nxt = self._neighbour(u, why)
            if nxt is not None:
                self._gather(nxt, why)
        memory.current().update()

    def _neighbour(self, u: _Unit, why: str) -> _Unit | None:
        """The unit to prefetch after ``u``: the next in last step's forward order,
        or in backward the previous one of this forward (the root, which holds the
        head, goes first in both)."""
        root = self._units[0]
        if why == "fwd":
            order = self._last_fwd_order or self._units
        else:
            order = [root] + [x for x in reversed(self._fwd_order) if x is not root]
        if u not in order:
            return None
        i = order.index(u) + 1
        return order[i] if i < len(order) else None

    def _after_unit_forward(self, u: _Unit, out) -> None:
        if self.stage < 3:
            return
        is_root = u is self._units[0]
        if not (is_root and self.keep_root_gathered):
            self._wait_gather(u)
            self._free_full(u)
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(out) if t.requires_grad]
            if tensors:
                register_multi_grad_hook(
                    tensors, lambda _g, u=u: self._before_backward(u), mode="any"
                )
        memory.current().update()

    def _make_pre_forward(self, u):
        return lambda module, args: self._before_unit(u, "fwd")

    def _make_post_forward(self, u):
        return lambda module, args, out: self._after_unit_forward(u, out)

    # ---- backward --------------------------------------------------------------
    def _start_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            # each backward pass counts its own gradients: a pipeline schedule runs
            # several forwards before their backwards (F0 F1 B0 B1), so the counts
            # cannot be reset by the forward alone; stages 0-1 also drop the last
            # backward's bucket views, already reduced into the shards' gradients
            for u in self._units:
                u.ready, u.reduced = 0, False
            self._drop_full_grads()
            # runs once the whole backward pass is done (as DDP and FSDP do)
            Variable._execution_engine.queue_callback(
                self.finish_gradient_synchronization
            )

    def _before_backward(self, u: _Unit) -> None:
        self._start_backward()
        if u.reduced:
            return
        self._before_unit(u, "bwd")

    def _make_grad_hook(self, u):
        # weak references only: a hook stored on a parameter that reaches the
        # wrapper or the unit (both of which hold the parameter) is a cycle through
        # the tensor that Python's collector does not break, and a wrapper that
        # never dies keeps its process group's connections open after teardown
        me, unit = weakref.ref(self), weakref.ref(u)

        def hook(param):
            fsdp, u = me(), unit()
            if fsdp is None or u is None:
                return
            fsdp._start_backward()
            u.ready += 1
            if u.ready == u.n_grads and not u.reduced:
                fsdp._reduce(u)

        return hook

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without communicating; the
        first backward outside (or :meth:`reduce_gradients`) reduces the sum once.
        Stages 0 and 1 only: they hold the full gradient anyway. Stages 2 and 3
        reduce-scatter every backward, since keeping the full gradient across
        micro-batches would undo their saving."""
        if self.stage >= 2:
            raise RuntimeError(
                f"no_sync() needs ZeRO stage 0 or 1: stage {self.stage} shards the "
                "gradients, so it reduce-scatters after every backward and adds the "
                "slices (accumulating full gradients would undo its memory saving)"
            )
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce what backward passes under :meth:`no_sync` accumulated, now (a
        pipeline runs every micro-batch's backward under ``no_sync`` and calls this
        once after its last flush). Blocks until the shards' gradients are set."""
        if not self._unsynced:
            return
        for u in self._units:
            if u.flat_grad is not None and u.shard is not None:
                self._launch(u, u.flat_grad)
        self._drain(block=True)
        self._unsynced = False
        memory.current().update()

    @torch.no_grad()
    def _reduce(self, u: _Unit) -> None:
        """Stage 2/3: the unit's gradients are complete: copy them into one flat
        bucket, free them, start its reduce-scatter. Stages 0/1 keep the bucket
        (the module's ``.grad`` are views of it) and, under :meth:`no_sync`, only
        accumulate into it."""
        u.reduced = True
        if u.shard is None or u.n_grads == 0:
            return
        flat = u.flat_grad  # stages 0-1: this step's bucket, if a backward filled it
        if flat is None:
            flat = torch.zeros(u.padded, dtype=u.full.dtype, device=self.device)
        for _, p, off, k in u.entries:
            view = flat[off : off + k].view(p.shape)
            if p.grad is None:
                view.zero_()  # a fresh bucket is zero already; a kept one was cleared
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)  # (autograd adds into a kept view in place)
            p.grad = None if self.stage >= 2 else view
        if self.stage == 3 and not (u is self._units[0] and self.keep_root_gathered):
            self._wait_gather(u)
            self._free_full(u)  # reshard: its backward is over
        if self.stage <= 1:
            u.flat_grad = flat  # full gradients stay: stage 1 shards states only
            if not self.require_backward_grad_sync:
                self._unsynced = True  # under no_sync: no communication now
                return
            self._unsynced = False
        else:
            self._buf(flat)
        self._launch(u, flat)

    def _launch(self, u: _Unit, flat: torch.Tensor) -> None:
        """Start the unit's reduction (all-reduce for stage 0, reduce-scatter
        otherwise); at most ``max_inflight`` are in flight."""
        if self.stage == 0:
            work = comm.all_reduce(
                flat, group=self.process_group, async_op=True,
                tag=f"zero0/ar/{u.name}",
            )  # fmt: skip
            out = flat
        else:
            out = self._buf(torch.empty(u.S, dtype=flat.dtype, device=self.device))
            work = comm.reduce_scatter(
                out, flat, group=self.process_group, async_op=True,
                tag=f"zero{self.stage}/rs/{u.name}",
            )  # fmt: skip
        self._pending.append((u, work, flat, out))
        memory.current().update()
        self._drain(block=False)
        while len(self._pending) >= self.max_inflight:
            # bound the buckets in flight, as FSDP2 does: wait for the oldest
            u0, work0, flat0, out0 = self._pending.pop(0)
            work0.wait()
            self._finish_reduce(u0, flat0, out0)

    @torch.no_grad()
    def _finish_reduce(self, u, flat, out) -> None:
        n = self.world_size
        if self.stage == 0 and u.alias:
            g = flat.div_(n)  # averaged in place: p.grad views see it (like DDP)
        elif self.stage == 1 and u.alias:
            mine = flat[u.lo : u.lo + u.S]
            g = mine.copy_(out).div_(n)  # the slice of the kept bucket is the grad
        else:
            # offload: the slice's gradient goes to the host (a copy even on CPU)
            copy = out.dtype != u.shard.dtype or self.offload
            g = out.to(u.shard.device, u.shard.dtype, copy=copy)
            g = g.div_(n)
        if self.stage >= 1:
            self._unbuf(out)
        if self.stage >= 2:
            self._unbuf(flat)  # stage 2's promise: the full bucket is gone now
        if u.shard.grad is None:
            u.shard.grad = g
        else:  # gradient accumulation over several backward passes
            u.shard.grad.add_(g)

    def _drain(self, block: bool) -> None:
        keep = []
        for i, (u, work, flat, out) in enumerate(self._pending):
            if block or work.is_completed():
                work.wait()
                self._finish_reduce(u, flat, out)
            else:
                keep.append(self._pending[i])
        self._pending = keep

    def finish_gradient_synchronization(self) -> None:
        """Reduce what backward left (units some of whose weights got no gradient),
        wait for every reduction, free what stage 3 still holds. Runs by itself at
        the end of backward; calling it again is harmless."""
        if not self._in_backward:
            return
        for u in self._units:
            if not u.reduced and u.n_grads:
                self._reduce(u)
        self._drain(block=True)
        if self.stage == 3:
            for u in self._units:
                self._wait_gather(u)  # a prefetch nobody used
                if u.gathered and u.shard is not None:
                    self._free_full(u)
        self._in_backward = False
        memory.current().update()


def _tensors(obj):
    """Every tensor inside a (nested) tuple/list/dict output."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)

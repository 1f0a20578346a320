"""``FullyShardedDataParallel``: ZeRO stages 0-3 on any ``nn.Module``.

Taught in chapter 03; chapter 07 runs it over the dp axis of tensor-parallel models
and pipeline stages (:mod:`dtlab.parallelize`). This file is the choreography: which
hook runs when, and in what order. What each stage shards is :mod:`.stages`; the
layout is :mod:`.units`; the all-gathers :mod:`.gather`; the all-reduce and
reduce-scatter :mod:`.reduce`; where the master lives :mod:`.offload`; what a rank
holds and how users see it :mod:`.state`.

One step, per unit (stage 3 shown; the others skip what they do not shard)::

    forward   pre-hook: gather (and prefetch the next)  post-hook: free
    backward  pre-hook: gather again                    grads ready: reduce, free
    step      the optimizer steps the local shards (views of the master slice)
    next fwd  stages 0-2: all-gather the updated slices into the full weights
"""

from __future__ import annotations

import itertools
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

# torch 2.13 has no public pytree module yet; FSDP2 walks outputs with this one too
from torch.utils._pytree import tree_leaves

from dtlab import memory
from dtlab.zero.reduce import Reducer
from dtlab.zero.state import ShardedState

__all__ = ["FullyShardedDataParallel"]


class FullyShardedDataParallel(ShardedState):
    """ZeRO-DP over ``process_group``: ``stage=3`` is FSDP (the default; P_os+g+p),
    ``stage=2`` shards gradients and optimizer state (P_os+g), ``stage=1`` the
    optimizer state only (P_os), ``stage=0`` nothing (plain data parallelism, the
    baseline the others are measured against).

    ``units``: which submodules get their own flat parameter (gathered and freed
    together under stage 3; one gradient bucket under every stage). ``None`` makes
    every element of every ``nn.ModuleList`` a unit (a GPT's blocks); a tuple of
    module classes or a list of modules picks others. What no unit owns belongs to
    the root unit (embeddings, final norm, head).

    ``compute_dtype`` (bf16/fp16): the weights are cast before the all-gather, so the
    traffic and the forward/backward run in it; gradients are reduced in it; the
    optimizer steps fp32 master slices. ``offload=True``: master slices, their
    gradients and therefore the optimizer state live on the host (ZeRO-Offload).
    ``keep_root_gathered=True`` keeps the root unit's weights between forward and
    backward as FSDP2 does for its root (saving one all-gather of it; the traffic is
    then 3Ψ minus the root). ``sync_module_states=True`` broadcasts rank 0's weights
    first, for models not initialised identically on every rank.

    ``replicate``: which parameters every rank keeps whole instead of sharding.
    ``None`` (the default) shards every parameter, norms and biases included, as
    FSDP2's ``fully_shard`` does for each module it wraps. A module class or tuple
    of classes (``(nn.LayerNorm,)``) replicates the parameters such modules hold;
    a function ``fn(name, param) -> bool`` picks them one by one (CS336's FSDP keeps
    what is not a matrix whole: ``lambda name, p: p.dim() < 2``). Replicated
    parameters form a unit of their own beside the one they came from and live as
    under DDP (or ``stage=0``), whatever the stage: every rank holds them, their
    gradient is all-reduced and averaged, the module shows them whole, in their
    shape, with the same gradient on every rank, and the optimizer steps all of
    them on every rank. :mod:`dtlab.checkpoint` saves slices, not yet such units.

    ``replicate_group`` (HSDP, :mod:`dtlab.zero.hsdp`): ``process_group`` is then the
    *shard* group, over which everything above happens, and the replicate group
    joins the ranks that hold the same slice; each reduced gradient slice is
    all-reduced over it and averaged over both (``world_size`` and ``rank`` stay the
    shard group's; :attr:`n_replicas` is R). ``None``: one replica, plain ZeRO.
    Build the two with :func:`dtlab.zero.hsdp_groups`, or pass a layout's axes (a
    ``Topology(Layout(dp=2, tp=2))``'s ``tp`` axis as the shard group and its ``dp``
    axis as the replicate group form the same 2 × 2 grid).

    **What the optimizer steps.** ``.parameters()`` are this rank's local shards, one
    per parameter piece in its slice (:class:`~dtlab.zero.units.LocalShard`, views of
    the fp32 master slice), named as in the module; a plain ``torch.optim.AdamW``
    over them *is* the sharded optimizer. In fp32 on 2 ranks the weights equal bit
    for bit those of one process that adds the ranks' halved gradients, under SGD,
    Adam(W) for-loop or foreach; not under ``fused=True`` on CPU, whose kernel
    rounds a tensor's last ``numel % V`` elements (its scalar tail) otherwise than
    the rest, so a piece's end changes bits (tests/test_fsdp_fidelity.py). A frozen
    parameter's shard has ``requires_grad=False``; one that got no gradient keeps
    ``.grad = None``.

    **What the module shows.** Inside forward and backward the module computes with
    its own parameters (views of the full weights). Once a backward has finished and
    every reduction is done, and until the next forward, backward, optimizer step or
    :meth:`zero_grad`, the module's parameters *are* the local shards, holding the
    averaged gradient (FSDP2's sharded parameters; FSDP1's ``use_orig_params``):

    - stage 0: each parameter's shard is the whole parameter in its shape, fp32,
      with the full averaged gradient, the same on every rank (as under DDP);
    - stages 1-3: each shard is a 1-D piece of the flattened parameter (empty where
      this rank's slice misses it), fp32 master and averaged gradient. Stage 1
      reduce-scatters, so no rank has the full averaged gradient to show.

    No bytes are added: shards and their gradients are views of what ZeRO keeps
    anyway. ``loss.backward()`` averages the gradients before it returns
    (:meth:`finish_gradient_synchronization` runs at its end and is idempotent). The
    full weights are refreshed from the shards at the next forward.
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
        replicate_group=None,
        replicate=None,
    ):
        super().__init__(
            module,
            compute_dtype,
            process_group,
            stage,
            units,
            offload,
            sync_module_states,
            replicate_group,
            replicate,
        )
        self.prefetch = bool(prefetch)
        self.keep_root_gathered = bool(keep_root_gathered)
        self._reducer = Reducer(
            self.placement,
            self.process_group,
            self._in_flight,
            replicas=self.replicas,
        )
        self._in_backward = False
        self._fwd_order: list = []
        self._last_fwd_order: list = []
        # False under no_sync(): backward passes accumulate without communicating
        self.require_backward_grad_sync = True
        self._unsynced = False  # a bucket holds gradients not yet reduced
        # forwards whose backward has not started (a pipeline runs F0 F1 B0 B1):
        # the module shows its shards only when none is left
        self._awaiting: dict[int, int] = {}
        self._forward_ids = itertools.count()
        self._install_hooks()

    # ---- construction ----------------------------------------------------------
    def _install_hooks(self) -> None:
        for u in self._units:
            for e in u.entries:
                if e.param.requires_grad:
                    e.param.register_post_accumulate_grad_hook(self._grad_hook(u))
            if u.module is not self.module and not u.replicated:
                u.module.register_forward_pre_hook(self._pre_forward_hook(u))
                u.module.register_forward_hook(self._post_forward_hook(u))
        me = weakref.ref(self)
        ids = {id(s.tensor) for s in self._shards}

        def steps_ours(optimizer):
            return any(
                id(p) in ids for g in optimizer.param_groups for p in g["params"]
            )

        def after_step(optimizer, args, kwargs):
            fsdp = me()
            if fsdp is not None and steps_ours(optimizer):
                fsdp._dirty = True
                fsdp._drop_full_grads()  # stages 0-1: the step consumed them
                fsdp._forget_empty_grads()
                fsdp._show(local=False)

        def before_step(optimizer, args, kwargs):
            fsdp = me()
            if fsdp is not None and fsdp._unsynced and steps_ours(optimizer):
                raise RuntimeError(
                    "the optimizer would step with gradients that backward passes "
                    "under no_sync() accumulated but nobody reduced: run the last "
                    "microbatch's backward outside no_sync(), or call "
                    "reduce_gradients() before the step"
                )

        # any torch optimizer (fused ones too) that steps our shards marks them dirty
        self._step_hook = register_optimizer_step_post_hook(after_step)
        self._pre_step_hook = register_optimizer_step_pre_hook(before_step)
        weakref.finalize(self, self._step_hook.remove)
        weakref.finalize(self, self._pre_step_hook.remove)

    def _pre_forward_hook(self, u):
        return lambda module, args: self._before_unit(u, "fwd")

    def _post_forward_hook(self, u):
        return lambda module, args, out: self._after_unit_forward(u, out)

    def _grad_hook(self, u):
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

    # ---- forward ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self._begin_forward()
        root = self._units[0]
        self._before_unit(root, "fwd")
        out = self.module(*args, **kwargs)
        self._after_unit_forward(root, out)
        if torch.is_grad_enabled():
            self._await_backward(out)
        return out

    def _begin_forward(self) -> None:
        self._show(local=False)
        if self._fwd_order:
            self._last_fwd_order = self._fwd_order
        self._fwd_order = []
        self._in_backward = False
        for u in self._units:
            u.ready, u.reduced = 0, False
        self._drop_full_grads()
        if self._dirty:  # P_os: the updated slices, once (stage 3: replicated units)
            self.sync_params()

    def _before_unit(self, u, why: str) -> None:
        if why == "fwd":
            self._fwd_order.append(u)
        self._gather.start(u, why)
        self._gather.wait(u)
        if self.sharding.shards_params and self.prefetch:
            nxt = self._neighbour(u, why)
            if nxt is not None:
                self._gather.start(nxt, why)
        memory.current().update()

    def _neighbour(self, u, why: str):
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

    def _await_backward(self, out) -> None:
        """Mark this forward as waiting for its backward, until one of its outputs
        gets a gradient or all of them are gone."""
        tensors = _needing_grad(out)
        if not tensors:
            return
        key = next(self._forward_ids)
        self._awaiting[key] = len(tensors)
        me = weakref.ref(self)

        def on_grad(_grad):  # fires first in a backward from this output
            fsdp = me()
            if fsdp is not None:
                fsdp._awaiting.pop(key, None)
                fsdp._start_backward()

        def gone():
            fsdp = me()
            if fsdp is not None and key in fsdp._awaiting:
                fsdp._awaiting[key] -= 1
                if not fsdp._awaiting[key]:
                    del fsdp._awaiting[key]

        for t in tensors:
            t.register_hook(on_grad)
            weakref.finalize(t, gone)

    # ---- P_os+g+p (stage 3): gathered before each use, freed after it ----------
    def _after_unit_forward(self, u, out) -> None:
        if not u.sharding.shards_params:
            return
        if not self._keeps_gathered(u):
            self._gather.wait(u)
            u.free()  # the weights exist only while the unit computes
        if torch.is_grad_enabled():
            tensors = _needing_grad(out)
            if tensors:  # fires once the unit's outputs get their gradients
                register_multi_grad_hook(
                    tensors, lambda _g, u=u: self._before_backward(u), mode="any"
                )
        memory.current().update()

    def _before_backward(self, u) -> None:
        self._start_backward()
        if not u.reduced:
            self._before_unit(u, "bwd")  # gathered again

    def _reshard(self, u, everything: bool = False) -> None:
        """Free ``u``'s full weights once its backward is over (``everything``: at
        the end of backward, a kept root and unused prefetches too)."""
        if not u.sharding.shards_params or u.master is None:
            return
        if everything or not self._keeps_gathered(u):
            self._gather.wait(u)
            if u.gathered:
                u.free()

    def _keeps_gathered(self, u) -> bool:
        # FSDP2's habit for its root: kept from forward to backward
        return u is self._units[0] and self.keep_root_gathered

    # ---- backward --------------------------------------------------------------
    def _start_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._show(local=False)
        # each backward pass counts its own gradients: a pipeline schedule runs
        # several forwards before their backwards (F0 F1 B0 B1), so the counts
        # cannot be reset by the forward alone; stages 0-1 also drop the last
        # backward's bucket views, already reduced into the shards' gradients
        for u in self._units:
            u.ready, u.reduced = 0, False
        self._drop_full_grads()
        # runs once the whole backward pass is done (as DDP and FSDP do)
        Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)

    @torch.no_grad()
    def _reduce(self, u) -> None:
        """``u``'s gradients are complete: bucket them, free stage 3's weights, start
        the reduction (stages 0-1 under :meth:`no_sync`: only accumulate)."""
        u.reduced = True
        if u.master is None or u.n_grads == 0:
            return
        flat, with_grad = self._reducer.bucket(u)
        self._reshard(u)
        if u.sharding.keeps_full_grads:
            u.flat_grad = flat  # the module's .grad are views of it until the step
            if not self.require_backward_grad_sync:
                self._unsynced = True  # under no_sync: no communication now
                return
            self._unsynced = False
        self._reducer.launch(u, flat, with_grad)

    def _drop_full_grads(self) -> None:
        """Stages 0-1 keep a unit's full gradient bucket from its reduction until
        the optimizer step, like DDP (and across the microbatches of a step under
        :meth:`no_sync`)."""
        if self._unsynced:
            return  # accumulating: the buckets hold this step's sum so far
        for u in self._units:
            if u.flat_grad is not None:
                for e in u.entries:
                    e.param.grad = None
                u.flat_grad = None

    def finish_gradient_synchronization(self) -> None:
        """Reduce what backward left (units some of whose weights got no gradient),
        wait for every reduction, free what stage 3 still holds, and show the local
        shards in the module. Runs by itself at the end of backward; calling it
        again is harmless. Called outside :meth:`no_sync` after backward passes
        inside it, it reduces their sum now (:meth:`reduce_gradients`), as DDP's
        does."""
        if not self._in_backward:
            if self._unsynced and self.require_backward_grad_sync:
                self.reduce_gradients()
            return
        for u in self._units:
            if not u.reduced and u.n_grads:
                self._reduce(u)
        self._reducer.drain(block=True)
        for u in self._units:
            self._reshard(u, everything=True)  # a prefetch nobody used, a kept root
        self._in_backward = False
        self._show_shards_when_done()
        memory.current().update()

    def _show_shards_when_done(self) -> None:
        if not self._unsynced and not self._awaiting:
            self._show(local=True)

    # ---- gradient accumulation -------------------------------------------------
    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without communicating; the
        first backward outside (or :meth:`reduce_gradients`) reduces the sum once.
        Stages 0 and 1 only: they hold the full gradient anyway. Stages 2 and 3
        reduce-scatter every backward, since keeping the full gradient across
        microbatches would undo their saving."""
        if self.sharding.shards_grads:
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
        pipeline runs every microbatch's backward under ``no_sync`` and calls this
        once after its last flush). Blocks until the shards' gradients are set."""
        if not self._unsynced:
            return
        for u in self._units:
            if u.flat_grad is not None and u.master is not None:
                with_grad = [e for e in u.entries if e.param.grad is not None]
                self._reducer.launch(u, u.flat_grad, with_grad)
        self._reducer.drain(block=True)
        self._unsynced = False
        self._show_shards_when_done()
        memory.current().update()


def _needing_grad(out) -> list[torch.Tensor]:
    """The tensors inside a (nested) output that backward will reach."""
    return [t for t in tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]

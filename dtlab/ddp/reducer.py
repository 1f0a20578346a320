"""``DistributedDataParallel``: PyTorch DDP's design (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB, §3-4).

Taught in chapter 02 (data parallelism).

Data parallelism replicates the model and splits the batch. Rank r of N computes the
mean loss ``L_r`` over its B/N examples; the mean over the global batch is
``L = 1/N · Σ_r L_r``, so its gradient is the average of the ranks' gradients::

    ∇L(w) = 1/N · Σ_r ∇L_r(w)

One all-reduce (sum, then divide by N) hands every rank the same ∇L, every rank takes
the same optimizer step from the same weights, and the replicas stay identical without
ever sending a weight. A ring all-reduce of Ψ gradient values sends ``2(N-1)/N · Ψ``
values from each rank: the "2Ψ per step" of the ZeRO paper (Rajbhandari et al. 2020,
§7.1).

One process per device; weights broadcast once from rank 0; gradients packed into
*buckets* (:mod:`dtlab.ddp.buckets`); a hook per parameter counts the gradients that
are ready, and each bucket's all-reduce starts asynchronously as soon as its last
gradient is (the *overlap* with the backward still computing earlier layers);
``loss.backward()`` returns with the gradients averaged. ``no_sync()`` skips the
all-reduce for gradient accumulation.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from dtlab import comm, telemetry
from dtlab.ddp.buckets import Bucket, broadcast_flat, make_buckets
from dtlab.ddp.timing import emit_backward_span, emit_sync, sync_summary
from dtlab.ddp.unused import globally_used, reachable_params
from dtlab.events import wire_bytes

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` returns with every gradient
    averaged over the ranks of ``process_group`` (a drop-in for
    ``torch.nn.parallel.DistributedDataParallel``).

    - At wrap time, parameters and buffers are broadcast from the group's rank 0, so
      all replicas start equal (whatever seed each rank used).
    - Trainable parameters are packed into buckets of about ``bucket_cap_mb`` MiB, in
      reverse registration order (:func:`dtlab.estimate.ddp_bucket_assignment`).
    - Each parameter's ``.grad`` is its slice of its bucket (set at forward), so
      autograd adds the gradient straight into the flat buffer.
    - A post-accumulate-grad hook per parameter counts the gradients that are ready;
      when a bucket is complete, and every bucket before it has been launched, the
      bucket is pre-divided by N and its async all-reduce starts
      (:func:`dtlab.comm.all_reduce`), while backward goes on.
    - A callback queued on the autograd engine runs when backward ends: it waits for
      the buckets still in flight; ``.grad`` then holds the average.
    - ``no_sync()``: forward passes inside it skip the all-reduce, so their
      gradients accumulate locally; the first backward outside it averages the sum.
    - ``ignored_parameters`` are left out of the buckets and of the initial
      broadcast (another group keeps them equal: a mixture of experts' experts),
      as PyTorch's ``_set_params_and_buffers_to_ignore_for_model`` does.
    - Frozen parameters (``requires_grad=False``) are left out of the buckets; a
      parameter used twice (a tied embedding and head) is one parameter, in one bucket,
      its gradient summed by autograd before the hook fires.
    - A parameter that gets no gradient makes backward raise, naming it, unless
      ``find_unused_parameters=True``: then the autograd graph is searched after each
      forward, unused parameters count as ready with a zero gradient, and one that no
      rank used keeps its ``.grad`` untouched, as in PyTorch.

    ``process_group`` may be a :class:`dtlab.topology.Axis`, a process group or
    ``None`` (the default group). Telemetry: a ``B`` span (backward compute), an
    ``idle`` span (waiting for the last buckets after backward), one ``ddp_bucket``
    event per bucket and step (launch and completion times), and the comm events of
    :mod:`dtlab.comm` (tag ``"ddp"``). :attr:`last_sync` summarises the last step.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        process_group=None,
        *,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        ignored_parameters=(),
    ):
        super().__init__()
        if isinstance(bucket_cap_mb, bool) or not isinstance(
            bucket_cap_mb, (int, float)
        ):
            raise ValueError(f"bucket_cap_mb must be a number, got {bucket_cap_mb!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be positive, got {bucket_cap_mb}: a tiny value "
                "such as 1e-6 gives one bucket per parameter"
            )
        self.module = module
        self.process_group = process_group
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        live = dist.is_available() and dist.is_initialized()
        # a DDP over one rank (or without torch.distributed) is the module itself
        self.world_size = comm.group_size(process_group) if live else 1
        self._ignored = {id(p) for p in ignored_parameters}
        self._sync_module_states()

        names = {id(p): n for n, p in module.named_parameters()}  # tied: once
        # what DDP leaves alone: frozen parameters, and those another group reduces
        # (a mixture of experts' experts, reduced over the ranks holding the same)
        self._params = [
            p
            for p in module.parameters()
            if p.requires_grad and id(p) not in self._ignored
        ]
        self._names = {id(p): names[id(p)] for p in self._params}
        self.buckets = make_buckets(self._params, self._names, self.bucket_cap_mb)
        self._where = {
            id(p): b.index for b in self.buckets for p in b.params
        }  # param -> bucket
        # Hooks reach the wrapper through a weak reference: a tensor's hook that
        # holds the wrapper (which holds the tensor) is a cycle Python's collector
        # does not break, and a wrapper that never dies keeps its process group's
        # connections open after the group is torn down.
        me = weakref.ref(self)

        def on_grad_ready(p, me=me):
            ddp = me()
            if ddp is not None:
                ddp._on_grad_ready(p)

        self._hooks = [
            p.register_post_accumulate_grad_hook(on_grad_ready) for p in self._params
        ]
        self.require_backward_grad_sync = True  # what no_sync() switches off
        self._sync = False  # decided at forward time, like PyTorch
        self._armed = False
        self._synced = True  # no gradient waits for an all-reduce
        self._used_since_sync: set[int] = set()
        self._backwards = 0  # backward passes since the last synchronization
        self._unused: set[int] = set()
        self._reset_backward()
        self.last_sync: dict = {}

    # ---- set-up -----------------------------------------------------------------
    def _sync_module_states(self) -> None:
        if self.world_size > 1:
            states = [
                p.detach()
                for p in self.module.parameters()
                if id(p) not in self._ignored
            ]
            states += list(self.module.buffers())
            broadcast_flat(states, self.process_group, tag="ddp-init")

    # ---- forward ----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_flat(buffers, self.process_group, tag="ddp-buffers")
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._finish_pending()  # a forward without backward left buckets in flight
        self._reset_backward()
        self._sync = self.require_backward_grad_sync and self.world_size > 1
        self._armed = True  # hooks act only in a backward of our own forward
        if self.world_size > 1 and not self.find_unused_parameters:
            self._point_grads_at_buckets()
        out = self.module(*args, **kwargs)
        roots = [t for t in tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]
        for t in roots:
            # fires when backward reaches this output: the start of the backward pass
            if t.grad_fn is not None:
                t.register_hook(self._on_backward_start)
        if self._sync and self.find_unused_parameters:
            used = reachable_params(roots)
            self._unused = {id(p) for p in self._params if id(p) not in used}
        else:
            self._unused = set()
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Forward/backward passes inside skip the gradient all-reduce; gradients
        accumulate in ``.grad``. The next backward outside (or an explicit
        :meth:`finish_gradient_synchronization`) averages the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @torch.no_grad()
    def _point_grads_at_buckets(self) -> None:
        """Give every parameter without a gradient a zeroed slice of its bucket as
        ``.grad``: autograd then adds the gradient into the bucket itself, and
        neither a copy in before the all-reduce nor a copy out after it is needed
        (PyTorch's ``gradient_as_bucket_view``; also one Ψ of memory less). Not
        with ``find_unused_parameters``, where a parameter no rank used must keep
        ``.grad = None``."""
        for b in self.buckets:
            b.allocate()
            if all(p.grad is None for p in b.params):
                b.buffer.zero_()  # the usual case after zero_grad(set_to_none=True)
                for p, view in zip(b.params, b.views):
                    p.grad = view
                continue
            for p, view in zip(b.params, b.views):
                if p.grad is None:
                    view.zero_()
                    p.grad = view

    # ---- backward: hooks ----------------------------------------------------------
    def _reset_backward(self) -> None:
        self._ready = [0] * len(self.buckets)  # gradients ready per bucket
        self._ready_ids: set[int] = set()
        self._next = 0  # next bucket to launch: buckets go out in index order
        self._pending: list[dict] = []  # launched, not yet waited for
        self._in_backward = False
        self._t_backward = 0.0

    def _on_backward_start(self, grad=None):
        if self._in_backward or not self._armed:
            return None
        self._in_backward = True
        self._synced = False
        self._t_backward = telemetry.clock()
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if self._sync:
            for pid in self._unused:  # no hook will fire for these: ready now
                self._mark_ready(pid)
        return None

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._armed:  # the module was run without us, or a stale wrapper
            return
        if not self._in_backward:
            self._on_backward_start()
        self._used_since_sync.add(id(param))
        if not self._sync:
            return
        if id(param) in self._ready_ids:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {self._names[id(param)]!r} got "
                "its gradient twice in one backward pass (reentrant checkpointing, or "
                "backward through the same graph twice): its bucket was already "
                "all-reduced"
            )
        self._mark_ready(id(param))

    def _mark_ready(self, pid: int) -> None:
        if self._pending:
            self._stamp_completed()
        self._ready_ids.add(pid)
        self._ready[self._where[pid]] += 1
        # launch in index order, so that every rank issues the same collectives in
        # the same sequence even if its hooks fired in another order
        while self._next < len(self.buckets) and self._ready[self._next] == len(
            self.buckets[self._next].params
        ):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.allocate()
        with torch.no_grad():
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None:
                    view.zero_()  # unused here: contributes nothing
                elif p.grad is not view:
                    view.copy_(p.grad)  # a gradient autograd did not add in place
            # divide before summing, as PyTorch's reducer does (keeps fp16 sums in
            # range); exact when N is a power of two
            bucket.buffer.mul_(1.0 / self.world_size)
        entry = {"bucket": bucket, "t_launch": telemetry.clock(), "done": [None]}
        entry["handle"] = comm.all_reduce(
            bucket.buffer, group=self.process_group, async_op=True, tag="ddp"
        )
        self._pending.append(entry)

    def _stamp_completed(self) -> None:
        """Note when the buckets in flight completed, as seen from here. (Polled
        at every gradient hook rather than stamped by a callback on the
        communication thread: a Python callback there waits for the GIL, which
        backward holds, and gloo runs the next bucket only after it.)"""
        now = None
        for entry in self._pending:
            if entry["done"][0] is None and entry["handle"].is_completed():
                now = now or telemetry.clock()
                entry["done"][0] = now

    # ---- backward: the end ----------------------------------------------------------
    def _on_backward_end(self) -> None:
        t_end = telemetry.clock()
        rec = telemetry.current()
        m = self._backwards
        self._backwards += 1
        self._in_backward = False
        self._armed = False
        if rec.enabled:
            emit_backward_span(rec, m, self._t_backward, t_end)
        if not self._sync:
            return
        missing = [
            self._names[id(p)] for p in self._params if id(p) not in self._ready_ids
        ]
        if missing and not self.find_unused_parameters:
            self._finish_pending()
            self._reset_backward()
            raise RuntimeError(
                "DistributedDataParallel: these parameters got no gradient in this "
                f"backward pass: {missing}. They were not used to compute the loss, "
                "so their buckets could never be all-reduced. Freeze them "
                "(requires_grad=False) before wrapping, or pass "
                "find_unused_parameters=True."
            )
        for p in self._params:  # unused, and missed by the search after forward
            if id(p) not in self._ready_ids:
                self._mark_ready(id(p))
        self._finalize(t_end)

    def _finalize(self, t_backward_end: float) -> None:
        """Wait for every bucket in flight (each parameter's ``.grad`` is its slice
        of the bucket, now holding the average), record what the step cost."""
        rec = telemetry.current()
        used = (
            globally_used(self._params, self._used_since_sync, self.process_group)
            if self.find_unused_parameters
            else None
        )
        wire = payload = 0.0
        for entry in self._pending:
            entry["handle"].wait()
            t_waited = telemetry.clock()
            t_done = entry["done"][0]
            entry["t_done"] = (
                t_waited if t_done is None or t_done > t_waited else t_done
            )
            entry["t_waited"] = t_waited
            bucket = entry["bucket"]
            for p, view in zip(bucket.params, bucket.views):
                if used is not None and id(p) not in used:
                    continue  # no rank used it: leave .grad as it was
                if p.grad is not view:
                    p.grad = view  # the average, where the bucket holds it
            payload += bucket.nbytes
            wire += wire_bytes("all_reduce", bucket.nbytes, self.world_size)
        t_synced = telemetry.clock()
        if rec.enabled:
            emit_sync(rec, self._pending, self.world_size, t_backward_end, t_synced)
        self.last_sync = sync_summary(
            self._pending, self._t_backward, t_backward_end, t_synced, payload, wire
        )
        self.last_sync["backwards"] = self._backwards
        self._pending = []
        self._synced = True
        self._backwards = 0
        self._used_since_sync = set()
        self._reset_backward()

    def _finish_pending(self) -> None:
        """Wait for buckets launched by a backward that did not complete (keeps the
        ranks' collectives matched); their results are dropped."""
        for entry in self._pending:
            entry["handle"].wait()
        self._pending = []

    def finish_gradient_synchronization(self) -> None:
        """Make sure ``.grad`` holds the averaged gradients. Idempotent.

        After an ordinary backward this does nothing: the end-of-backward callback
        already waited for every bucket. After backward passes under ``no_sync()``
        it all-reduces the accumulated gradients now (every rank must call it).
        """
        if self._in_backward:
            raise RuntimeError(
                "finish_gradient_synchronization() was called during backward: call "
                "it after loss.backward() returns"
            )
        if self._synced or self.world_size == 1:
            self._synced = True
            return
        t = telemetry.clock()
        self._t_backward = t
        self._reset_backward()
        self._sync = True
        for p in self._params:
            self._mark_ready(id(p))
        self._finalize(t)

    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [list(b.names) for b in self.buckets]

    def remove_hooks(self) -> None:
        """Detach from the module (its parameters stop triggering all-reduces)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

"""Data parallelism: PyTorch's old single-process ``DataParallel``, and
``DistributedDataParallel`` with gradient buckets that overlap the backward pass.

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

- :class:`DataParallel` is what ``torch.nn.DataParallel`` does: *one* process drives N
  devices. Every forward it copies the weights to each device (replicate), splits the
  batch (scatter), runs the replicas in Python threads (parallel apply), concatenates
  the outputs on the primary device (gather), and the backward pass sums the replicas'
  gradients back onto the primary. PyTorch calls it outdated: the threads share one
  GIL, weights travel every step, the primary holds the outputs, the loss and all the
  gradients, and it cannot leave one machine.
- :class:`DistributedDataParallel` is PyTorch DDP's design (Li et al. 2020, "PyTorch
  Distributed: Experiences on Accelerating Data Parallel Training", VLDB, §3-4): one
  process per device; weights broadcast once from rank 0; gradients packed into
  *buckets* in reverse registration order (the order backward produces them); each
  bucket's all-reduce starts asynchronously as soon as its last gradient is ready,
  while backward keeps computing earlier layers; ``loss.backward()`` returns with the
  gradients averaged. ``no_sync()`` skips the all-reduce for gradient accumulation.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dtlab import comm, telemetry
from dtlab.estimate import ddp_bucket_assignment, wire_bytes

__all__ = ["DataParallel", "DistributedDataParallel", "Bucket", "MB"]

MB = 1024 * 1024  # PyTorch's bucket_cap_mb counts MiB


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple / list / dict output."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# ---- the old way: one process, N devices -------------------------------------------
class DataParallel(nn.Module):
    """Single-process data parallelism over ``n_devices`` simulated devices, done the
    way ``torch.nn.DataParallel`` does it (``replicate``, ``scatter``,
    ``parallel_apply``, ``gather``).

    ``forward(*inputs)`` splits every tensor input along dim 0, runs one replica per
    device in its own thread, and returns the outputs concatenated along dim 0 on the
    primary (device 0). Scalar outputs (a per-replica mean loss) come back as a vector
    of N values, as in PyTorch: take its mean, which is the global-batch mean only
    when the shards have equal size.

    Replicas are autograd copies of the primary's weights (``p.clone()``), so
    ``loss.backward()`` sums their gradients into the primary's ``.grad``: the
    "reduce on the primary" step. Replica 0 runs on the primary's own weights.

    After each forward, :attr:`last_forward` holds the time of each phase and the
    bytes each device holds (see :meth:`memory_report`).
    """

    def __init__(self, module: nn.Module, n_devices: int = 2, *, threads: bool = True):
        super().__init__()
        _check_positive_int("n_devices", n_devices)
        self.module = module
        self.n_devices = n_devices
        self.threads = threads
        # module *structures* for devices 1..N-1; their weights are replaced by fresh
        # copies of the primary's on every forward (what replicate() does each step)
        self._shells = [copy.deepcopy(module) for _ in range(n_devices - 1)]
        self.last_forward: dict = {}

    def _replicate(self, shell: nn.Module) -> nn.Module:
        """Point ``shell`` at differentiable copies of the primary's tensors. A tied
        weight stays tied: one copy per tensor, however many modules use it."""
        copies: dict[int, torch.Tensor] = {}
        originals = dict(self.module.named_modules(remove_duplicate=False))
        for name, mod in shell.named_modules(remove_duplicate=False):
            src = originals[name]
            for key, p in src._parameters.items():
                if p is not None:
                    # not an nn.Parameter: a plain tensor in _parameters is what
                    # torch's replicate() installs, and grads flow back through it
                    mod._parameters[key] = copies.setdefault(id(p), p.clone())
            for key, b in src._buffers.items():
                if b is not None:
                    mod._buffers[key] = copies.setdefault(id(b), b.clone())
        return shell

    def forward(self, *inputs):
        n, clock = self.n_devices, telemetry.clock
        rec = telemetry.current()
        times: dict[str, float] = {}

        t = clock()
        replicas = [self.module] + [self._replicate(s) for s in self._shells]
        times["replicate"] = clock() - t

        t = clock()
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.shape[0] < n:
                raise ValueError(
                    f"batch of {x.shape[0]} cannot be split over {n} devices: use a "
                    f"batch of at least n_devices={n}"
                )
        shards = [
            tuple(x.tensor_split(n)[i] if isinstance(x, torch.Tensor) else x
                  for x in inputs)
            for i in range(n)
        ]  # fmt: skip
        times["scatter"] = clock() - t

        outputs: list = [None] * n
        saved: list[int] = [0] * n  # activation bytes each replica keeps for backward
        errors: list = []
        grad_enabled = torch.is_grad_enabled()

        def run(i: int) -> None:
            # the weights a replica saves for backward are weights, not activations
            seen = {t.untyped_storage().data_ptr() for t in replicas[i].parameters()}

            def pack(tensor):  # count each saved storage once
                key = tensor.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    saved[i] += tensor.untyped_storage().nbytes()
                return tensor

            try:
                # grad mode is per thread: carry the caller's into the worker
                with torch.set_grad_enabled(grad_enabled):
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                        with rec.span("F", stage=i):
                            outputs[i] = replicas[i](*shards[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

        t = clock()
        if self.threads and n > 1:
            workers = [threading.Thread(target=run, args=(i,)) for i in range(n)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        else:
            for i in range(n):
                run(i)
        times["parallel_apply"] = clock() - t
        if errors:
            raise errors[0]

        t = clock()
        gathered = _gather(outputs)
        times["gather"] = clock() - t
        self.last_forward = {
            "times": times,
            "activations": saved,
            "outputs": [sum(_nbytes(o) for o in _tensors(out)) for out in outputs],
            "gathered": sum(_nbytes(o) for o in _tensors(gathered)),
        }
        return gathered

    def memory_report(self) -> list[dict[str, int]]:
        """Bytes each simulated device holds during the last step's backward pass.

        Every device holds a full copy of the weights and the activations of its
        shard. Only the primary holds gradients (the replicas' gradients are summed
        into it and freed) and the gathered outputs of the *whole* batch, which is
        why the primary runs out of memory first.
        """
        if not self.last_forward:
            raise RuntimeError("no forward pass yet: call the module first")
        params = sum(_nbytes(p) for p in self.module.parameters())
        grads = sum(_nbytes(p) for p in self.module.parameters() if p.requires_grad)
        f = self.last_forward
        report = []
        for i in range(self.n_devices):
            report.append(
                {
                    "device": i,
                    "params": params,
                    "grads": grads if i == 0 else 0,
                    "activations": f["activations"][i],
                    "outputs": f["gathered"] if i == 0 else f["outputs"][i],
                }
            )
        return report


def _gather(outputs: list):
    """Concatenate the replicas' outputs along dim 0 on the primary; scalars become a
    vector of N values (torch's gather warns and does the same)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(outputs)
        return torch.cat(outputs, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_gather([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _gather([o[k] for o in outputs]) for k in first}
    if first is None:
        return None
    raise TypeError(f"cannot gather outputs of type {type(first).__name__}")


# ---- DDP: one process per rank, buckets, overlap -----------------------------------
@dataclass
class Bucket:
    """Gradients all-reduced together, as one flat buffer.

    ``params`` are in the order they sit in the buffer (reverse registration order);
    ``offsets[i]`` is where ``params[i]`` starts.
    """

    index: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    numel: int
    dtype: torch.dtype
    buffer: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` returns with every gradient
    averaged over the ranks of ``process_group`` (a drop-in for
    ``torch.nn.parallel.DistributedDataParallel``).

    - At wrap time, parameters and buffers are broadcast from the group's rank 0, so
      all replicas start equal (whatever seed each rank used).
    - Trainable parameters are packed into buckets of about ``bucket_cap_mb`` MiB, in
      reverse registration order (:func:`dtlab.estimate.ddp_bucket_assignment`).
    - A post-accumulate-grad hook per parameter counts the gradients that are ready;
      when a bucket is complete, and every bucket before it has been launched, its
      gradients are copied into its flat buffer, pre-divided by N, and an async
      all-reduce starts (:func:`dtlab.comm.all_reduce`), while backward goes on.
    - A callback queued on the autograd engine runs when backward ends: it waits for
      the buckets still in flight and copies the averaged values back into ``.grad``.
    - ``no_sync()``: forward passes inside it skip the all-reduce, so their
      gradients accumulate locally; the first backward outside it averages the sum.
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
        self._sync_module_states()

        names = {id(p): n for n, p in module.named_parameters()}  # tied: once
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._names = {id(p): names[id(p)] for p in self._params}
        self.buckets = self._make_buckets()
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
    @torch.no_grad()
    def _broadcast(self, tensors, tag: str) -> None:
        """Copy rank 0's values of ``tensors`` to every rank: one flat broadcast per
        dtype instead of one call per tensor."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            comm.broadcast(flat, src=0, group=self.process_group, tag=tag)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _sync_module_states(self) -> None:
        if self.world_size > 1:
            states = [p.detach() for p in self.module.parameters()]
            states += list(self.module.buffers())
            self._broadcast(states, tag="ddp-init")

    def _make_buckets(self) -> list[Bucket]:
        """Reverse registration order, split by :func:`ddp_bucket_assignment`; one
        dtype per bucket (PyTorch keeps one open bucket per dtype, so do we)."""
        order = self._params[::-1]
        cap = self.bucket_cap_mb * MB
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(order):
            by_dtype.setdefault(p.dtype, []).append(i)
        groups = []
        for idx in by_dtype.values():
            sizes = [_nbytes(order[i]) for i in idx]
            groups += [[idx[j] for j in b] for b in ddp_bucket_assignment(sizes, cap)]
        groups.sort(key=lambda g: g[0])  # launch order: where the bucket starts
        buckets = []
        for k, members in enumerate(groups):
            params = [order[i] for i in members]
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            buckets.append(
                Bucket(
                    index=k,
                    params=params,
                    names=[self._names[id(p)] for p in params],
                    offsets=offsets,
                    numel=total,
                    dtype=params[0].dtype,
                )
            )
        return buckets

    # ---- forward ----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            buffers = list(self.module.buffers())
            if buffers:
                self._broadcast(buffers, tag="ddp-buffers")
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        self._finish_pending()  # a forward without backward left buckets in flight
        self._reset_backward()
        self._sync = self.require_backward_grad_sync and self.world_size > 1
        self._armed = True  # hooks act only in a backward of our own forward
        out = self.module(*args, **kwargs)
        roots = [t for t in _tensors(out) if t.requires_grad]
        for t in roots:
            # fires when backward reaches this output: the start of the backward pass
            if t.grad_fn is not None:
                t.register_hook(self._on_backward_start)
        if self._sync and self.find_unused_parameters:
            used = _reachable_params(roots)
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
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(
                bucket.numel, dtype=bucket.dtype, device=bucket.params[0].device
            )
        scale = 1.0 / self.world_size
        with torch.no_grad():
            for p, off in zip(bucket.params, bucket.offsets):
                view = bucket.buffer[off : off + p.numel()]
                if p.grad is None:
                    view.zero_()  # unused here: contributes nothing
                else:
                    # divide before summing, as PyTorch's reducer does (keeps fp16
                    # sums in range); exact when N is a power of two
                    torch.mul(p.grad.reshape(-1), scale, out=view)
        done = [None]  # completion time, stamped on the communication thread
        entry = {"bucket": bucket, "t_launch": telemetry.clock(), "done": done}
        handle = comm.all_reduce(
            bucket.buffer, group=self.process_group, async_op=True, tag="ddp"
        )
        entry["handle"] = handle
        # The callback must not reach the handle: a future that (through its
        # callback) references its own Work is a cycle through C++ that Python's
        # collector cannot see, and a leaked Work keeps gloo's sockets open.
        handle.get_future().add_done_callback(
            lambda _f, d=done: d.__setitem__(0, telemetry.clock())
        )
        self._pending.append(entry)

    # ---- backward: the end ----------------------------------------------------------
    def _on_backward_end(self) -> None:
        t_end = telemetry.clock()
        rec = telemetry.current()
        m = self._backwards
        self._backwards += 1
        self._in_backward = False
        self._armed = False
        if rec.enabled:
            shift = rec.now() - telemetry.clock()  # our stamps -> the recorder's axis
            rec.emit(
                "span",
                name="B",
                stage=0,
                microbatch=m,
                t_start=self._t_backward + shift,
                t_end=t_end + shift,
            )
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
        """Wait for every bucket in flight, write the averages back into ``.grad``,
        record what the step cost."""
        rec = telemetry.current()
        globally_used = self._globally_used() if self.find_unused_parameters else None
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
            with torch.no_grad():
                for p, off in zip(bucket.params, bucket.offsets):
                    if globally_used is not None and id(p) not in globally_used:
                        continue  # no rank used it: leave .grad as it was
                    avg = bucket.buffer[off : off + p.numel()].view_as(p)
                    if p.grad is None:
                        p.grad = avg.clone()
                    else:
                        p.grad.copy_(avg)
            payload += bucket.nbytes
            wire += wire_bytes("all_reduce", bucket.nbytes, self.world_size)
        t_synced = telemetry.clock()
        if rec.enabled:
            shift = rec.now() - telemetry.clock()  # our stamps -> the recorder's axis
            for entry in self._pending:
                b = entry["bucket"]
                rec.emit(
                    "ddp_bucket",
                    bucket=b.index,
                    numel=b.numel,
                    payload_bytes=b.nbytes,
                    wire_bytes=wire_bytes("all_reduce", b.nbytes, self.world_size),
                    t_start=entry["t_launch"] + shift,
                    t_end=entry["t_done"] + shift,
                    t_waited=entry["t_waited"] + shift,
                )
            rec.emit(
                "span",
                name="idle",
                stage=0,
                microbatch=None,
                reason="ddp: waiting for gradient buckets",
                t_start=t_backward_end + shift,
                t_end=t_synced + shift,
            )
        self.last_sync = _summary(
            self._pending, self._t_backward, t_backward_end, t_synced, payload, wire
        )
        self.last_sync["backwards"] = self._backwards
        self._pending = []
        self._synced = True
        self._backwards = 0
        self._used_since_sync = set()
        self._reset_backward()

    def _globally_used(self) -> set[int]:
        """Parameters some rank used since the last synchronization: a small
        all-reduce of a 0/1 mask (PyTorch DDP's "local used map")."""
        mask = torch.tensor(
            [1 if id(p) in self._used_since_sync else 0 for p in self._params],
            dtype=torch.int32,
            device=self._params[0].device,  # nccl reduces device tensors only
        )
        comm.all_reduce(mask, group=self.process_group, tag="ddp-unused")
        return {id(p) for p, used in zip(self._params, mask.tolist()) if used}

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


def _reachable_params(roots) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``roots`` reaches (what
    PyTorch DDP's ``find_unused_parameters`` searches after every forward)."""
    found: set[int] = set()
    seen: set = set()
    stack = []
    for t in roots:
        if t.grad_fn is None:
            found.add(id(t))
        else:
            stack.append(t.grad_fn)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def _summary(pending, t_bwd_start, t_bwd_end, t_synced, payload, wire) -> dict:
    """Seconds and bytes of one synchronization. ``comm_s`` is the time at least one
    bucket was in flight; ``exposed_s`` the part of it after backward ended (what the
    step waited for); ``overlap`` the hidden share."""
    spans = sorted((e["t_launch"], e["t_done"]) for e in pending)
    busy, cursor = 0.0, float("-inf")
    for start, end in spans:  # length of the union of the intervals
        start = max(start, cursor)
        if end > start:
            busy += end - start
            cursor = end
    exposed = max(0.0, t_synced - t_bwd_end)
    return {
        "buckets": len(pending),
        "payload_bytes": payload,
        "wire_bytes": wire,
        "backward_s": t_bwd_end - t_bwd_start,
        "comm_s": busy,
        "exposed_s": exposed,
        "overlap": max(0.0, 1.0 - exposed / busy) if busy > 0 else 1.0,
    }

"""PyTorch's old single-process ``nn.DataParallel``, done the way it does it, so its
costs can be measured next to :class:`dtlab.ddp.DistributedDataParallel`.

Taught in chapter 02 (data parallelism: why DDP replaced DataParallel).

*One* process drives N devices. Every forward it copies the weights to each device
(replicate), splits the batch (scatter), runs the replicas in Python threads
(parallel apply), concatenates the outputs on the primary device (gather), and the
backward pass sums the replicas' gradients back onto the primary. PyTorch calls it
outdated: the threads share one GIL, weights travel every step, the primary holds the
outputs, the loss and all the gradients, and it cannot leave one machine.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from dtlab import telemetry
from dtlab.checks import positive_int
from dtlab.events import Span
from dtlab.memory import SavedBytes, nbytes

__all__ = ["DataParallel"]


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
        positive_int("n_devices", n_devices)
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
            counter = SavedBytes(list(replicas[i].parameters()))
            try:
                # grad mode is per thread: carry the caller's into the worker
                with torch.set_grad_enabled(grad_enabled), counter:
                    with rec.span(Span.F, stage=i):
                        outputs[i] = replicas[i](*shards[i])
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)
            saved[i] = counter.bytes

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
            "outputs": [_output_bytes(out) for out in outputs],
            "gathered": _output_bytes(gathered),
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
        params = sum(nbytes(p) for p in self.module.parameters())
        grads = sum(nbytes(p) for p in self.module.parameters() if p.requires_grad)
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


def _output_bytes(out) -> int:
    """Bytes of every tensor in a (nested) output."""
    return sum(nbytes(t) for t in tree_leaves(out) if torch.is_tensor(t))


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

"""ZeRO-Offload: where the optimizer's side of ZeRO lives, the device or the host.

Taught in chapter 03 (and chapter 08, memory techniques). Ren et al. 2021,
"ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC), §3-4: the
fp32 master weights, their gradients and the optimizer state (the 2Ψ + KΨ part of
the model state, K = 12 for mixed-precision Adam) move to the host; the weights the
model computes with stay on the device. Each step then crosses the PCIe link twice:

- the reduced gradient slice goes device -> host (:meth:`Placement.master_gradient`);
- the updated master slice comes back host -> device to be all-gathered
  (:meth:`Placement.on_device`), cast to the compute dtype on the way.

The optimizer steps on the host's CPU (the paper's CPU-Adam), on the same slice, so
the arithmetic is unchanged: an offloaded run's losses equal the plain run's.

Off is an object that does nothing: ``Placement(device, offload=False)`` keeps
everything on the device and copies only where a dtype changes.
"""

from __future__ import annotations

import torch

__all__ = ["Placement"]


class Placement:
    """Where ZeRO keeps a unit's fp32 master slice, its gradient and (because the
    optimizer allocates its state next to the tensors it steps) the optimizer state:
    on ``device``, or on the host with ``offload=True``."""

    def __init__(self, device: torch.device, offload: bool = False):
        self.device = torch.device(device)  # where the model computes
        self.offload = bool(offload)
        self.master_device = torch.device("cpu") if self.offload else self.device

    def category(self, name: str) -> str:
        """A :mod:`dtlab.memory` category, ``host_``-prefixed for what offload
        keeps on the host (``"grads"`` -> ``"host_grads"``)."""
        return f"host_{name}" if self.offload else name

    def master_copy(self, flat_slice: torch.Tensor) -> torch.Tensor:
        """A master slice of its own, on the master device (host under offload)."""
        return flat_slice.to(self.master_device, copy=True)

    def master_gradient(
        self, reduced: torch.Tensor, master: torch.Tensor
    ) -> torch.Tensor:
        """The reduced gradient slice as the master's gradient: in the master's dtype
        and on its device (device -> host under offload: a copy even on a CPU run,
        so the bytes really move). Without offload and with equal dtypes, the slice
        itself, no copy."""
        copy = self.offload or reduced.dtype != master.dtype
        return reduced.to(master.device, master.dtype, copy=copy)

    def on_device(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy of ``master`` in ``dtype`` on the compute device (host -> device
        under offload), to all-gather from: the input of a collective must not alias
        its output buffer, so this is always a copy."""
        return master.to(dtype, copy=True).to(self.device)

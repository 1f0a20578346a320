"""LocalSGD and DiLoCo: replicas that synchronise every H steps, not every step
(chapter 13: fault tolerance, and the low-communication training beside it).

Under DDP every step all-reduces Ψ gradients (``2(N-1)/N · 4Ψ`` bytes sent per rank
in fp32, :func:`dtlab.estimate.ddp_bytes_per_step`). Here each replica takes H
*inner* steps on its own shards with its own optimizer, then the replicas meet:

- **LocalSGD** (Stich 2019, "Local SGD Converges Fast and Communicates Little";
  Lin et al. 2020): the parameters are averaged, ``θ ← 1/N · Σ_r θ_r``;
- **DiLoCo** (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
  Training of Language Models", Algorithm 1): each replica's *pseudo-gradient*
  ``Δ_r = θ_global − θ_r`` (how far its H inner steps moved it) is averaged, and
  an *outer* optimizer, SGD with Nesterov momentum (the paper: lr 0.7, momentum
  0.9), steps the global parameters with ``Δ = 1/N · Σ_r Δ_r`` as their gradient;
  every replica then starts its next H inner steps from them. Inner optimizer
  state (AdamW's moments) stays local and is never sent.

Each meeting is one all-reduce of Ψ values, so the bytes per step are DDP's
divided by H (:func:`local_sgd_bytes_per_step`).

An identity worth knowing: DiLoCo with H = 1, outer lr 1 and no momentum gives
``θ ← θ − 1/N · Σ_r (θ − θ_r') = 1/N · Σ_r θ_r'``, the average of the replicas'
inner steps. With plain SGD inner steps ``θ_r' = θ − η g_r``, so this is
``θ − η · 1/N Σ_r g_r``: DDP with SGD (equal up to floating-point rounding). With
AdamW inner steps it is not: the average of N Adam updates (each normalised by its
own replica's moments, near ``η · sign(g_r)`` at the first step) is not the Adam
update of the averaged gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtlab import comm
from dtlab.events import wire_bytes

__all__ = ["LocalSGD", "DiLoCo", "local_sgd_bytes_per_step"]

SYNC_TAG = "local_sgd"


def _check_every(sync_every) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int):
        raise ValueError(f"sync_every must be a positive integer, got {sync_every!r}")
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1 (H inner steps), got {sync_every}")
    return sync_every


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])  # (Ψ,)


def _unflat(flat: torch.Tensor, params) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class LocalSGD:
    """Step ``inner_optimizer`` locally; every ``sync_every`` steps average the
    parameters of ``model`` over ``group`` (one all-reduce, tag ``"local_sgd"``).
    Call :meth:`step` where you would call ``inner_optimizer.step()``."""

    def __init__(self, model, inner_optimizer, sync_every: int, *, group=None):
        self.sync_every = _check_every(sync_every)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner = inner_optimizer
        self.group = group
        # one replica (no process group at all) is a world of one: sync does nothing
        self.n = comm.group_size(group) if dist.is_initialized() else 1
        self.local_steps = 0
        self.syncs = 0

    def step(self) -> bool:
        """One inner step; returns whether the replicas met after it."""
        self.inner.step()
        self.local_steps += 1
        if self.local_steps % self.sync_every:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        flat = _flat(self.params)
        if self.n > 1:
            comm.all_reduce(flat, group=self.group, tag=SYNC_TAG)
        _unflat(flat.div_(self.n), self.params)
        self.syncs += 1


class DiLoCo(LocalSGD):
    """LocalSGD whose meeting is an outer optimizer step on the averaged
    pseudo-gradient (see the module docstring): SGD with ``outer_lr``,
    ``outer_momentum`` and Nesterov (off when the momentum is 0, as torch needs)."""

    def __init__(
        self,
        model,
        inner_optimizer,
        sync_every: int,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        group=None,
    ):
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be positive, got {outer_lr}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        super().__init__(model, inner_optimizer, sync_every, group=group)
        # θ_global: the parameters every replica started its inner steps from
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(
            self.global_params,
            lr=outer_lr,
            momentum=outer_momentum,
            nesterov=outer_momentum > 0,
        )

    def sync(self) -> None:
        # Δ_r = θ_global − θ_r, averaged over the replicas: one all-reduce of Ψ
        delta = _flat(self.global_params) - _flat(self.params)  # (Ψ,)
        if self.n > 1:
            comm.all_reduce(delta, group=self.group, tag=SYNC_TAG)
        delta.div_(self.n)
        offset = 0
        for g in self.global_params:
            g.grad = delta[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        self.outer.step()  # θ_global ← Nesterov-SGD(θ_global, Δ)
        _unflat(_flat(self.global_params), self.params)
        self.syncs += 1


def local_sgd_bytes_per_step(
    n_params: float, n: int, sync_every: int, bytes_per_value: float = 4
) -> float:
    """Bytes each rank sends per inner step under LocalSGD or DiLoCo: one ring
    all-reduce of Ψ values (``2(N-1)/N · Ψ · bytes_per_value``) every
    ``sync_every`` = H steps, i.e. DDP's bytes per step divided by H."""
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if bytes_per_value <= 0:
        raise ValueError(f"bytes_per_value must be positive, got {bytes_per_value}")
    return wire_bytes("all_reduce", n_params * bytes_per_value, n) / _check_every(
        sync_every
    )

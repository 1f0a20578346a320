"""ZeRO stage 1 as an optimizer: ``ShardedOptimizer``, the shape of PyTorch's
``ZeroRedundancyOptimizer``.

Taught in chapter 03. Rajbhandari et al. 2020, §5.1 (P_os): with N_d ranks, each
keeps the optimizer state of 1/N_d of the parameters, ``KΨ/N_d`` bytes instead of
``KΨ``, updates only those, and all-gathers the updated values (Ψ of traffic, on top
of the gradient all-reduce that DDP already does).

The parameters of each group are moved into one flat buffer (every ``p.data``
becomes a view of it, so the model is untouched); rank r owns its slice
``[r·S, (r+1)·S)``. The inner optimizer steps one tensor per parameter piece inside
that slice, each a view of the flat buffer (as in :mod:`dtlab.zero.units`), so

- an element-wise optimizer gives the same numbers on the pieces as on the whole
  parameters, bit for bit;
- a parameter without a gradient (frozen, or unused this step) has ``.grad = None``
  in its pieces too: the inner optimizer skips it, and neither moves it nor advances
  its state;
- one all-gather per group brings the updated slices to every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab import comm
from dtlab.zero.units import padded

__all__ = ["ShardedOptimizer"]

# optimizers whose update of one element depends on other elements of its tensor
# (factored or matrix-wise statistics): a piece of a parameter would change their math
_NOT_ELEMENTWISE = ("LBFGS", "Adafactor", "Muon")


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
            "whole tensor, so it cannot step a piece of one: use an element-wise "
            "optimizer (SGD, Adam, AdamW, RMSprop, ...)"
        )


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 (P_os): ``ShardedOptimizer(params, optimizer_cls,
    process_group=None, **defaults)``, like ``ZeroRedundancyOptimizer``.

    Gradients must already be averaged across ranks when :meth:`step` runs (by DDP,
    as with ``ZeroRedundancyOptimizer``). The optimizer must be element-wise.
    :attr:`state` is the inner optimizer's, keyed by this rank's pieces.

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
        self._flats: list[torch.Tensor] = []  # one flat buffer per group
        self._pieces: list[tuple] = []  # (param, start, stop, piece)
        inner_groups = []
        for gi, group in enumerate(self.param_groups):
            pieces = self._flatten(gi, list(group["params"]))
            self._pieces += pieces
            options = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({**options, "params": [pc for *_, pc in pieces]})
        self.optim = optimizer_cls(inner_groups, **defaults)
        self.state = self.optim.state  # what memory accounting and users look at

    @torch.no_grad()
    def _flatten(self, gi: int, ps: list) -> list[tuple]:
        """Move group ``gi``'s parameters into one flat buffer; return this rank's
        pieces of them."""
        dtypes = {p.dtype for p in ps}
        devices = {p.device for p in ps}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"param group {gi} mixes dtypes {dtypes} or devices {devices}: "
                "put parameters of different dtype/device in separate groups"
            )
        numel = sum(p.numel() for p in ps)
        S = padded(numel, self.world_size) // self.world_size
        flat = torch.zeros(S * self.world_size, dtype=ps[0].dtype, device=ps[0].device)
        lo, hi = self.rank * S, (self.rank + 1) * S
        pieces, off = [], 0
        for p in ps:
            n = p.numel()
            flat[off : off + n].copy_(p.detach().reshape(-1))
            p.data = flat[off : off + n].view_as(p)  # same Parameter object
            a, b = max(lo, off), min(hi, off + n)
            if a < b:  # a view of the flat buffer: the inner optimizer updates it
                piece = nn.Parameter(flat[a:b], requires_grad=p.requires_grad)
                pieces.append((p, a - off, b - off, piece))
            off += n
        self._flats.append(flat)
        return pieces

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.optim.param_groups):
            # schedulers change the outer groups; the inner ones must follow
            inner.update({k: v for k, v in group.items() if k != "params"})
        for p, start, stop, piece in self._pieces:
            # a view of the (already averaged) gradient; None stays None
            piece.grad = None if p.grad is None else p.grad.reshape(-1)[start:stop]
        self.optim.step()
        for *_, piece in self._pieces:
            piece.grad = None  # views of the model's gradients: not ours to keep
        for flat in self._flats:
            S = flat.numel() // self.world_size
            mine = flat[self.rank * S : (self.rank + 1) * S]
            # the input must not alias the output buffer, hence the copy
            comm.all_gather(
                flat, mine.clone(), self.process_group, tag="zero1/ag-params"
            )
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

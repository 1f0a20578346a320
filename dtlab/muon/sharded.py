"""Muon across data-parallel ranks, two ways: ``ShardedMuon(design="naive")`` and
``ShardedMuon(design="owner")``.

Taught in chapter 12 (the frontier), after ZeRO (chapter 03): the optimizer that
does not shard like Adam. ZeRO-1 (Rajbhandari et al. 2020, §5.1) lets rank r step
any flat slice of the parameters because Adam is element-wise. Muon's Newton–Schulz step
(:func:`~dtlab.muon.newton_schulz`) needs the *whole* matrix, so a slice is not
enough. Two answers:

**naive** (Liu et al. 2025, "Muon is Scalable for LLM Training": their
"Distributed Muon"): keep ZeRO-1's slices. Per matrix, rank r

1. reduce-scatters the gradient and keeps slice r of the average (``muon/rs-grads``);
2. updates its slice of the momentum (element-wise: state is 1/N per rank);
3. all-gathers the NS input, whole, onto every rank (``muon/gather``);
4. runs NS on the whole matrix: every rank the same work, N× in all;
5. keeps slice r of the result, steps slice r of the parameter, and all-gathers the
   parameter slices (``muon/ag-params``), as ZeRO-1 does.

**owner** (owner-compute: each matrix orthogonalized by one rank, as Jordan's
Muon in modded-nanogpt and nanochat's DistMuon do, and as the Dion paper, Ahn et
al. 2025, describes): the matrices are dealt to owners balanced by size
(:func:`~dtlab.muon.estimate.assign_owners`); one reduce-scatter over a buffer in
which rank r's segment holds its matrices whole gives every owner the averaged
gradients of *its* matrices; the owner runs momentum and NS on them (state and NS
work 1/N per rank) and steps them; one all-gather of the segments brings every
updated parameter to every rank. No gather of the NS input: ZeRO-1's 2Ψ of
traffic, and NS done once, not N times. The price: segments are padded to the
heaviest owner, and the ranks finish NS unevenly when the loads are uneven.

Both take the rank's *own* gradient in ``p.grad`` (nothing in front averages it:
the reduce-scatter here does, dividing by N first as :mod:`dtlab.zero.reduce`
does) and leave every rank with the same parameters, equal to
:class:`~dtlab.muon.Muon` on one process given the averaged gradient. Bytes and
FLOPs: :mod:`dtlab.muon.estimate`; this rank's NS FLOPs so far:
:attr:`ShardedMuon.flops_done`.
"""

from __future__ import annotations

import torch

from dtlab import comm
from dtlab.checks import one_of
from dtlab.muon.estimate import (
    DESIGNS,
    TAGS,
    ns_flops,
    owner_layout,
    slice_size,
)
from dtlab.muon.optimizer import (
    adjusted_lr,
    apply_update,
    check_matrices,
    momentum_input,
    muon_defaults,
    newton_schulz,
)

__all__ = ["ShardedMuon", "NS_DTYPE"]

NS_DTYPE = torch.bfloat16
"""What NS computes in (as torch.optim.Muon). Casting is element-wise, so the naive
design casts its slice *before* gathering: the same bits, half the bytes of fp32."""


class ShardedMuon(torch.optim.Optimizer):
    """Muon over the ranks of ``process_group``: ``ShardedMuon(params,
    process_group=None, design="owner", **torch.optim.Muon's options)``.

    ``design``: ``"naive"`` or ``"owner"`` (module docstring). Every parameter must
    be a contiguous 2-D matrix, of one dtype, the same on every rank, and have a
    gradient at every step (each is in a collective every rank must join; leave
    frozen matrices out). World sizes that do not divide a matrix are fine: slices
    and segments are padded with zeros, and the padding is counted in the bytes.

    State: ``naive``: each matrix's ``momentum_buffer`` slice (ceil(k/N) elements);
    ``owner``: the whole ``momentum_buffer`` of the matrices this rank owns
    (:attr:`owned`), none of the others."""

    def __init__(
        self, params, process_group=None, design: str = "owner", **options
    ) -> None:
        super().__init__(params, muon_defaults(**options))
        self.design = one_of("design", design, DESIGNS)
        # (parameter, its group) in one fixed order: the order of every collective
        self._entries = [(p, g) for g in self.param_groups for p in g["params"]]
        ps = [p for p, _ in self._entries]
        check_matrices(ps)
        if len({(p.dtype, p.device) for p in ps}) > 1 or not all(
            p.is_contiguous() for p in ps
        ):
            raise ValueError(
                "ShardedMuon packs every matrix into one buffer: give contiguous "
                "parameters of one dtype and device (make a ShardedMuon per dtype)"
            )
        self.process_group = process_group
        self.world_size = comm.group_size(process_group)
        self.rank = comm.group_rank(process_group)
        self.shapes = [tuple(p.shape) for p in ps]
        self.layout = owner_layout([p.numel() for p in ps], self.world_size)
        mine = [i for i, r in enumerate(self.layout.owners) if r == self.rank]
        self.owned = mine if self.design == "owner" else list(range(len(ps)))
        """Indices (parameter order) of the matrices this rank orthogonalizes: its
        own (``owner``), or every one (``naive``)."""
        self.flops_done = 0
        """NS FLOPs this rank has computed, counted with
        :func:`~dtlab.muon.estimate.ns_flops` for each matrix it orthogonalized."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, (p, _) in enumerate(self._entries):
            if p.grad is None:
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}) has no gradient: every "
                    "matrix must have one at every step on every rank (its "
                    "collectives need all ranks); leave frozen or unused matrices "
                    "out of ShardedMuon"
                )
        if self.design == "naive":
            self._naive_step()
        else:
            self._owner_step()
        return loss

    def _orthogonalize(self, u, group, shape):
        self.flops_done += ns_flops(shape, group["ns_steps"])
        coefficients, eps = group["ns_coefficients"], group["eps"]
        return newton_schulz(u.view(shape), group["ns_steps"], coefficients, eps)

    def _step_matrix(self, param, ortho, group, shape):
        """The decoupled decay and the step, on ``param`` (the whole matrix or one
        slice of it), with the learning rate of the *whole* matrix's shape."""
        lr, wd = group["lr"], group["weight_decay"]
        step_lr = adjusted_lr(lr, shape, group["adjust_lr_fn"])
        apply_update(param, ortho, lr, wd, step_lr)

    def _naive_step(self):
        N, r, pg = self.world_size, self.rank, self.process_group
        for p, group in self._entries:
            k = p.numel()
            s = slice_size(k, N)
            lo, hi = min(r * s, k), min((r + 1) * s, k)  # my slice; may be short
            # 1. the averaged gradient's slice r: (N·s,) in, (s,) out
            flat = p.grad.new_zeros(N * s)
            flat[:k] = p.grad.reshape(-1)
            flat.div_(N)
            g = flat.new_empty(s)
            comm.reduce_scatter(g, flat, group=pg, tag=TAGS["grads"])
            # 2. momentum on the slice: element-wise, so the slice is enough
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g)
            buf = state["momentum_buffer"]
            u = momentum_input(g, buf, group["momentum"], group["nesterov"])
            # 3. ...but NS is not: gather the whole matrix onto every rank
            whole = torch.empty(N * s, dtype=NS_DTYPE, device=p.device)
            comm.all_gather(whole, u.to(NS_DTYPE), group=pg, tag=TAGS["gather"])
            # 4. the same NS on every rank: the work is done N times
            ortho = self._orthogonalize(whole[:k], group, p.shape)  # (m, n)
            # 5. keep slice r, step slice r of the parameter, gather the slices
            mine = p.view(-1)[lo:hi]
            self._step_matrix(mine, ortho.reshape(-1)[lo:hi], group, p.shape)
            out = p.new_zeros(s)
            out[: hi - lo] = mine
            gathered = p.new_empty(N * s)
            comm.all_gather(gathered, out, group=pg, tag=TAGS["params"])
            p.view(-1).copy_(gathered[:k])

    def _owner_step(self):
        N, pg = self.world_size, self.process_group
        L, owners, offsets = (
            self.layout.segment,
            self.layout.owners,
            self.layout.offsets,
        )
        ps = [p for p, _ in self._entries]
        # 1. one reduce-scatter: segment r (L,) comes back holding, whole and
        #    averaged, the gradients of the matrices rank r owns
        flat = ps[0].new_zeros(N * L)
        for p, o, off in zip(ps, owners, offsets):
            flat[o * L + off : o * L + off + p.numel()] = p.grad.reshape(-1)
        flat.div_(N)
        segment = flat.new_empty(L)
        comm.reduce_scatter(segment, flat, group=pg, tag=TAGS["grads"])
        # 2. the owner steps its matrices whole: momentum, NS (once in the whole
        #    cluster), decay and step; the others leave them alone
        out = flat.new_zeros(L)
        for i in self.owned:
            p, group = self._entries[i]
            k, off = p.numel(), offsets[i]
            g = segment[off : off + k].view(p.shape)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            u = momentum_input(g, buf, group["momentum"], group["nesterov"])
            ortho = self._orthogonalize(u, group, p.shape)
            self._step_matrix(p, ortho, group, p.shape)
            out[off : off + k] = p.reshape(-1)
        # 3. one all-gather of the segments: every rank gets every updated matrix
        gathered = flat.new_empty(N * L)
        comm.all_gather(gathered, out, group=pg, tag=TAGS["params"])
        for p, o, off in zip(ps, owners, offsets):
            p.view(-1).copy_(gathered[o * L + off : o * L + off + p.numel()])

"""Mixed precision: low-precision compute, fp32 master weights, dynamic loss scaling.

Taught in chapter 06.

Three policies (Micikevicius et al. 2018, "Mixed Precision Training"):

- ``fp32``: everything in fp32. The policy exists so that code never branches on
  precision: its scaler never scales and its master weights *are* the model's.
- ``bf16``: weights, activations and gradients in bfloat16 for compute and
  communication; an fp32 *master copy* of the weights takes the optimizer step. bf16
  has fp32's 8 exponent bits, so gradients rarely underflow: no loss scaling.
- ``fp16``: the same with float16, whose 5 exponent bits cannot hold small gradients
  (anything below 2^-24 ≈ 6e-8 flushes to zero; below 2^-14 ≈ 6e-5 loses precision).
  The loss is multiplied by a scale S before backward, so every gradient is S times
  larger while in fp16, and divided by S again in fp32 before the step. S is *dynamic*:
  a step whose gradients overflowed (inf/nan) is skipped and S is halved
  (``backoff_factor``); after ``growth_interval`` clean steps S doubles
  (``growth_factor``).

**The loss in fp32.** Backward starts from the gradient of ``S·L`` with respect to
the loss, S itself, in the loss's dtype, and fp16's largest number is 65504: the
default S = 2^16 is inf in fp16 before any gradient is computed. So the loss is
computed in fp32 from the 16-bit logits, as ``torch.autocast`` does
(``cross_entropy`` is on its fp32 list) and Megatron does (unless
``--fp16-lm-cross-entropy``): :meth:`dtlab.model.GPT.output`, the pipeline stages'
loss and the vocab-parallel cross-entropy upcast the logits, and only the logits'
gradient ``S·(softmax − onehot)/N`` returns to 16 bits. (While dtlab computed the
loss in 16 bits, every fp16 run skipped its first step, and its scale could never
stay at 2^16; :mod:`dtlab.frameworks.autocast` shows the schedule step for step
beside ``GradScaler``'s.)

Why master weights: an update ``lr·g`` is often below half an ulp of the weight in 16
bits (bf16 keeps 8 significant bits), so adding it in 16 bits does nothing. Summing
updates into an fp32 copy keeps them. With Adam that copy and the two moments are the
ZeRO paper's K = 12 bytes per parameter, on top of 2 + 2 for the 16-bit weights and
gradients (:func:`bytes_per_param`).

**Overflow is a collective decision.** Under data parallelism every rank has the same
gradients after the all-reduce, but under ZeRO-2/3, tensor and pipeline parallelism
each rank holds different gradient pieces. If one rank sees an inf and skips while
another steps, the replicas diverge; if they disagree about a collective, they hang.
:meth:`LossScaler.unscale_` therefore reduces the found-inf flag with MAX over every
group that holds part of the model (by default the whole world), so all ranks skip the
same step or none does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dtlab import comm, estimate, telemetry
from dtlab.events import Kind

__all__ = [
    "Policy",
    "POLICIES",
    "policy",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "grad_norm",
    "bytes_per_param",
    "FP16_SMALLEST_NORMAL",
    "FP16_SMALLEST_SUBNORMAL",
    "FP16_MAX",
    "magnitude_histogram",
]

FP16_SMALLEST_NORMAL = 2.0**-14  # 6.1e-5: below this fp16 loses precision
FP16_SMALLEST_SUBNORMAL = 2.0**-24  # 6.0e-8: below this fp16 is zero
FP16_MAX = 65504.0  # above this fp16 is inf


@dataclass(frozen=True)
class Policy:
    """What dtype each thing is held in.

    ``compute_dtype``: weights, activations and gradients the model sees and the
    collectives carry. ``master_dtype``: the copy the optimizer steps. ``loss_scaling``:
    whether a dynamic loss scaler is needed (fp16 only).
    """

    name: str
    compute_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32
    loss_scaling: bool = False

    @property
    def has_master_copy(self) -> bool:
        return self.compute_dtype != self.master_dtype

    def scaler(self, **kwargs) -> LossScaler:
        """A loss scaler for this policy: dynamic under fp16, an overflow check
        under bf16 (skip, never apply, an inf step), nothing at all under fp32."""
        kwargs.setdefault("check_overflow", self.has_master_copy)
        return LossScaler(enabled=self.loss_scaling, **kwargs)


POLICIES = {
    "fp32": Policy("fp32", torch.float32),
    "bf16": Policy("bf16", torch.bfloat16),
    "fp16": Policy("fp16", torch.float16, loss_scaling=True),
}


def policy(name: str | Policy) -> Policy:
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown precision {name!r}: choose one of {sorted(POLICIES)}"
        ) from None


def bytes_per_param(name: str | Policy, optimizer: str = "adam"):
    """Bytes per parameter of model state under a policy (2 + 2 + K = 16 for
    mixed-precision Adam, 4 + 4 + 8 = 16 for fp32 Adam): see
    :func:`dtlab.estimate.bytes_per_param`."""
    return estimate.bytes_per_param(policy(name).name, optimizer)


class LossScaler:
    """Dynamic loss scaling (the rule of Micikevicius et al. 2018, §3.2, as in
    ``torch.amp.GradScaler``).

    Per step: ``scale(loss).backward()``; ``found_inf = unscale_(params)``;
    step the optimizer unless ``found_inf``; ``update(found_inf)``.

    The update rule: an overflow multiplies the scale by ``backoff_factor`` and resets
    the count of clean steps; ``growth_interval`` clean steps in a row multiply it by
    ``growth_factor``. ``enabled=False`` gives a scaler whose scale is 1 and whose
    checks still run (an overflow in bf16 or fp32 is still skipped, never applied).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        enabled: bool = True,
        check_overflow: bool = True,
        min_scale: float = 2.0**-24,
    ):
        if not init_scale > 0 or not math.isfinite(init_scale):
            raise ValueError(
                f"init_scale must be positive and finite, got {init_scale}"
            )
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.enabled = enabled
        self.check_overflow = bool(enabled or check_overflow)
        self.scale_value = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0  # consecutive steps without overflow
        self.skipped = 0  # total skipped steps

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (call ``.backward()`` on this). The
        loss should be fp32 (see the module docstring): an fp16 loss's gradient
        is the scale itself, rounded to fp16."""
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, grads, groups=(None,)) -> bool:
        """Divide ``grads`` (tensors; ``None`` entries ignored) by the scale in place
        and return whether any rank in ``groups`` found an inf or nan.

        ``groups``: the process groups (or topology axes) that together hold the
        model; the flag is MAX-reduced over each in turn. ``(None,)`` is the world;
        ``()`` keeps the decision local (single process).
        """
        if not self.check_overflow:
            return False
        grads = [g for g in grads if g is not None]
        inv = 1.0 / self.scale_value
        local_inf = False
        for g in grads:
            if self.enabled:
                g.mul_(inv)
            if not torch.isfinite(g).all():
                local_inf = True
        device = grads[0].device if grads else None  # nccl needs a device tensor
        flag = torch.tensor([1.0 if local_inf else 0.0], device=device)
        for group in groups:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group, tag="found_inf")
        return bool(flag.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Apply the dynamic rule after a step (skipped or not)."""
        if not self.check_overflow:
            return
        rec = telemetry.current()
        if found_inf:
            self.skipped += 1
            self.clean_steps = 0
            if self.enabled:
                self.scale_value = max(
                    self.scale_value * self.backoff_factor, self.min_scale
                )
        else:
            self.clean_steps += 1
            if self.enabled and self.clean_steps % self.growth_interval == 0:
                self.scale_value *= self.growth_factor
        rec.emit(Kind.AMP, scale=self.scale_value, skipped=bool(found_inf))

    def state_dict(self) -> dict:
        return {
            "scale": self.scale_value,
            "clean_steps": self.clean_steps,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])


def grad_norm(parameters) -> float:
    """Global L2 norm of all gradients, ``sqrt(sum_i ||g_i||^2)``, as a float:
    per-tensor norms first, then the norm of norms, the order
    ``torch.nn.utils.clip_grad_norm_`` uses (so the two agree bit for bit)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


class MixedPrecisionOptimizer:
    """fp32 master weights behind a low-precision model, with loss scaling.

    ``MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, "fp16", lr=...)``
    after ``model.to(policy.compute_dtype)``. Per step::

        opt.backward(loss)        # scaled backward
        stepped = opt.step()      # False: an overflow somewhere, step skipped
        opt.zero_grad()

    ``step`` copies the 16-bit gradients into fp32 master gradients, unscales them,
    agrees on overflow over ``groups``, optionally clips the global norm, steps the
    inner optimizer on the masters, and copies the masters back into the model in
    16 bits. Under the fp32 policy the masters are the parameters themselves.

    ``norm_fn(grads) -> float`` measures the global gradient norm when the model is
    spread over ranks (a collective; :mod:`dtlab.parallelize` passes one that counts
    every element once); clipping then uses it. Without one, the norm is
    :func:`grad_norm`'s (and ``clip_grad_norm_``'s when clipping), what a replica
    holding every gradient measures. :attr:`last_grad_norm` is the norm of the last
    step (``inf`` if it was skipped).
    """

    def __init__(
        self,
        params,
        optimizer_cls=torch.optim.AdamW,
        precision: str | Policy = "fp32",
        *,
        scaler: LossScaler | None = None,
        groups=None,
        grad_clip: float | None = None,
        norm_fn=None,
        **defaults,
    ):
        self.policy = policy(precision)
        self.params = [p for p in params if p.requires_grad]
        for p in self.params:
            if p.dtype != self.policy.compute_dtype:
                raise ValueError(
                    f"a parameter is {p.dtype}, but the {self.policy.name} policy "
                    f"computes in {self.policy.compute_dtype}: call "
                    f"model.to({self.policy.compute_dtype}) first"
                )
        if self.policy.has_master_copy:
            self.masters = [
                p.detach().to(self.policy.master_dtype).clone().requires_grad_(True)
                for p in self.params
            ]
        else:
            self.masters = self.params
        self.optimizer = optimizer_cls(self.masters, **defaults)
        self.scaler = scaler if scaler is not None else self.policy.scaler()
        if groups is None:  # the whole world if there is one, else this process
            groups = (None,) if torch.distributed.is_initialized() else ()
        self.groups = tuple(groups)
        self.grad_clip = grad_clip
        # the global norm of the masters' gradients when they are spread over ranks
        # (tensor/pipeline shards, ZeRO slices): norm_fn(grads) -> float, collective
        self.norm_fn = norm_fn
        self.last_grad_norm = math.nan

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    @torch.no_grad()
    def step(self) -> bool:
        if self.policy.has_master_copy:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.to(m.dtype)
        found_inf = self.scaler.unscale_([m.grad for m in self.masters], self.groups)
        self.last_grad_norm = math.inf
        if not found_inf:
            if self.norm_fn is not None:
                norm = self.norm_fn([m.grad for m in self.masters])
                if self.grad_clip is not None:  # clip_grad_norm_'s rule, on shards
                    coef = min(1.0, self.grad_clip / (norm + 1e-6))
                    for m in self.masters:
                        if m.grad is not None:
                            m.grad.mul_(coef)
                self.last_grad_norm = norm
            elif self.grad_clip is not None:
                self.last_grad_norm = float(
                    torch.nn.utils.clip_grad_norm_(self.masters, self.grad_clip)
                )
            else:
                self.last_grad_norm = grad_norm(self.masters)
            self.optimizer.step()
            if self.policy.has_master_copy:
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)  # rounds the fp32 master to the compute dtype
        self.scaler.update(found_inf)
        return not found_inf

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [m.detach().clone() for m in self.masters],
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)
            if self.policy.has_master_copy:
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        self.scaler.load_state_dict(state["scaler"])


def magnitude_histogram(tensors, *, low: int = -40, high: int = 16) -> dict:
    """Counts of |x| per power of two, from 2^low to 2^high, over all ``tensors``,
    plus the zeros and the non-finite: the picture of what fp16 can and cannot hold
    (chapter 06 draws it against :data:`FP16_SMALLEST_SUBNORMAL` and
    :data:`FP16_SMALLEST_NORMAL`)."""
    values = torch.cat(
        [t.detach().float().reshape(-1) for t in tensors if t is not None]
    )
    finite = values[torch.isfinite(values)]
    nonzero = finite[finite != 0].abs()
    exps = torch.floor(torch.log2(nonzero)).clamp(low, high).to(torch.int64)
    counts = torch.bincount(exps - low, minlength=high - low + 1)
    return {
        "exponents": list(range(low, high + 1)),
        "counts": counts.tolist(),
        "zeros": int((finite == 0).sum()),
        "nonfinite": int(values.numel() - finite.numel()),
    }

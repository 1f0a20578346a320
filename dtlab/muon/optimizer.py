"""Muon on one process: Newton–Schulz orthogonalization, the optimizer, and which
parameters it takes.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks";
Liu et al. 2025, "Muon is Scalable for LLM Training") steps each 2-D weight W
with the *orthogonalized* momentum of its gradient::

    B  <- μ·B + (1-μ)·G                      momentum (an EMA: torch's ``lerp``)
    U  <- (1-μ)·G + μ·B  if nesterov else B  the matrix to orthogonalize
    O  <- NS_k(U) ≈ U·(UᵀU)^(-1/2)           k Newton–Schulz iterations
    W  <- (1 - η·λ)·W - η·s(W)·O             decoupled weight decay, then the step

``s(W)`` rescales the step by the matrix's shape (:func:`adjusted_lr`). Everything up
to U and the last line are element-wise, like Adam; NS is not: every element of O
depends on the whole of U. That one line is why Muon does not shard like Adam (see
:mod:`dtlab.muon.sharded`).

The numbers here are PyTorch's ``torch.optim.Muon`` (torch 2.13) bit for bit: the
same coefficients, the iteration in bfloat16, the same order of operations; the tests
prove it with ``torch.equal``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

__all__ = [
    "NS_COEFFICIENTS",
    "NS_STEPS",
    "NS_EPS",
    "newton_schulz",
    "adjusted_lr",
    "momentum_input",
    "apply_update",
    "check_matrices",
    "check_hyperparameters",
    "muon_defaults",
    "Muon",
    "ParamSplit",
    "split_params",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic ``X <- aX + b(XXᵀ)X + c(XXᵀ)²X``: chosen (Jordan 2024)
to make the slope at zero as steep as possible, so small singular values grow fast;
the price is that the singular values end near 1 (roughly 0.7-1.2), not at 1."""
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz(
    G: torch.Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The orthogonalized ``G``: ``U·S'·Vᵀ`` where ``G = U·S·Vᵀ`` and ``S'`` ≈ I.

    ``G`` (m, n) is cast to ``dtype`` (bfloat16, as PyTorch does: the iteration
    tolerates it) and divided by its Frobenius norm, which bounds the spectral norm
    by 1 so the iteration converges. A tall matrix is transposed first so that the
    Gram matrix ``XXᵀ`` is the smaller side, (m, m) with m = min(m, n). Each of the
    ``steps`` iterations (``a, b, c = coefficients``)::

        A = X Xᵀ                 2·m²·n FLOPs
        B = b·A + c·A A          2·m³
        X = a·X + B X            2·m²·n

    so :func:`dtlab.muon.estimate.ns_flops` is ``steps·(4m²n + 2m³)``. The result has
    ``dtype`` and G's shape.
    """
    if G.dim() != 2:
        raise ValueError(
            f"newton_schulz orthogonalizes a 2-D matrix, got shape {tuple(G.shape)}: "
            "give Muon only matrices (biases, norms and embeddings go to AdamW, "
            "see dtlab.muon.split_params)"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"steps must be an integer in 0..99, got {steps!r}")
    if len(coefficients) != 3:
        raise ValueError(
            f"coefficients must be three numbers (a, b, c), got {coefficients!r}"
        )
    a, b, c = coefficients
    tall = G.size(0) > G.size(1)
    X = G.to(dtype)
    X = X.T if tall else X  # (m, n), m <= n
    X = X / X.norm().clamp(min=eps)  # ||X||_2 <= ||X||_F = 1
    for _ in range(steps):
        A = X @ X.T  # (m, m)
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b·A + c·A² (one fused op)
        X = torch.addmm(X, B, X, beta=a)  # a·X + B·X
    return X.T if tall else X


def adjusted_lr(lr: float, shape, adjust_lr_fn: str | None = None) -> float:
    """The learning rate a matrix of ``shape`` (A, B) steps with.

    - ``None`` / ``"original"`` (Jordan): ``lr·sqrt(max(1, A/B))``, so a tall
      matrix's update, whose entries are small, has the RMS of a square one;
    - ``"match_rms_adamw"`` (Liu et al. 2025): ``0.2·lr·sqrt(max(A, B))``, an
      update RMS of about 0.2, AdamW's, so AdamW's lr and weight decay carry over.

    A sharded step must use the *whole* matrix's shape, not its slice's.
    """
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(A, B))
    raise ValueError(
        "adjust_lr_fn must be None, 'original' or 'match_rms_adamw', "
        f"got {adjust_lr_fn!r}"
    )


def momentum_input(grad, buf, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the momentum ``buf`` in place from ``grad``; return what NS is given.

    Element-wise, so a slice of ``grad`` and the same slice of ``buf`` give the same
    slice of the result: a sharded optimizer may run this on its shard."""
    buf.lerp_(grad, 1 - momentum)  # B = μB + (1-μ)G
    return grad.lerp(buf, momentum) if nesterov else buf  # (1-μ)G + μB


def apply_update(param, update, lr, weight_decay, step_lr) -> None:
    """``param <- (1 - lr·wd)·param - step_lr·update`` in place (element-wise: a slice
    of param with the same slice of update gives the same numbers)."""
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-step_lr)


def check_matrices(params) -> None:
    """Refuse a parameter that is not a matrix, naming it and where it goes."""
    for i, p in enumerate(params):
        if p.dim() != 2:
            raise ValueError(
                f"Muon steps 2-D matrices only; parameter {i} has shape "
                f"{tuple(p.shape)}: give it to AdamW (dtlab.muon.split_params "
                "sorts a model's parameters)"
            )


class Muon(torch.optim.Optimizer):
    """Muon on one process, ``torch.optim.Muon``'s signature and numbers.

    Every parameter must be 2-D (split a model with :func:`split_params`). A
    parameter without a gradient is skipped: neither decayed nor stepped, its
    momentum untouched. State per parameter: ``momentum_buffer``, its shape."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        defaults = muon_defaults(
            lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
            adjust_lr_fn,
        )  # fmt: skip
        super().__init__(params, defaults)
        check_matrices([p for g in self.param_groups for p in g["params"]])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                u = momentum_input(p.grad, buf, group["momentum"], group["nesterov"])
                ortho = newton_schulz(
                    u, group["ns_steps"], group["ns_coefficients"], group["eps"]
                )
                step_lr = adjusted_lr(group["lr"], p.shape, group["adjust_lr_fn"])
                apply_update(p, ortho, group["lr"], group["weight_decay"], step_lr)
        return loss


def muon_defaults(
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
    ns_steps: int = NS_STEPS,
    adjust_lr_fn: str | None = None,
) -> dict:
    """``torch.optim.Muon``'s options, checked, as an optimizer's ``defaults``: the
    one place :class:`Muon` and :class:`dtlab.muon.ShardedMuon` spell them."""
    check_hyperparameters(lr, momentum, weight_decay, adjust_lr_fn)
    return dict(
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )


def check_hyperparameters(lr, momentum, weight_decay, adjust_lr_fn) -> None:
    """Refuse what ``torch.optim.Muon`` refuses, naming the value."""
    for name, value in (("lr", lr), ("momentum", momentum)):
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    adjusted_lr(1.0, (1, 1), adjust_lr_fn)  # raises on an unknown rule


class ParamSplit(NamedTuple):
    """A model's trainable parameters by optimizer: ``{name: parameter}`` each."""

    muon: dict[str, nn.Parameter]
    adamw: dict[str, nn.Parameter]


HEAD_NAMES = ("head", "lm_head", "output")
"""Top-level modules taken for the output head (a vocabulary-sized classifier)."""


def split_params(model: nn.Module, head_names=HEAD_NAMES) -> ParamSplit:
    """Which trainable parameters Muon steps and which AdamW steps, as in practice
    (Jordan 2024; Liu et al. 2025):

    - Muon: the 2-D weights of hidden layers (attention and MLP projections);
    - AdamW: everything else: biases and norm gains (1-D: no matrix to
      orthogonalize), embeddings (a lookup table: a step touches only the rows of
      the tokens seen, and orthogonalizing would spread it over every row), the
      output head (a module named in ``head_names``, e.g. ``head``), and tensors of
      more than two dimensions.

    A tied head shares the embedding's tensor, listed once, under AdamW. Frozen
    parameters are in neither. Names follow ``model.named_parameters()``.
    """
    embedding_weights = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
    }
    muon, adamw = {}, {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        owner = name.rpartition(".")[0]
        hidden_matrix = (
            p.dim() == 2 and id(p) not in embedding_weights and owner not in head_names
        )
        (muon if hidden_matrix else adamw)[name] = p
    return ParamSplit(muon, adamw)

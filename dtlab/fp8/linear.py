"""A Linear layer whose three matmuls run in FP8, and the swap that installs it.

Taught in chapter 12 (the frontier), its FP8 section. The recipe is the one of
Micikevicius et al. 2022 (*FP8 Formats for Deep Learning*, §4) that Transformer
Engine and torchao implement: for ``y = x W^T`` (x: ``(M, K)``, W: ``(N, K)``)

======================  ==============================  ===================
matmul                  operands                        formats
======================  ==============================  ===================
forward                 ``y = x W^T``                   e4m3 · e4m3
backward, input grad    ``grad_x = grad_y W``           e5m2 · e4m3
backward, weight grad   ``grad_W = grad_y^T x``         e5m2 · e4m3
======================  ==============================  ===================

Each operand is cast with its own per-tensor scale (:mod:`dtlab.fp8.scaling`); each
matmul accumulates in fp32 and multiplies the result by ``1 / (scale_a · scale_b)``
(:func:`fp8_matmul`). What stays in higher precision: the weight itself (the
optimizer steps it in fp32), the bias (added after the matmul), the output and both
gradients (in the dtypes of x and W), and every op that is not a Linear.

**The transposes.** A GPU's FP8 GEMM (cuBLASLt, behind ``torch._scaled_mm``) wants
its first operand row-major and its second column-major. Forward hands it ``x`` and
``W^T`` as they lie; backward needs ``W`` and ``x^T`` the other way round, so the
FP8 copies are transposed into fresh memory (Transformer Engine caches both
layouts of each FP8 tensor for this reason). On CPU, ``torch._scaled_mm`` (torch
2.13) accepts every layout and every e4m3/e5m2 pairing, but a CPU has no FP8 units
and its speed depends on which CPU: a 256×64 by 64×256 product took 126 ms on a
Sapphire Rapids Xeon (one thread) where the emulation, the same FP8 values upcast to
fp32, took 0.4 ms. So :func:`fp8_matmul`'s ``"auto"`` calls ``torch._scaled_mm`` on a
GPU and emulates on CPU; ``impl="scaled_mm"`` asks for torch's CPU kernel anyway
(tests/test_fp8.py holds the two to each other).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dtlab.checks import one_of
from dtlab.fp8.formats import FP8_DTYPES
from dtlab.fp8.scaling import recipe as _recipe

__all__ = [
    "fp8_matmul",
    "scaled_mm_error",
    "Float8Linear",
    "convert_to_float8",
]

IMPLS = ("auto", "scaled_mm", "emulate")


@functools.cache
def scaled_mm_error(device_type: str, a_dtype, b_dtype, out_dtype=torch.float32):
    """``None`` if ``torch._scaled_mm`` multiplies ``a_dtype`` by ``b_dtype`` on
    this device type, else torch's own error message (tried once, on 16 x 16)."""
    device = torch.device(device_type)
    a = torch.ones(16, 16, device=device).to(a_dtype)
    b = torch.ones(16, 16, device=device).to(b_dtype)
    one = torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=out_dtype)
    except Exception as e:  # noqa: BLE001 - whatever torch raises is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def _scaled_mm_runs(a, b, out_dtype) -> bool:
    """Whether ``"auto"`` takes ``torch._scaled_mm``: on a GPU where it runs (the
    FP8 tensor cores), never on CPU (no FP8 units: the module docstring's figures)."""
    if a.device.type == "cpu":
        return False
    if scaled_mm_error(a.device.type, a.dtype, b.dtype, out_dtype) is not None:
        return False
    # cuBLASLt's FP8 GEMM needs every dimension a multiple of 16
    return a.device.type != "cuda" or all(d % 16 == 0 for d in (*a.shape, b.shape[0]))


def fp8_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype=torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)^T`` from FP8 ``a`` ``(M, K)`` and ``b``
    ``(N, K)``, accumulated in fp32, in ``out_dtype``.

    ``impl``: ``"scaled_mm"`` calls ``torch._scaled_mm`` (its scales are the
    *inverse* ones, ``1/scale``, and ``b^T`` of a row-major ``b`` is the
    column-major second operand it wants); ``"emulate"`` upcasts the same FP8 values
    to fp32, multiplies, and scales the fp32 result by ``1/(a_scale · b_scale)``,
    as the GEMM's epilogue does; ``"auto"``: the first on a GPU where it runs,
    else the second (on CPU always: the module docstring says why). Both read
    the same FP8 values; they differ only in fp32 rounding (the order of the sums,
    and whether the scales are applied before or after them).
    """
    impl = one_of("FP8 matmul impl", impl, IMPLS)
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_DTYPES.values():
            raise ValueError(f"fp8_matmul: {name} must be FP8, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"fp8_matmul: {name} must be 2-D, got {tuple(t.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"fp8_matmul: a is {tuple(a.shape)} and b is {tuple(b.shape)}; both "
            "must have K columns (b is (N, K): the product is a @ b^T)"
        )
    a, b = a.contiguous(), b.contiguous()  # row-major each; b.t() is column-major
    inv_a, inv_b = (  # _scaled_mm's scales multiply: the inverse of ours
        1.0 / torch.as_tensor(s, dtype=torch.float32, device=a.device)
        for s in (a_scale, b_scale)
    )
    if impl == "scaled_mm" or (impl == "auto" and _scaled_mm_runs(a, b, out_dtype)):
        return torch._scaled_mm(
            a, b.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype
        )
    acc = a.float() @ b.float().t()  # (M, N): exact products, fp32 sums
    return (acc * (inv_a * inv_b)).to(out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """``y = x W^T`` with the three matmuls of the module docstring's table."""

    @staticmethod
    def forward(ctx, x, weight, layer):  # x: (M, K), weight: (N, K)
        x8, sx = layer.x_scaling.quantize(x)
        w8, sw = layer.weight_scaling.quantize(weight)
        y = fp8_matmul(x8, sx, w8, sw, impl=layer.impl)  # (M, N) fp32
        # backward needs x and W only in FP8: the saved activation is 1 byte/element
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.layer, ctx.dtypes = layer, (x.dtype, weight.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # grad_y: (M, N)
        x8, sx, w8, sw = ctx.saved_tensors
        layer = ctx.layer
        g8, sg = layer.grad_scaling.quantize(grad_y)  # e5m2: gradients need range
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): b = W^T, a fresh transpose
            grad_x = fp8_matmul(g8, sg, w8.t().contiguous(), sw, impl=layer.impl)
            grad_x = grad_x.to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K): a = grad_y^T, b = x^T
            g8t, x8t = g8.t().contiguous(), x8.t().contiguous()
            grad_w = fp8_matmul(g8t, sg, x8t, sx, impl=layer.impl).to(ctx.dtypes[1])
        return grad_x, grad_w, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run in FP8 (e4m3 forward, e5m2 gradients).

    A drop-in: same constructor, parameters and state dict as ``nn.Linear``, plus
    ``recipe`` (a :class:`dtlab.fp8.Recipe` or its name; delayed scaling by
    default) and ``impl`` (see :func:`fp8_matmul`). Each layer owns the scaling state
    of its three casts: ``x_scaling``, ``weight_scaling``, ``grad_scaling`` (under
    delayed scaling, their amax histories roll once per forward / backward).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        recipe=None,
        impl: str = "auto",
    ):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.recipe = _recipe(recipe)
        self.impl = one_of("FP8 matmul impl", impl, IMPLS)
        self.x_scaling = self.recipe.scaler("x")
        self.weight_scaling = self.recipe.scaler("weight")
        self.grad_scaling = self.recipe.scaler("grad_out")

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe=None, *, impl="auto"):
        """A Float8Linear that holds ``linear``'s own weight and bias Parameters
        (not copies: an optimizer built before the swap still steps them, and a
        tied weight stays tied)."""
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"from_linear expects an nn.Linear, got {type(linear)}")
        _check_weight(linear.weight)
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",  # no memory: the real Parameters are put in below
            recipe=recipe,
            impl=impl,
        )
        new.weight, new.bias = linear.weight, linear.bias
        return new.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_weight(self.weight)
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"Float8Linear: input has {x.shape[-1]} features in its last "
                f"dimension, the layer expects in_features={self.in_features}"
            )
        lead = x.shape[:-1]
        y = _Float8Matmul.apply(x.reshape(-1, self.in_features), self.weight, self)
        if self.bias is not None:  # in fp32, after the FP8 matmul
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, impl={self.impl}"


def _check_weight(weight) -> None:
    if weight.dim() != 2:
        raise ValueError(
            f"an FP8 Linear needs a 2-D weight (out_features, in_features), got "
            f"shape {tuple(weight.shape)}"
        )


def convert_to_float8(module: nn.Module, recipe=None, *, skip=None, impl="auto"):
    """Swap every ``nn.Linear`` inside ``module`` for a :class:`Float8Linear` that
    holds the same Parameters; return the module (a bare ``nn.Linear`` comes back
    converted, not changed in place).

    ``skip``: the qualified names of Linears to leave alone (every name must exist),
    or a function ``(name, module) -> bool``. ``None`` skips ``"head"``, the LM head,
    as torchao's and accelerate's examples leave the output layer out: its output
    goes straight into softmax cross-entropy, where an error of 2^-4 in a logit is
    an error of about 6 % in a probability, and in dtlab's GPT its weight is the
    token embedding (tied), so FP8 there would touch the input side too.
    """
    every = module.named_modules(remove_duplicate=False)  # a shared Linear: each name
    linears = {n for n, m in every if isinstance(m, nn.Linear)}
    if callable(skip):
        skipped = {n for n in linears if skip(n, module.get_submodule(n))}
    else:
        names = {"head"} if skip is None else set(skip)
        unknown = names - linears
        if skip is not None and unknown:
            raise ValueError(
                f"skip names {sorted(unknown)}, which are not Linear modules of "
                f"this model; its Linears are {sorted(linears)}"
            )
        skipped = names & linears

    swapped: dict[int, nn.Module] = {}  # a Linear used twice becomes one layer

    def swap(m: nn.Linear) -> nn.Module:
        if isinstance(m, Float8Linear):
            return m
        if id(m) not in swapped:
            swapped[id(m)] = Float8Linear.from_linear(m, recipe, impl=impl)
        return swapped[id(m)]

    if isinstance(module, nn.Linear):
        return module if "" in skipped else swap(module)
    for parent_name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and name not in skipped:
                setattr(parent, child_name, swap(child))
    return module

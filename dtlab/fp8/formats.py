"""The two FP8 formats, their ranges read from torch, and the scaled cast into them.

Taught in chapter 12 (the frontier), its FP8 section. The formats are those of
Micikevicius et al. 2022, *FP8 Formats for Deep Learning* (arXiv:2209.05433), §3:

- **e4m3** (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits. The "fn"
  variant has no infinities and a single NaN pattern, so its top exponent holds
  ordinary numbers: its largest value is 448 (240 with IEEE's conventions). More
  precision, less range: weights and activations.
- **e5m2** (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits, IEEE-like (it
  keeps inf). fp16's exponent with 2 of its 10 mantissa bits: normal values from
  2^-14 to 57344. Gradients, whose magnitudes spread over many binades.

Every figure here is derived from ``torch.finfo`` (:func:`format_table`), never typed
in: ``eps`` is the gap after 1.0, ``2^-m`` for ``m`` mantissa bits, and the smallest
subnormal is ``smallest_normal · eps``.

**The scaled cast.** Neither format reaches far: e4m3 spans 2^-9 to 448, so a
tensor is multiplied by a per-tensor *scale* before the cast and divided by it after
(:func:`quantize`, :func:`dequantize`). The scale that puts the tensor's largest
magnitude (its *amax*) at the top of the format is ``max / amax``
(:func:`scale_from_amax`); a margin of ``m`` leaves ``2^m`` of headroom. Values that
still land beyond ``±max`` *saturate* to ``±max``: the cast clamps first, because a
plain ``.to(torch.float8_e5m2)`` rounds an overflow to inf, and inf times zero in a
matmul is NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "Format",
    "FORMATS",
    "FP8_DTYPES",
    "fp8_format",
    "format_table",
    "amax",
    "scale_from_amax",
    "quantize",
    "dequantize",
    "saturated_fraction",
]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The format names dtlab uses, and torch's dtype for each."""

_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class Format:
    """One FP8 format: its torch dtype and its range, as :func:`fp8_format` derives
    them from ``torch.finfo``."""

    name: str
    dtype: torch.dtype
    max: float
    smallest_normal: float
    smallest_subnormal: float
    mantissa_bits: int
    exponent_bits: int

    @property
    def unit_roundoff(self) -> float:
        """``2^-(m+1)``: the largest relative error of rounding a normal value to
        nearest (half the gap between neighbours, relative to the smaller one)."""
        return 2.0 ** -(self.mantissa_bits + 1)


def _derive(name: str, dtype: torch.dtype) -> Format:
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))  # eps = 2^-m, the gap after 1.0
    return Format(
        name=name,
        dtype=dtype,
        max=float(info.max),
        smallest_normal=float(info.smallest_normal),
        # a subnormal keeps the smallest exponent and loses the implicit 1: its
        # step is the normal step at the bottom binade, smallest_normal · 2^-m
        smallest_subnormal=float(info.smallest_normal * info.eps),
        mantissa_bits=mantissa,
        exponent_bits=info.bits - 1 - mantissa,  # sign, exponent, mantissa
    )


FORMATS = {name: _derive(name, dtype) for name, dtype in FP8_DTYPES.items()}
"""``{"e4m3": Format, "e5m2": Format}``."""


def fp8_format(fmt) -> Format:
    """The :class:`Format` for a name (``"e4m3"``, ``"e5m2"``), a torch float8
    dtype, or a :class:`Format` itself."""
    if isinstance(fmt, Format):
        return fmt
    for f in FORMATS.values():
        if fmt == f.dtype or (isinstance(fmt, str) and fmt.lower() == f.name):
            return f
    raise ValueError(
        f"unknown FP8 format {fmt!r}: use 'e4m3' (torch.float8_e4m3fn: weights and "
        "activations) or 'e5m2' (torch.float8_e5m2: gradients)"
    )


def format_table() -> dict[str, dict]:
    """``{name: {dtype, exponent_bits, mantissa_bits, max, smallest_normal,
    smallest_subnormal, unit_roundoff}}`` for e4m3 and e5m2, from ``torch.finfo``."""
    return {
        f.name: {
            "dtype": str(f.dtype).replace("torch.", ""),
            "exponent_bits": f.exponent_bits,
            "mantissa_bits": f.mantissa_bits,
            "max": f.max,
            "smallest_normal": f.smallest_normal,
            "smallest_subnormal": f.smallest_subnormal,
            "unit_roundoff": f.unit_roundoff,
        }
        for f in FORMATS.values()
    }


def amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``x`` as an fp32 scalar tensor (0 for an empty one;
    NaN if ``x`` holds a NaN)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def _check_margin(margin) -> float:
    if isinstance(margin, bool) or not isinstance(margin, int | float):
        raise ValueError(f"margin must be a number >= 0, got {margin!r}")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(
            f"margin must be >= 0 (the headroom 2^margin left above amax), got "
            f"{margin}; a negative margin would push amax past the format's max"
        )
    return float(margin)


def scale_from_amax(
    amax_value, fmt, margin: float = 0, *, fallback=1.0
) -> torch.Tensor:
    """``max / (amax · 2^margin)`` as an fp32 scalar tensor: the scale that maps
    ``amax_value`` to ``2^-margin`` of the format's largest value (Transformer Engine's
    rule). ``amax == 0`` (an all-zero tensor: any scale is exact) gives
    ``fallback``; a non-finite amax is a ``ValueError``, since no scale can bring
    inf or NaN into range."""
    f, margin = fp8_format(fmt), _check_margin(margin)
    a = torch.as_tensor(amax_value, dtype=torch.float32).detach()
    if not bool(torch.isfinite(a).all()):
        raise ValueError(
            f"amax is {a.tolist()}: the tensor holds inf or NaN, which no scale "
            "brings into FP8 range; find the overflow upstream (a 16-bit loss "
            "scale, a diverging step) before casting"
        )
    scale = f.max / (a * 2.0**margin)
    # a tiny amax (e.g. 1e-40) would give scale = inf; cap it at fp32's max
    scale = torch.clamp(scale, max=_FP32_MAX)
    fallback = torch.as_tensor(fallback, dtype=torch.float32, device=a.device)
    return torch.where(a > 0, scale, fallback)


def _check_scale(scale, device) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=device).detach()
    if s.numel() != 1 or not bool(torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError(
            f"scale must be one positive finite number, got {s.tolist()}: derive "
            "it with scale_from_amax"
        )
    return s.reshape(())


def quantize(x: torch.Tensor, fmt, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``q = fp8(clamp(x · scale, -max, max))``, rounded to
    nearest even by torch's cast. ``scale=None`` takes the scale from ``x``'s own
    amax (current scaling, no margin). Dequantize with ``q / scale``."""
    f = fp8_format(fmt)
    if scale is None:
        scale = scale_from_amax(amax(x), f)
    s = _check_scale(scale, x.device)
    # fp32 product, then saturate, then one rounding to FP8
    q = (x.detach().float() * s).clamp(-f.max, f.max).to(f.dtype)
    return q, s


def dequantize(q: torch.Tensor, scale, dtype=torch.float32) -> torch.Tensor:
    """``q / scale`` in ``dtype``: back from FP8 to the tensor's own units."""
    if q.dtype not in FP8_DTYPES.values():
        raise ValueError(f"dequantize expects an FP8 tensor, got {q.dtype}")
    return (q.float() / _check_scale(scale, q.device)).to(dtype)


def saturated_fraction(x: torch.Tensor, fmt, scale) -> float:
    """The share of ``x``'s elements that ``quantize(x, fmt, scale)`` clips to
    ``±max`` (``|x| · scale > max``): what a stale delayed scale costs."""
    if x.numel() == 0:
        return 0.0
    f, s = fp8_format(fmt), _check_scale(scale, x.device)
    return float(((x.detach().float() * s).abs() > f.max).float().mean())

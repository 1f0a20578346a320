"""FP8 training: matmuls in 8 bits, with a scale per tensor.

Taught in chapter 12 (the frontier), its FP8 section. After Micikevicius et al.
2022, *FP8 Formats for Deep Learning* (arXiv:2209.05433), and the recipes of NVIDIA's
Transformer Engine and PyTorch's torchao:

- :mod:`dtlab.fp8.formats`: e4m3 and e5m2, their ranges from ``torch.finfo``, the
  scaled, saturating cast (:func:`quantize`, :func:`dequantize`);
- :mod:`dtlab.fp8.scaling`: where scales come from, :class:`CurrentScaling` (this
  tensor's amax) or :class:`DelayedScaling` (an amax history), bundled in a
  :class:`Recipe`;
- :mod:`dtlab.fp8.linear`: :class:`Float8Linear`, whose forward and two backward
  matmuls run in FP8 through ``torch._scaled_mm`` on a GPU, or on CPU an emulation
  that multiplies the same FP8 values (:func:`fp8_matmul`), and
  :func:`convert_to_float8`, which installs it;
- :mod:`dtlab.fp8.wire`: FP8 weights all-gathered as bytes (:func:`all_gather_fp8`)
  and the per-parameter savings (:func:`fp8_memory`);
- :mod:`dtlab.fp8.curves`: fp32, bf16 and FP8 loss curves of the course's GPT
  (:func:`loss_curves`).

What FP8 changes, in one sentence for the interview: the three matmuls of every
Linear read 1-byte operands (twice bf16's tensor-core rate on H100), the activations
they save are 1 byte, and an FSDP all-gather carries 1 byte per parameter; what it
does not change is the optimizer's fp32 master weights and moments, 12 of the 16
bytes per parameter of mixed-precision Adam.
"""

from dtlab.fp8.curves import PRECISIONS, loss_curves
from dtlab.fp8.formats import (
    FORMATS,
    FP8_DTYPES,
    Format,
    amax,
    dequantize,
    format_table,
    fp8_format,
    quantize,
    saturated_fraction,
    scale_from_amax,
)
from dtlab.fp8.linear import (
    Float8Linear,
    convert_to_float8,
    fp8_matmul,
    scaled_mm_error,
)
from dtlab.fp8.scaling import RECIPES, CurrentScaling, DelayedScaling, Recipe, recipe
from dtlab.fp8.wire import all_gather_fp8, fp8_memory, sharded_scale

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
    "CurrentScaling",
    "DelayedScaling",
    "Recipe",
    "RECIPES",
    "recipe",
    "fp8_matmul",
    "scaled_mm_error",
    "Float8Linear",
    "convert_to_float8",
    "sharded_scale",
    "all_gather_fp8",
    "fp8_memory",
    "PRECISIONS",
    "loss_curves",
]

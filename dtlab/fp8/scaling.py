"""Where the scale of each FP8 cast comes from: current or delayed scaling.

Taught in chapter 12 (the frontier), its FP8 section. Both recipes give one fp32
scale per tensor (Micikevicius et al. 2022, *FP8 Formats for Deep Learning*, §4.3)
and use Transformer Engine's rule ``scale = max / (amax · 2^margin)``
(:func:`dtlab.fp8.formats.scale_from_amax`).

**Current scaling** (:class:`CurrentScaling`) reads the tensor twice: once for its
amax, once to cast it. The scale always fits the tensor, so nothing saturates.

**Delayed scaling** (:class:`DelayedScaling`) saves the first read by predicting the
amax from the past. Each call, in this order:

1. the scale in hand, computed from the amax *history* of earlier calls, is used to
   cast the tensor (the current tensor has not been looked at yet);
2. the history rolls: the oldest amax drops out and this tensor's amax goes in;
3. the next call's scale is computed from the maximum over the new history.

The first call has no history; it scales from the tensor itself (what torchao does
on its first iteration; Transformer Engine starts from scale 1). The price of the
prediction: when amax *jumps* past everything in the history (a loss spike, an
outlier activation), the stale scale is too large and the excess **saturates** at
``±max``. The next call already knows the new amax. A longer history and a margin
make that rarer at the cost of precision (values sit lower in the format).

**Guards.** An all-zero tensor (amax 0) leaves the scale as it was (1 at first, and
always 1 under current scaling). A tensor holding inf or NaN is refused with a
``ValueError`` naming its role, before any state changes: an FP8 cast cannot
represent it (e4m3 has no inf), and a silent skip would hide the step that broke.
(Transformer Engine instead keeps the old scale and lets the NaN reach the loss.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dtlab.checks import one_of, positive_int
from dtlab.fp8.formats import amax, fp8_format, quantize, scale_from_amax

__all__ = ["CurrentScaling", "DelayedScaling", "Recipe", "RECIPES", "recipe"]

ROLES = ("x", "weight", "grad_out")
"""The three tensors a linear layer casts: its input and weight (forward, e4m3) and
the gradient of its output (backward, e5m2)."""


class _Scaling:
    def __init__(self, fmt, margin: float, name: str):
        self.format = fp8_format(fmt)
        # scale_from_amax validates the margin; an amax of 1 costs nothing
        scale_from_amax(1.0, self.format, margin)
        self.margin = float(margin)
        self.name = name
        self.last_amax: float | None = None  # the amax of the last tensor cast

    def _amax(self, x: torch.Tensor) -> torch.Tensor:
        a = amax(x)
        if not bool(torch.isfinite(a)):
            raise ValueError(
                f"FP8 cast of {self.name!r}: the tensor holds inf or NaN (amax "
                f"{a.item()}), which no scale brings into {self.format.name} range; "
                "the step diverged before this layer"
            )
        self.last_amax = float(a)
        return a


class CurrentScaling(_Scaling):
    """Scale each tensor from its own amax: ``max / (amax · 2^margin)``."""

    kind = "current"

    def __init__(self, fmt="e4m3", margin: float = 0, *, name: str = "tensor"):
        super().__init__(fmt, margin, name)
        self.scale: torch.Tensor | None = None  # the scale of the last cast

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 tensor, scale)`` for ``x``."""
        self.scale = scale_from_amax(self._amax(x), self.format, self.margin)
        return quantize(x, self.format, self.scale)

    def __repr__(self) -> str:
        return f"CurrentScaling({self.format.name!r}, margin={self.margin:g})"


class DelayedScaling(_Scaling):
    """Scale each tensor from the amaxes of the last ``history_len`` tensors before
    it (the order is in the module docstring). ``history`` holds them, newest last;
    ``scale`` is what the next call will use."""

    kind = "delayed"

    def __init__(
        self, fmt="e4m3", history_len: int = 16, margin: float = 0, *, name="tensor"
    ):
        super().__init__(fmt, margin, name)
        self.history_len = positive_int("history_len", history_len)
        self.history: torch.Tensor | None = None  # (history_len,) fp32, newest last
        self.scale: torch.Tensor | None = None  # None: no call yet

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8 tensor, scale used)`` for ``x``, then the history rolls."""
        a = self._amax(x)
        if self.scale is None:  # no history to predict from: use this tensor's
            self.scale = scale_from_amax(a, self.format, self.margin)
            self.history = torch.zeros(self.history_len, device=a.device)
        q, used = quantize(x, self.format, self.scale)  # 1. the scale from the past
        self.history = torch.cat([self.history[1:], a.reshape(1)])  # 2. roll
        self.scale = scale_from_amax(  # 3. the next call's scale (0: keep the old)
            self.history.max(), self.format, self.margin, fallback=self.scale
        )
        return q, used

    def __repr__(self) -> str:
        return (
            f"DelayedScaling({self.format.name!r}, history_len={self.history_len}, "
            f"margin={self.margin:g})"
        )


@dataclass(frozen=True)
class Recipe:
    """How a :class:`dtlab.fp8.Float8Linear` casts: ``scaling`` ("delayed" or
    "current"), the delayed history length and the margin, and the formats of the
    forward (x, weight) and backward (grad_out) casts. The default is the standard
    hybrid recipe: e4m3 forward, e5m2 gradients. Transformer Engine's default
    history is 1024 steps; 16 keeps a short course run responsive."""

    scaling: str = "delayed"
    history_len: int = 16
    margin: float = 0
    forward_format: str = "e4m3"
    backward_format: str = "e5m2"

    def __post_init__(self) -> None:
        scaling = one_of("FP8 scaling", self.scaling, ("delayed", "current"))
        object.__setattr__(self, "scaling", scaling)  # frozen: store the spelling
        positive_int("history_len", self.history_len)
        scale_from_amax(1.0, "e4m3", self.margin)  # refuses a bad margin
        fp8_format(self.forward_format)
        fp8_format(self.backward_format)

    @property
    def name(self) -> str:
        return f"fp8-{self.scaling}"

    def scaler(self, role: str) -> CurrentScaling | DelayedScaling:
        """Fresh scaling state for one of a layer's :data:`ROLES`."""
        one_of("FP8 tensor role", role, ROLES)
        fmt = self.backward_format if role == "grad_out" else self.forward_format
        if self.scaling == "current":
            return CurrentScaling(fmt, self.margin, name=role)
        return DelayedScaling(fmt, self.history_len, self.margin, name=role)


RECIPES = {"delayed": Recipe("delayed"), "current": Recipe("current")}


def recipe(r=None) -> Recipe:
    """A :class:`Recipe` from itself, a name in :data:`RECIPES` (``"fp8-"`` prefix
    allowed), or ``None`` (delayed scaling)."""
    if r is None:
        return RECIPES["delayed"]
    if isinstance(r, Recipe):
        return r
    key = str(r).lower().removeprefix("fp8-")
    if key not in RECIPES:
        raise ValueError(
            f"unknown FP8 recipe {r!r}: use one of {sorted(RECIPES)} or a Recipe"
        )
    return RECIPES[key]

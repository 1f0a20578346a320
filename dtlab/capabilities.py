"""What this machine can compute, probed once, in one place.

CPUs differ. An AMD EPYC with AVX-512 and AVX512-BF16 has no fp16 arithmetic of its
own (neither AVX512-FP16 nor AMX-FP16), so oneDNN reports no fp16 kernels, and
DeepSpeed's CPU accelerator, which asks oneDNN, refuses an fp16 config ("Type fp16
is not supported on your device."). torch itself still computes fp16 on such a CPU
(its own kernels convert to fp32 and back), so dtlab's fp16 runs are unaffected;
only what a library refuses is gated here.

Every capability a test or a chapter depends on is named in :data:`CAPABILITIES`
with the probe that answers it. :func:`lacking` returns None where the machine has
it, or the reason it does not, in the words of the library that refuses;
:func:`has` is the boolean. Tests skip with that reason (``tests/conftest.py``'s
``needs``); chapters switch to what the machine has.

``DTLAB_CPU_LACKS=fp16,amx`` (a comma-separated list of names) makes the probes
answer as if the machine lacked those, so a machine that has them can still run
the other path: ``DTLAB_CPU_LACKS=fp16 make test`` is the suite on a CPU without
fp16 kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import torch

__all__ = ["CAPABILITIES", "LACKS_ENV", "Capability", "has", "lacking", "report"]

LACKS_ENV = "DTLAB_CPU_LACKS"


@dataclasses.dataclass(frozen=True)
class Capability:
    """``probe()`` returns None when the machine has it, else the reason it does
    not; ``refusal`` is what the library that needs it says without it (the
    reason given when ``DTLAB_CPU_LACKS`` says so); ``implies`` names the
    capabilities that cannot exist without this one."""

    name: str
    what: str
    probe: Callable[[], str | None]
    refusal: str
    implies: tuple[str, ...] = ()


def _onednn(dtype: str) -> str | None:
    ask = getattr(torch.ops.mkldnn, f"_is_mkldnn_{dtype}_supported")
    try:
        if ask():
            return None
    except RuntimeError as e:  # a build without oneDNN
        return f"oneDNN cannot say: {e}"
    return (
        f"oneDNN has no {dtype} kernels on this CPU "
        f"(torch.ops.mkldnn._is_mkldnn_{dtype}_supported() is False)"
    )


def _isa() -> str | None:
    found = torch.backends.cpu.get_cpu_capability()
    if found.startswith("AVX512"):
        return None
    return f"torch runs this CPU's {found} kernels, not AVX-512"


def _amx() -> str | None:
    ask = getattr(torch._C._cpu, "_is_amx_tile_supported", None)
    if ask is not None and ask():
        return None
    return "no AMX tiles (torch._C._cpu._is_amx_tile_supported() is False)"


def _deepspeed_refusal(dtype: str) -> str:
    # DeepSpeed's own words (runtime/engine.py, _do_sanity_check)
    return f"DeepSpeed: Type {dtype} is not supported on your device."


def _deepspeed(dtype: str) -> Callable[[], str | None]:
    def probe() -> str | None:
        try:
            from deepspeed.accelerator import get_accelerator
        except ImportError as e:
            return f"DeepSpeed is not installed ({e})"
        if getattr(get_accelerator(), f"is_{dtype}_supported")():
            return None
        return _deepspeed_refusal(dtype) + " (its CPU accelerator asks oneDNN)"

    return probe


def _capability(name, what, probe, refusal, implies=()):
    return name, Capability(name, what, probe, refusal, implies)


CAPABILITIES: dict[str, Capability] = dict(
    [
        _capability(
            "fp16",
            "oneDNN's fp16 kernels",
            lambda: _onednn("fp16"),
            "oneDNN has no fp16 kernels on this CPU",
            ("deepspeed_fp16",),
        ),
        _capability(
            "bf16",
            "oneDNN's bf16 kernels",
            lambda: _onednn("bf16"),
            "oneDNN has no bf16 kernels on this CPU",
            ("deepspeed_bf16",),
        ),
        _capability("avx512", "AVX-512", _isa, "torch runs no AVX-512 kernels here"),
        _capability("amx", "AMX tiles", _amx, "no AMX tiles on this CPU"),
        _capability(
            "deepspeed_fp16",
            "DeepSpeed's fp16",
            _deepspeed("fp16"),
            _deepspeed_refusal("fp16"),
        ),
        _capability(
            "deepspeed_bf16",
            "DeepSpeed's bf16",
            _deepspeed("bf16"),
            _deepspeed_refusal("bf16"),
        ),
    ]
)


def _told_to_lack() -> set[str]:
    told = {n.strip() for n in os.environ.get(LACKS_ENV, "").split(",") if n.strip()}
    unknown = told - CAPABILITIES.keys()
    if unknown:
        raise ValueError(
            f"{LACKS_ENV} names {', '.join(sorted(unknown))}: the capabilities are "
            + ", ".join(CAPABILITIES)
        )
    return told


@functools.cache
def _probed(name: str) -> str | None:
    return CAPABILITIES[name].probe()


def lacking(name: str) -> str | None:
    """None when this machine has capability ``name``; else why not, in the words
    of the library that refuses (or of ``DTLAB_CPU_LACKS`` when told so)."""
    if name not in CAPABILITIES:
        raise ValueError(
            f"no capability called {name!r}: the capabilities are "
            + ", ".join(CAPABILITIES)
        )
    told = {t for t in _told_to_lack() if t == name or name in CAPABILITIES[t].implies}
    if told:
        lacked = ", ".join(CAPABILITIES[t].what for t in sorted(told))
        return (
            f"{CAPABILITIES[name].refusal} ({LACKS_ENV}={os.environ[LACKS_ENV]}: "
            f"as if this machine lacked {lacked})"
        )
    return _probed(name)


def has(name: str) -> bool:
    """Whether this machine has capability ``name`` (see :func:`lacking`)."""
    return lacking(name) is None


def report(names=("fp16", "bf16", "avx512", "amx")) -> dict[str, str]:
    """``{name: "yes" | the reason not}``, for a test run's header."""
    return {n: lacking(n) or "yes" for n in names}

"""Chapter 00's exercises: ZeRO's memory arithmetic, checked against
:mod:`dtlab.estimate` (no cluster: both are pure functions, run in this process).

1. ``zero2_bytes``: the model-state bytes one GPU holds under ZeRO-2, over every
   precision policy and optimizer of :func:`dtlab.estimate.bytes_per_param`, three
   model sizes and five data-parallel degrees, plus bf16 weights with fp32 gradients
   (where the weight's and the gradient's bytes differ); a wrong answer is told which
   stage's formula it computed instead, or which argument it ignored.
2. ``min_gpus``: the fewest GPUs (a power of two) on which a model's states fit,
   over four presets, every GPU of :data:`dtlab.estimate.GPUS`, the four stages and
   three precision/optimizer pairs, against a brute-force search over
   :func:`dtlab.estimate.zero_memory_per_device`.
"""

from __future__ import annotations

import math

from dtlab import estimate as est
from dtlab.exercises.ch00_solutions import min_gpus, zero2_bytes_per_device
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise

__all__ = ["check_zero2_bytes", "check_min_gpus", "fitting_gpus"]

SIZES = (1e6, 7.5e9, 70e9)
DEGREES = (1, 2, 8, 64, 1000)
MAX_GPUS = 4096


def _close(a, b) -> bool:
    return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-9)


def _zero2_cases():
    """(what, Ψ, N, bytes of weight, gradient, optimizer state) to check."""
    for precision in est.STATE_PRECISIONS:
        for optimizer in est.OPTIMIZERS:
            b = est.bytes_per_param(precision, optimizer)
            for psi in SIZES:
                for n in DEGREES:
                    yield f"{precision}/{optimizer}", psi, n, b.params, b.grads, b.K
    # bf16 weights with an fp32 gradient slice (dtlab's ZeRO with compute_dtype)
    for n in DEGREES:
        yield "bf16 weights, fp32 gradients", 7.5e9, n, 2, 4, 12


def _why_zero2(got, psi, n, p, g, k) -> str:
    """Which mistake ``got`` is, from the formulas it might have computed."""
    guesses = [
        (
            (p + g + k) * psi / n,
            "You sharded the weights too: that is ZeRO-3. Stage 2 keeps the full "
            "weights on every GPU, since each one runs its own forward and backward "
            "over all of them",
        ),
        (
            (p + g) * psi + k * psi / n,
            "Only the optimizer states are sharded: that "
            "is ZeRO-1. Stage 2 shards the gradients too (each rank keeps the "
            "reduce-scattered slice it updates)",
        ),
        (
            (p + g + k) * psi,
            "Nothing is sharded: that is plain data parallelism (stage 0)",
        ),
        (
            p * psi + (g + k) * psi * n,
            "The sharded part grows with N: divide it by the number of GPUs",
        ),
        (
            p * psi + (g + k) * psi * (n - 1) / n,
            "Each GPU keeps (N−1)/N of the sharded states: that is the ring's "
            "share of the traffic, not of the memory. A GPU holds only its own 1/N "
            "slice",
        ),
        (
            p * psi + (g + 12) * psi / n,
            "K is taken as 12 whatever the optimizer: use the K argument",
        ),
        (
            p * psi + (p + k) * psi / n,
            "The gradient is counted with the weight's "
            "bytes: use bytes_grad for the gradient",
        ),
        (
            g * psi + (p + k) * psi / n,
            "bytes_param and bytes_grad are swapped: the "
            "replicated weights cost bytes_param each",
        ),
    ]
    for value, why in guesses:
        if _close(got, value):
            return why
    return "Compare your terms with the table of section 5"


@exercise(
    "zero2_bytes",
    chapter=0,
    reference=zero2_bytes_per_device,
    local=True,
    measures=(
        "bytes == dtlab.estimate.zero_memory_per_device(stage=2) (rel 1e-9) over 3 "
        "precisions x 3 optimizers x 3 sizes x 5 degrees, and bf16 weights with fp32 "
        "gradients; the formula computed instead is named"
    ),
)
def check_zero2_bytes(solution, cluster=None):
    cases = 0
    for what, psi, n, p, g, k in _zero2_cases():
        want = p * psi + (g + k) * psi / n
        got = attempt(solution, psi, n, p, g, k)
        if not _close(got, want):
            raise ExerciseFailed(
                f"{what}, Ψ = {psi:.3g}, N = {n}: got {got!r} bytes, ZeRO-2 holds "
                f"{want:.4g}. {_why_zero2(got, psi, n, p, g, k)}."
            )
        cases += 1
    figure1 = attempt(solution, 7.5e9, 64) / est.GB
    return [
        f"all {cases} cases agree with dtlab.estimate to 1e-9",
        f"the ZeRO paper's Figure 1 (Ψ = 7.5B, N = 64, stage 2): {figure1:.1f} GB",
    ]


def fitting_gpus(n_params, gpu_bytes, stage, precision="mixed", optimizer="adam"):
    """The fewest GPUs (a power of two up to 4096) on which the model states fit,
    found by trying each one with :func:`dtlab.estimate.zero_memory_per_device`;
    ``None`` if none does."""
    for n in (2**k for k in range(13)):
        states = est.zero_memory_per_device(n_params, n, stage, precision, optimizer)
        if states["total"] <= gpu_bytes:
            return n
    return None


def _priced_otherwise(got, psi, gpu_bytes, stage, precision, optimizer) -> str:
    """The other question ``got`` answers (another stage, or mixed-precision Adam
    in place of the case's precision and optimizer), or ``""``."""
    others = [
        (s, p, o)
        for s in (0, 1, 2, 3)
        for p, o in {(precision, optimizer), ("mixed", "adam")}
        if (s, p, o) != (stage, precision, optimizer)
    ]
    mine = fitting_gpus(psi, gpu_bytes, stage, precision, optimizer)
    for s, p, o in others:
        answer = fitting_gpus(psi, gpu_bytes, s, p, o)
        if answer == got != mine:
            return f"ZeRO-{s} with {p}/{o}"
    return ""


def _min_gpus_cases():
    pairs = [("mixed", "adam"), ("fp32", "sgd"), ("pure_bf16", "sgd_momentum")]
    models = [("1.3B", 1.3e9)]  # small enough to fit on one GPU
    models += [(key, est.MODELS[key].n_params) for key in ("7B", "70B", "405B")]
    for precision, optimizer in pairs:
        for key, psi in models:
            for gpu in est.GPUS.values():
                for stage in (0, 1, 2, 3):
                    yield key, psi, gpu, stage, precision, optimizer


@exercise(
    "min_gpus",
    chapter=0,
    reference=min_gpus,
    local=True,
    measures=(
        "== a brute-force search over dtlab.estimate.zero_memory_per_device: 4 "
        "models x 4 GPUs x 4 stages x 3 precision/optimizer pairs; a power of two, "
        "None where the replicated part alone does not fit"
    ),
)
def check_min_gpus(solution, cluster=None):
    cases = nones = 0
    for key, psi, gpu, stage, precision, optimizer in _min_gpus_cases():
        want = fitting_gpus(psi, gpu.memory_bytes, stage, precision, optimizer)
        got = attempt(solution, psi, gpu.memory_bytes, stage, precision, optimizer)
        where = f"{key} on {gpu.name}, ZeRO-{stage}, {precision}/{optimizer}"
        if got == want:
            cases += 1
            nones += want is None
            continue
        priced = got is not None and _priced_otherwise(
            got, psi, gpu.memory_bytes, stage, precision, optimizer
        )
        if priced:
            raise ExerciseFailed(
                f"{where}: got {got!r}, the answer for {priced}, not for this case "
                f"({want!r}). Check the precision, optimizer and stage you were "
                "given: est.bytes_per_param(precision, optimizer) prices them."
            )
        if want is None:
            raise ExerciseFailed(
                f"{where}: got {got!r}, but no number of GPUs is enough: what stage "
                f"{stage} replicates does not shrink with N and alone exceeds "
                f"{gpu.memory_bytes / est.GB:.0f} GB. Return None."
            )
        if got is None:
            raise ExerciseFailed(
                f"{where}: got None, but the model states fit on {want} GPUs."
                + (
                    " Stage 3 replicates nothing, so enough GPUs always fit."
                    if stage == 3
                    else ""
                )
            )
        if not isinstance(got, int) or got < 1 or got & (got - 1):
            raise ExerciseFailed(
                f"{where}: got {got!r}, not a power of two; answer with the fewest "
                f"of 1, 2, 4, ... that fits ({want})."
            )
        need = est.zero_memory_per_device(psi, got, stage, precision, optimizer)
        if need["total"] > gpu.memory_bytes:
            raise ExerciseFailed(
                f"{where}: on {got} GPUs the model states take "
                f"{need['total'] / est.GB:.1f} GB, over {gpu.memory_bytes / est.GB:.0f}"
                f" GB: they first fit on {want}. Check the precision, optimizer and "
                "stage you were given, and stop only once it fits."
            )
        raise ExerciseFailed(
            f"{where}: got {got}, but {want} already suffice"
            f"{'' if want > 1 else 's'}: return the fewest GPUs that fit."
        )
    return [
        f"all {cases} cases agree with a search over dtlab.estimate "
        f"({nones} of them: no number of GPUs is enough)",
    ]

"""FLOPs and time to train: one count of a model's FLOPs, and a run's duration.

dtlab counts FLOPs one way everywhere (:func:`training_flops`, :func:`train_time`,
the planner's step time and its MFU): the matrix multiplications of forward and
backward, attention's included, 2 FLOPs a multiply-add, backward twice forward.
Per token of a sequence of ``s``, with ``N`` the weights a token multiplies by
(:func:`dtlab.estimate.models.matmul_params`: every block's projections, a mixture
of experts' ``top_k`` experts only, and the head ``V·h``; not the embedding
lookup, position tables, norms or biases)::

    model FLOPs per token = 6·N + 12·l·h·s

the ``12·l·h·s`` being ``QKᵀ`` and ``softmax·V`` (``4·s·h`` a layer forward,
every query against every key: the causal half is not subtracted). This is PaLM's
MFU numerator (Chowdhery et al. 2022, Appendix B: ``6N + 12·L·H·Q·T``) and, for
a GPT block (``N = 12·l·h² + V·h``), Narayanan et al. 2021's ``72·B·s·l·h²·(1 +
s/6h + V/12lh)`` per batch of B sequences (§5.1, without recomputation). Their
``96·B·s·l·h²·(1 + s/6h + V/16lh)`` counts the forward a full recomputation runs
again: those are *hardware* FLOPs (:func:`hardware_flops`), and MFU does not
count them (Korthikanti et al. 2022, §5: MFU against HFU). Kaplan et al. 2020's
``6·N·D`` (:func:`training_flops` with a bare parameter count) leaves attention
out; Chinchilla's ``C ≈ 6ND`` is the same rule.

Taught in chapter 00 (why distribute); chapter 09's planner reports MFU and
achieved FLOP/s per GPU with :func:`model_flops_per_token`.
"""

from __future__ import annotations

from dtlab.checks import one_of
from dtlab.estimate.models import matmul_params, model_spec
from dtlab.events import CHECKPOINTING


# ---- FLOPs ---------------------------------------------------------------------------
def model_flops_per_token(model, seq_len: int | None = None) -> float:
    """Forward + backward matmul FLOPs of one token of ``model`` (a preset name,
    a :class:`ModelPreset`, a ``GPTConfig`` or a dict) at context ``seq_len``
    (default the model's): ``6·N + 12·l·h·s`` (the module docstring)."""
    spec = model_spec(model)
    s = seq_len or spec.seq_len
    if s < 1:
        raise ValueError(f"seq_len must be positive, got {s}")
    n = matmul_params(spec)
    N = spec.n_layers * n["block"] + n["head"]
    return 6.0 * N + 12.0 * spec.n_layers * spec.d_model * s


def hardware_flops(model, tokens: float, *, seq_len=None, recompute="none") -> float:
    """FLOPs the GPUs really run for ``tokens`` tokens: :func:`training_flops`
    plus what recomputation runs again (full: every block's forward, ``2·N_block
    + 4·s·h`` a token and layer; selective: the score matmuls, ``4·s·h``).
    Narayanan et al. 2021's ``96·B·s·l·h²(1 + s/6h + V/16lh)`` is this with
    ``recompute="full"``; MFU is over :func:`training_flops`, HFU over this."""
    spec = model_spec(model)
    s = seq_len or spec.seq_len
    mode = one_of("recompute mode", recompute, CHECKPOINTING)
    scores = 4.0 * s * spec.d_model
    extra = {"none": 0.0, "selective": scores}[mode] if mode != "full" else (
        2.0 * matmul_params(spec)["block"] + scores
    )  # fmt: skip
    base = training_flops(spec, tokens, seq_len=s)
    return base + tokens * spec.n_layers * extra


def training_flops(model, tokens: float, *, seq_len: int | None = None) -> float:
    """Training FLOPs of ``tokens`` tokens.

    ``model`` a model (a preset name, a ModelPreset, a GPTConfig, a dict): the
    module's one count, ``tokens · (6·N + 12·l·h·s)`` (:func:`model_flops_per_token`;
    a mixture of experts over its active weights). ``model`` a bare number Ψ of
    parameters: Kaplan et al. 2020's ``6·Ψ·D`` (§2.1; Chinchilla's ``6ND``), with
    no attention term (it needs the shape) and every parameter counted, the head's
    included: the rule of thumb of chapter 00."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if model < 0:
            raise ValueError(f"n_params must be >= 0, got {model}")
        return 6.0 * model * tokens
    return model_flops_per_token(model, seq_len) * tokens


def train_time(
    model, tokens: float, n_gpus: int, peak_flops: float, mfu: float, *, seq_len=None
) -> float:
    """Seconds to train on ``tokens`` tokens: ``training_flops / (n_gpus · peak ·
    MFU)``, with :func:`training_flops`' count (``model`` a model, or a bare
    parameter count for ``6·N·D``).

    MFU, model FLOPs utilisation, is the share of peak the job really sustains
    (Chowdhery et al. 2022): 35-55 % is typical of large dense runs.
    Example: 70B parameters, 2T tokens, 1024 H100s at 40 % -> about 24 days.
    """
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    flops = training_flops(model, tokens, seq_len=seq_len)
    return flops / (n_gpus * peak_flops * mfu)


def step_utilisation(
    model, tokens: float, step_s: float, n_gpus: int, peak_flops: float, *,
    seq_len=None,
) -> dict[str, float]:  # fmt: skip
    """What a step of ``tokens`` tokens in ``step_s`` seconds on ``n_gpus`` GPUs
    achieves: ``{"model_flops", "achieved_flops_per_gpu"`` (FLOP/s, the papers'
    "TFLOP/s per GPU" × 1e12), ``"mfu"`` (that over the GPU's ``peak_flops``)}."""
    if step_s <= 0 or n_gpus < 1 or peak_flops <= 0:
        raise ValueError("step_s, n_gpus and peak_flops must be positive")
    flops = training_flops(model, tokens, seq_len=seq_len)
    per_gpu = flops / (n_gpus * step_s)
    return {
        "model_flops": flops,
        "achieved_flops_per_gpu": per_gpu,
        "mfu": per_gpu / peak_flops,
    }

"""The analytic model: memory per device, bytes on the wire, time per step and per run.

Taught in chapter 00 (why distribute) and used by every later chapter to put a
prediction next to each measurement; it also answers questions for models far larger
than this machine ("does 70B fit on 8 x 80 GB with ZeRO-3?").

Sources, cited where each formula appears:

- ZeRO: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (SC20). §3: model states of mixed-precision Adam are
  2Ψ + 2Ψ + KΨ bytes with K = 12; §5: what each stage divides by N_d.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", §4 and Table 2.
- Collectives: the ring algorithm's traffic (Patarasuk & Yuan 2009) and nccl-tests'
  bus bandwidth (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests).
- Time: the 6·N·D training FLOPs rule (Kaplan et al. 2020, §2.1) and model FLOPs
  utilisation, MFU (Chowdhery et al. 2022, PaLM, Appendix B).

Units: bytes, seconds, FLOP/s. "GB" in docstrings means 10^9 bytes, as in the ZeRO
paper (7.5B parameters x 16 bytes = 120 GB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "BytesPerParam",
    "bytes_per_param",
    "zero_memory_per_device",
    "activation_bytes_per_layer",
    "activation_bytes",
    "model_params",
    "ModelPreset",
    "MODELS",
    "GPU",
    "GPUS",
    "memory_per_device",
    "COLLECTIVES",
    "wire_bytes",
    "latency_steps",
    "bus_bandwidth_factor",
    "bus_bandwidth",
    "collective_time",
    "AlphaBeta",
    "fit_alpha_beta",
    "training_flops",
    "train_time",
    "GB",
    "ddp_bytes_per_step",
    "ddp_bucket_assignment",
    "ddp_overlap",
    "pipeline_bubble_fraction",
    "pipeline_bubble_ratio",
    "pipeline_step_time",
    "pipeline_in_flight",
    "Link",
    "tp_collectives_per_layer",
    "tp_bytes_per_layer",
    "tp_layer_flops",
    "tp_step_time",
    "tp_params_per_rank",
    "zero_states_per_rank",
    "zero_comm_per_step",
    "PRECISIONS",
    "OPTIMIZERS",
    "RECOMPUTE",
    "PIPELINE_SCHEDULES",
    "LINKS",
]

GB = 1e9  # the ZeRO paper's gigabyte

PRECISIONS = ("fp32", "mixed", "bf16")
OPTIMIZERS = ("adam", "sgd_momentum", "sgd")
_OPTIMIZER_ALIASES = {"adamw": "adam", "sgd-momentum": "sgd_momentum"}
_PRECISION_ALIASES = {"amp": "mixed", "fp16-mixed": "mixed", "bf16-mixed": "mixed"}


# ---- model states: bytes per parameter -----------------------------------------------
@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs in model states: the weight, its gradient, and the
    optimizer's share. In the ZeRO paper's notation the model states of Ψ parameters
    take ``(params + grads + K) * Ψ`` bytes, where ``K = optimizer``."""

    params: float
    grads: float
    optimizer: float

    @property
    def K(self) -> float:
        """The ZeRO paper's K: optimizer-state bytes per parameter (12 for mixed
        precision Adam: fp32 master weight, momentum and variance)."""
        return self.optimizer

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def _norm_choice(value: str, allowed: tuple[str, ...], aliases: dict, what: str) -> str:
    key = str(value).lower()
    key = aliases.get(key, key)
    if key not in allowed:
        raise ValueError(f"unknown {what} {value!r}: expected one of {allowed}")
    return key


def bytes_per_param(precision: str = "mixed", optimizer: str = "adam") -> BytesPerParam:
    """Model-state bytes per parameter for a precision policy and an optimizer.

    ``precision``:

    - ``"fp32"``: weights, gradients and optimizer states in fp32. This is also what
      ``torch.autocast`` keeps in memory: it casts on the fly, the stored parameters
      and their gradients stay fp32.
    - ``"mixed"`` (ZeRO §3, Micikevicius et al. 2018): fp16/bf16 weights and
      gradients (2 + 2 bytes), and the optimizer keeps an fp32 *master copy* of the
      weights (4 bytes) besides its own states.
    - ``"bf16"``: everything in bf16, no master copy (cheapest, but small updates can
      vanish in bf16's 8-bit mantissa).

    ``optimizer``: ``"adam"`` (or ``"adamw"``; momentum + variance), ``"sgd_momentum"``
    (one buffer), ``"sgd"`` (none).

    ====== ======== ============= ======
    policy adam     sgd_momentum  sgd
    ====== ======== ============= ======
    fp32   4+4+8=16 4+4+4=12      4+4+0=8
    mixed  2+2+12   2+2+8         2+2+4
    bf16   2+2+4    2+2+2         2+2+0
    ====== ======== ============= ======
    """
    precision = _norm_choice(precision, PRECISIONS, _PRECISION_ALIASES, "precision")
    optimizer = _norm_choice(optimizer, OPTIMIZERS, _OPTIMIZER_ALIASES, "optimizer")
    n_states = {"adam": 2, "sgd_momentum": 1, "sgd": 0}[optimizer]
    if precision == "fp32":
        return BytesPerParam(4, 4, 4 * n_states)
    if precision == "mixed":
        # the fp32 master copy (4) lives with the optimizer, states are fp32 too
        return BytesPerParam(2, 2, 4 + 4 * n_states)
    return BytesPerParam(2, 2, 2 * n_states)


def zero_memory_per_device(
    n_params: float,
    world_size: int,
    stage: int,
    precision: str = "mixed",
    optimizer: str = "adam",
) -> dict[str, float]:
    """Model-state bytes per data-parallel device under ZeRO ``stage`` (ZeRO §5.1).

    With Ψ parameters, N = ``world_size`` data-parallel devices and the bytes per
    parameter of :func:`bytes_per_param` (mixed-precision Adam: 2, 2, K = 12):

    - stage 0 (plain DP): ``2Ψ + 2Ψ + KΨ``              (everything replicated)
    - stage 1 (P_os):     ``2Ψ + 2Ψ + KΨ/N``            (optimizer states sharded)
    - stage 2 (P_os+g):   ``2Ψ + (2 + K)Ψ/N``           (+ gradients sharded)
    - stage 3 (P_os+g+p): ``(2 + 2 + K)Ψ/N``            (+ parameters sharded)

    Returns ``{"params", "grads", "optimizer", "total"}`` in bytes. Transient
    buffers (a gathered layer under stage 3, communication buckets) are not included.
    The paper's Figure 1 example: Ψ = 7.5B, N = 64 gives 120, 31.4, 16.6, 1.9 GB.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or world_size < 1
    ):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage!r}: expected 0, 1, 2 or 3")
    b = bytes_per_param(precision, optimizer)
    n = world_size
    params = b.params * n_params / (n if stage >= 3 else 1)
    grads = b.grads * n_params / (n if stage >= 2 else 1)
    opt = b.optimizer * n_params / (n if stage >= 1 else 1)
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "total": params + grads + opt,
    }


# ---- activations ---------------------------------------------------------------------
RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    d_model: int,
    n_heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_value: int = 2,
) -> float:
    """Activation bytes one transformer layer keeps for the backward pass
    (Korthikanti et al. 2022, §4.1 and Table 2).

    With s = ``seq_len``, b = ``micro_batch``, h = ``d_model``, a = ``n_heads`` and
    16-bit activations, one GPT layer stores::

        s·b·h·(34 + 5·a·s/h)   bytes

    34·sbh is the linear part (attention 11sbh, MLP 19sbh, two LayerNorms 4sbh,
    dropout masks included); 5·a·s²·b is the attention score matrices (softmax output,
    its dropout mask and dropout output), the part that grows with s².

    Tensor parallelism over t ranks divides everything but the LayerNorm/dropout
    inputs: ``sbh(10 + 24/t + 5as/(ht))``; with sequence parallelism those are split
    too: ``sbh/t · (34 + 5as/h)``. Selective recomputation drops the ``5as/h`` term;
    full recomputation keeps only each layer's input, ``2sbh`` (divided by t under
    sequence parallelism).

    ``bytes_per_value`` rescales from the paper's 2-byte activations (use 4 for fp32).
    Embeddings, the final LayerNorm and the logits are not counted here.
    """
    for name, value in (
        ("seq_len", seq_len),
        ("micro_batch", micro_batch),
        ("d_model", d_model),
        ("n_heads", n_heads),
        ("tp", tp),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if bytes_per_value <= 0:
        raise ValueError(f"bytes_per_value must be positive, got {bytes_per_value}")
    recompute = _norm_choice(recompute, RECOMPUTE, {}, "recompute mode")
    s, b, h, a, t = seq_len, micro_batch, d_model, n_heads, tp
    sbh = s * b * h
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        per_layer = 2 * sbh / (t if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = sbh / t * (34 + scores)
    else:
        per_layer = sbh * (10 + 24 / t + scores / t)
    return per_layer * bytes_per_value / 2


def activation_bytes(
    n_layers: int, seq_len: int, micro_batch: int, d_model: int, n_heads: int, **kwargs
) -> float:
    """Activation bytes of ``n_layers`` layers: ``L · s·b·h·(34 + 5as/h)`` for the
    defaults; keyword options as in :func:`activation_bytes_per_layer`."""
    if n_layers < 0:
        raise ValueError(f"n_layers must be >= 0, got {n_layers}")
    return n_layers * activation_bytes_per_layer(
        seq_len, micro_batch, d_model, n_heads, **kwargs
    )


# ---- parameter counts and model presets ----------------------------------------------
def model_params(
    n_layers: int,
    d_model: int,
    vocab_size: int,
    *,
    seq_len: int = 0,
    d_ff: int | None = None,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    gated_mlp: bool = False,
    bias: bool = False,
    layernorm: bool = False,
    tied_embeddings: bool = True,
) -> int:
    """Parameters of a decoder-only transformer.

    With the defaults this is the textbook count ``12·L·h² + V·h``: per layer
    ``4h²`` for attention (q, k, v, output) and ``8h²`` for the MLP (``h -> 4h -> h``),
    plus a token embedding shared with the head.

    Options make it exact for real architectures:

    - ``seq_len``: learned position embeddings (GPT-2/3 and dtlab's GPT), ``s·h``;
    - ``d_ff``, ``gated_mlp``: MLP width and SwiGLU's third matrix (LLaMA: 3·h·d_ff);
    - ``n_heads``, ``n_kv_heads``: grouped-query attention shrinks k and v to
      ``h·n_kv_heads/n_heads`` columns each (LLaMA-2 70B, Llama 3);
    - ``bias``: biases on every Linear but the head; ``layernorm``: two LayerNorms per
      block and a final one, weight and bias each;
    - ``tied_embeddings=False``: a separate ``V·h`` head.

    For dtlab's :class:`~dtlab.model.GPT` this equals the measured count exactly.
    """
    for name, value in (
        ("n_layers", n_layers),
        ("d_model", d_model),
        ("vocab_size", vocab_size),
        ("seq_len", seq_len),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    h = d_model
    f = 4 * h if d_ff is None else d_ff
    kv = h if not n_kv_heads else h * n_kv_heads // (n_heads or n_kv_heads)
    attn = 2 * h * h + 2 * h * kv  # q and output proj: h x h; k and v: h x kv
    mlp = (3 if gated_mlp else 2) * h * f
    per_layer = attn + mlp
    if bias:
        per_layer += (h + 2 * kv + h) + ((2 if gated_mlp else 1) * f + h)
    if layernorm:
        per_layer += 2 * 2 * h  # ln_1 and ln_2: weight + bias
    total = n_layers * per_layer + vocab_size * h + seq_len * h
    if layernorm:
        total += 2 * h  # final LayerNorm
    if not tied_embeddings:
        total += vocab_size * h
    return total


@dataclass(frozen=True)
class ModelPreset:
    """A public architecture, enough of it to count parameters and activations."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    d_ff: int
    n_kv_heads: int | None = None
    gated_mlp: bool = True
    learned_positions: bool = False
    tied_embeddings: bool = False

    @property
    def n_params(self) -> int:
        """Parameter count from the architecture (norms and biases left out; they are
        well under 0.1 % of these models)."""
        return model_params(
            self.n_layers,
            self.d_model,
            self.vocab_size,
            seq_len=self.seq_len if self.learned_positions else 0,
            d_ff=self.d_ff,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            gated_mlp=self.gated_mlp,
            tied_embeddings=self.tied_embeddings,
        )


# LLaMA-2 (Touvron et al. 2023, Table 1 and the released configs), GPT-3 (Brown et
# al. 2020, Table 2.1), Llama 3.1 405B (Dubey et al. 2024, Table 3; 8K pre-training
# context).
MODELS: dict[str, ModelPreset] = {
    "7B": ModelPreset("LLaMA-2 7B", 32, 4096, 32, 32000, 4096, 11008),
    "13B": ModelPreset("LLaMA-2 13B", 40, 5120, 40, 32000, 4096, 13824),
    "70B": ModelPreset("LLaMA-2 70B", 80, 8192, 64, 32000, 4096, 28672, n_kv_heads=8),
    "175B": ModelPreset(
        "GPT-3 175B",
        96,
        12288,
        96,
        50257,
        2048,
        4 * 12288,
        gated_mlp=False,
        learned_positions=True,
        tied_embeddings=True,
    ),
    "405B": ModelPreset(
        "Llama 3.1 405B", 126, 16384, 128, 128256, 8192, 53248, n_kv_heads=8
    ),
}


# ---- GPUs ----------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """Datasheet numbers of one accelerator (dense, no sparsity).

    ``memory_bytes`` is the marketed capacity in 10^9 bytes; a few GB of it go to the
    CUDA context and allocator fragmentation in practice.
    """

    name: str
    memory_bytes: float
    peak_bf16_flops: float
    hbm_Bps: float
    nvlink_Bps: float


GPUS: dict[str, GPU] = {
    "A100-40GB": GPU("A100 40GB SXM", 40 * GB, 312e12, 1.555e12, 600e9),
    "A100-80GB": GPU("A100 80GB SXM", 80 * GB, 312e12, 2.039e12, 600e9),
    "H100-80GB": GPU("H100 80GB SXM", 80 * GB, 989e12, 3.35e12, 900e9),
    "H200-141GB": GPU("H200 141GB SXM", 141 * GB, 989e12, 4.8e12, 900e9),
}


def memory_per_device(
    model: ModelPreset | str,
    *,
    world_size: int = 1,
    stage: int = 0,
    precision: str = "mixed",
    optimizer: str = "adam",
    micro_batch: int = 1,
    seq_len: int | None = None,
    recompute: str = "none",
) -> dict[str, float]:
    """Model states (ZeRO, :func:`zero_memory_per_device`) plus activations
    (Korthikanti, :func:`activation_bytes`) per device of a data-parallel job.

    Activations are not sharded by ZeRO: every rank keeps those of its own micro-batch.
    They are 2 bytes per value except under ``precision="fp32"`` (4).
    Returns ``{"params", "grads", "optimizer", "activations", "total"}`` in bytes.
    """
    preset = MODELS[model] if isinstance(model, str) else model
    states = zero_memory_per_device(
        preset.n_params, world_size, stage, precision, optimizer
    )
    fp32 = (
        _norm_choice(precision, PRECISIONS, _PRECISION_ALIASES, "precision") == "fp32"
    )
    acts = activation_bytes(
        preset.n_layers,
        seq_len or preset.seq_len,
        micro_batch,
        preset.d_model,
        preset.n_heads,
        recompute=recompute,
        bytes_per_value=4 if fp32 else 2,
    )
    out = {k: states[k] for k in ("params", "grads", "optimizer")}
    out["activations"] = acts
    out["total"] = states["total"] + acts
    return out


# ---- collectives: bytes on the wire --------------------------------------------------
COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "all_to_all",
    "send",
    "recv",
    "barrier",
)


def _check_collective(op: str, payload_bytes: float, n: int) -> None:
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: expected one of {COLLECTIVES}")
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"n (ranks in the group) must be a positive integer, got {n!r}"
        )


def wire_bytes(op: str, payload_bytes: float, n: int) -> float:
    """Bytes that *this* rank sends for one collective over ``n`` ranks, under the ring
    algorithm. ``payload_bytes`` S is the full tensor: the all-reduce buffer, the
    reduce-scatter *input*, the all-gather *output*.

    - all_reduce: ``2(N-1)/N · S`` (a reduce-scatter, then an all-gather)
    - reduce_scatter, all_gather, all_to_all: ``(N-1)/N · S``
    - broadcast, reduce: ``S`` (pipelined along a chain; the last rank sends nothing,
      this is the busiest rank's count)
    - send: ``S``; recv: ``0`` (the sender counts it); barrier: ``0``

    Within one group (``n == 1``) nothing crosses ranks, so every op gives 0 except a
    point-to-point send.
    """
    _check_collective(op, payload_bytes, n)
    S = payload_bytes
    if op == "send":
        return float(S)
    if op in ("recv", "barrier") or n == 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * S
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n * S
    return float(S)  # broadcast, reduce


def latency_steps(op: str, n: int) -> int:
    """Sequential message steps of the ring algorithm, the count the α term pays:
    all_reduce ``2(N-1)``; reduce_scatter, all_gather, all_to_all, broadcast, reduce
    (pipelined) and barrier (a ring of empty messages) ``N-1``; send/recv ``1``."""
    _check_collective(op, 0, n)
    if op in ("send", "recv"):
        return 1
    if op == "all_reduce":
        return 2 * (n - 1)
    return n - 1


def bus_bandwidth_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth (S / t) to *bus* bandwidth, the
    number comparable to the link's peak whatever N is: all_reduce ``2(N-1)/N``,
    reduce_scatter/all_gather/all_to_all ``(N-1)/N``, broadcast/reduce/send/recv ``1``.
    """
    _check_collective(op, 0, n)
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "barrier":
        return 0.0
    return 1.0


def bus_bandwidth(op: str, payload_bytes: float, n: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s of one measured collective, as nccl-tests reports it:
    ``busbw = S / t · factor``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    _check_collective(op, payload_bytes, n)
    return payload_bytes / seconds * bus_bandwidth_factor(op, n)


def collective_time(
    op: str, payload_bytes: float, n: int, alpha_s: float, bandwidth_Bps: float
) -> float:
    """The α-β (latency-bandwidth, Hockney) model of one ring collective::

        t = steps(op, N) · α + wire_bytes(op, S, N) / bandwidth

    e.g. ring all-reduce: ``2(N-1)·α + 2(N-1)/N · S / B``. The first term dominates
    small messages, the second large ones; this is why DDP packs gradients into buckets.
    """
    if alpha_s < 0:
        raise ValueError(f"alpha_s must be >= 0, got {alpha_s}")
    if bandwidth_Bps <= 0:
        raise ValueError(f"bandwidth_Bps must be positive, got {bandwidth_Bps}")
    wire = wire_bytes(op, payload_bytes, n)
    return latency_steps(op, n) * alpha_s + wire / bandwidth_Bps


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted line ``t = alpha_s + beta_s_per_byte · size``."""

    alpha_s: float
    beta_s_per_byte: float

    @property
    def bandwidth_Bps(self) -> float:
        return math.inf if self.beta_s_per_byte <= 0 else 1.0 / self.beta_s_per_byte

    def predict(self, size: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * size


def fit_alpha_beta(sizes, times) -> AlphaBeta:
    """Least-squares fit of ``t = α + β·size`` to measured (size, time) pairs.

    Fit sizes in *wire bytes* of one op at a fixed N to read β as 1/bandwidth; α then
    holds that op's whole latency (all its ring steps together).
    """
    xs, ys = [float(s) for s in sizes], [float(t) for t in times]
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} sizes but {len(ys)} times")
    if len(xs) < 2:
        raise ValueError("need at least two (size, time) points to fit a line")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all sizes are equal: cannot separate alpha from beta")
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return AlphaBeta(alpha_s=my - beta * mx, beta_s_per_byte=beta)


# ---- time to train -------------------------------------------------------------------
def training_flops(n_params: float, tokens: float) -> float:
    """``6·N·D``: forward (2 FLOPs per parameter per token) plus backward (4)
    (Kaplan et al. 2020, §2.1); attention's s² term and recomputation are left out."""
    if n_params < 0 or tokens < 0:
        raise ValueError("n_params and tokens must be >= 0")
    return 6.0 * n_params * tokens


def train_time(
    n_params: float, tokens: float, n_gpus: int, peak_flops: float, mfu: float
) -> float:
    """Seconds to train on ``tokens`` tokens: ``6·N·D / (n_gpus · peak · MFU)``.

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
    return training_flops(n_params, tokens) / (n_gpus * peak_flops * mfu)


# ---- data parallelism: DDP bytes, buckets and overlap (chapter 02) -------------------
def ddp_bytes_per_step(n_params: float, n: int, bytes_per_grad: float = 4) -> float:
    """Bytes each rank sends per optimizer step under DDP: one ring all-reduce of all
    Ψ gradients, ``2(N-1)/N · Ψ · bytes_per_grad``.

    This is the ZeRO paper's "data parallelism moves 2Ψ per step" (Rajbhandari et al.
    2020, §7.1): a reduce-scatter (Ψ) and an all-gather (Ψ), each scaled by (N-1)/N.
    Bucketing changes how many calls carry it, not the total. Gradient accumulation
    divides it per micro-batch: ``no_sync`` skips the all-reduce on all but the last.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if bytes_per_grad <= 0:
        raise ValueError(f"bytes_per_grad must be positive, got {bytes_per_grad}")
    return wire_bytes("all_reduce", n_params * bytes_per_grad, n)


def ddp_bucket_assignment(sizes_bytes, cap_bytes: float) -> list[list[int]]:
    """PyTorch DDP's bucketing rule: walk the tensors in the order given, put each
    into the open bucket, and close the bucket as soon as it holds ``cap_bytes`` or
    more (so a bucket may overshoot the cap by its last tensor, and one tensor larger
    than the cap gets a bucket of its own). Returns lists of indices into
    ``sizes_bytes``.

    DDP passes its parameters in *reverse* registration order, the order in which
    backward usually produces their gradients, so the first bucket fills first.
    """
    if not cap_bytes > 0:
        raise ValueError(
            f"cap_bytes must be positive, got {cap_bytes}: a bucket needs room for at "
            "least one tensor"
        )
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0.0
    for i, size in enumerate(sizes_bytes):
        if size < 0:
            raise ValueError(f"tensor {i} has a negative size ({size} bytes)")
        current.append(i)
        filled += size
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0.0
    if current:
        buckets.append(current)
    return buckets


def ddp_overlap(
    bucket_bytes,
    n: int,
    backward_s: float,
    alpha_s: float,
    bandwidth_Bps: float,
) -> dict:
    """A model of DDP's overlap of gradient all-reduces with the backward pass.

    Assumptions: backward produces gradient bytes at a steady rate, so bucket i is
    ready at ``backward_s`` times the share of bytes in buckets 0..i; the all-reduces
    run one after another on one channel, each taking the α-β time of
    :func:`collective_time`; bucket i starts when it is ready and its predecessor is
    done (DDP launches buckets in order). What the step waits for after backward is
    the *exposed* communication::

        start_i = max(ready_i, end_{i-1}),  end_i = start_i + t_allreduce(bytes_i)
        exposed = max(0, end_last - backward_s)

    Few large buckets start late (the last one waits for the end of backward); many
    small ones pay the latency α each time: the bucket size trades one for the other.
    Returns ``{"calls", "ready", "start", "end", "comm_s", "exposed_s", "overlap"}``
    where ``overlap`` is the hidden share of communication time (1 = all hidden).
    """
    sizes = [float(b) for b in bucket_bytes]
    if backward_s < 0:
        raise ValueError(f"backward_s must be >= 0, got {backward_s}")
    if any(s < 0 for s in sizes):
        raise ValueError("bucket sizes must be >= 0 bytes")
    total = sum(sizes)
    ready, start, end = [], [], []
    filled, free_at = 0.0, 0.0
    for size in sizes:
        filled += size
        t_ready = backward_s * (filled / total if total else 1.0)
        t_start = max(t_ready, free_at)
        t_comm = collective_time("all_reduce", size, n, alpha_s, bandwidth_Bps)
        free_at = t_start + t_comm
        ready.append(t_ready)
        start.append(t_start)
        end.append(free_at)
    comm_s = sum(e - s for s, e in zip(start, end))
    exposed = max(0.0, (end[-1] if end else 0.0) - backward_s)
    return {
        "calls": len(sizes),
        "ready": ready,
        "start": start,
        "end": end,
        "comm_s": comm_s,
        "exposed_s": exposed,
        "overlap": 1.0 - exposed / comm_s if comm_s > 0 else 1.0,
    }


# ---- pipeline parallelism: bubble, step time, activations in flight (chapter 05) ----
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _check_pipeline(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def pipeline_bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of each stage's step under GPipe or 1F1B: ``(p-1)/(m+p-1)``
    (Huang et al. 2019, GPipe §2.2; Narayanan et al. 2021, §2.2.1).

    ``p`` stages, ``m`` microbatches, each taking ``t_f + t_b`` per stage: the step
    lasts ``(m + p - 1)(t_f + t_b)`` and each stage works ``m(t_f + t_b)`` of it.
    Interleaving ``v`` chunks per rank divides the bubble *time* by ``v``
    (§2.2.2): ``(p-1)/(v·m + p - 1)`` of the step.
    """
    _check_pipeline(p, m, v)
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_ratio(p: int, m: int, v: int = 1) -> float:
    """Bubble time over ideal compute time, the Megatron paper's form:
    ``(1/v)·(p-1)/m``. More microbatches shrink it, and so do more chunks."""
    _check_pipeline(p, m, v)
    return (p - 1) / (v * m)


def pipeline_step_time(
    p: int,
    m: int,
    t_f: float,
    t_b: float,
    *,
    v: int = 1,
    schedule: str = "1f1b",
    t_w: float = 0.0,
) -> float:
    """Step time of a balanced pipeline with free communication.

    ``t_f``, ``t_b``: forward and backward of one microbatch through one stage.
    GPipe, 1F1B: ``(m + p - 1)(t_f + t_b)``; interleaved: ``(m + (p-1)/v)(t_f +
    t_b)``; ZB-H1 (Qi et al. 2023, §3.1), backward split into ``t_b - t_w`` (input
    gradient) and ``t_w`` (weight gradient): ``m(t_f + t_b) + (p-1)(t_f + t_b -
    2·t_w)``.
    """
    _check_pipeline(p, m, v)
    key = str(schedule).lower()
    if key not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"unknown schedule {schedule!r}: expected {PIPELINE_SCHEDULES}"
        )
    if key != "interleaved" and v != 1:
        raise ValueError(f"v={v} chunks needs schedule='interleaved'")
    work = m * (t_f + t_b)
    if key == "zb-h1":
        if not 0 <= t_w <= t_b:
            raise ValueError(f"t_w must lie in [0, t_b={t_b}], got {t_w}")
        return work + (p - 1) * (t_f + t_b - 2 * t_w)
    return work + (p - 1) * (t_f + t_b) / v


def pipeline_in_flight(
    p: int, stage: int, m: int, schedule: str = "1f1b", v: int = 1
) -> int:
    """Peak number of microbatches whose activations stage ``stage`` holds at once.

    - GPipe: ``m`` (every forward runs before any backward);
    - 1F1B: ``min(p - stage, m)`` (warm-up of ``p - stage - 1`` plus one);
    - interleaved (counted in microbatch-*chunks*, each ``1/v`` of the stage):
      ``min(2(p - stage - 1) + (v - 1)·p + 1, v·m)``;
    - ZB-H1: ``min(p, m)`` (each weight pass trails its backward by ``stage``).
    """
    _check_pipeline(p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is outside 0..{p - 1}")
    key = str(schedule).lower()
    if key == "gpipe":
        return m
    if key == "1f1b":
        return min(p - stage, m)
    if key == "interleaved":
        return min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m)
    if key == "zb-h1":
        return min(p, m)
    raise ValueError(f"unknown schedule {schedule!r}: expected {PIPELINE_SCHEDULES}")


# ---- tensor parallelism: collectives and bytes per layer, step time (chapter 04) ----
@dataclass(frozen=True)
class Link:
    """One interconnect as the α-β model sees it: ``bandwidth_Bps`` is what one GPU
    can push in one direction (the bus bandwidth a ring reaches at best), ``alpha_s``
    the latency of one ring step."""

    name: str
    bandwidth_Bps: float
    alpha_s: float


# Stated assumptions, per GPU. NVLink 4 on an H100 SXM: 900 GB/s both directions
# together, 450 GB/s each way. InfiniBand NDR: 400 Gb/s = 50 GB/s, one NIC per GPU as
# in a DGX H100. Ethernet: 100 Gb/s = 12.5 GB/s per GPU over TCP. Latencies are
# typical orders of magnitude of one hop, not datasheet figures.
LINKS: dict[str, Link] = {
    "nvlink": Link("NVLink 4, in a node (450 GB/s)", 450e9, 2e-6),
    "infiniband": Link("InfiniBand NDR, across nodes (50 GB/s)", 50e9, 5e-6),
    "ethernet": Link("Ethernet 100 Gb/s, across nodes (12.5 GB/s)", 12.5e9, 25e-6),
}


def tp_collectives_per_layer(
    sequence_parallel: bool = False,
) -> dict[str, dict[str, int]]:
    """Collectives one transformer layer runs on the tp group, per pass.

    Megatron-LM (Shoeybi et al. 2019, §3): attention and MLP each have one f
    (all-reduce backward) and one g (all-reduce forward): **2 all-reduces forward and
    2 backward**. Sequence parallelism (Korthikanti et al. 2022, §4.2.2) turns each
    all-reduce into an all-gather plus a reduce-scatter placed on either side of the
    LayerNorm/dropout region: 2 of each forward and 2 of each backward.
    """
    if sequence_parallel:
        both = {"all_gather": 2, "reduce_scatter": 2}
        return {"forward": dict(both), "backward": dict(both)}
    return {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}


def tp_bytes_per_layer(
    micro_batch: int,
    seq_len: int,
    d_model: int,
    tp: int,
    *,
    bytes_per_value: float = 2,
    sequence_parallel: bool = False,
) -> dict:
    """Bytes one layer moves on the tp group per training step.

    Every collective is about the whole activation ``S = b·s·h·bytes_per_value``
    (all-gather output, reduce-scatter input, all-reduce buffer). Per rank, under
    the ring: 4 all-reduces send ``4 · 2(t-1)/t · S``; with sequence parallelism
    4 all-gathers and 4 reduce-scatters send ``8 · (t-1)/t · S``, the same bytes.
    Returns ``{"payload_bytes": S, "calls": {...}, "wire_bytes": per rank}``.
    """
    for name, value in (
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
        ("d_model", d_model),
        ("tp", tp),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    S = micro_batch * seq_len * d_model * bytes_per_value
    calls = tp_collectives_per_layer(sequence_parallel)
    wire = sum(
        count * wire_bytes(op, S, tp)
        for per_pass in calls.values()
        for op, count in per_pass.items()
    )
    return {"payload_bytes": S, "calls": calls, "wire_bytes": wire}


def tp_layer_flops(
    micro_batch: int, seq_len: int, d_model: int, d_ff: int | None = None
) -> float:
    """Training FLOPs (forward + backward = 3 × forward) of one GPT layer:
    ``3 · b·s · (8h² + 4·h·d_ff + 4·s·h)``; with ``d_ff = 4h`` this is Narayanan et
    al. 2021's ``72·b·s·h²·(1 + s/6h)`` (§5.1). Tensor parallelism divides it by t."""
    h, f = d_model, 4 * d_model if d_ff is None else d_ff
    return 3.0 * micro_batch * seq_len * (8 * h * h + 4 * h * f + 4 * seq_len * h)


def tp_step_time(
    n_layers: int,
    micro_batch: int,
    seq_len: int,
    d_model: int,
    tp: int,
    *,
    link: str | Link = "nvlink",
    peak_flops: float = 989e12,
    mfu: float = 0.5,
    d_ff: int | None = None,
    bytes_per_value: float = 2,
    sequence_parallel: bool = False,
) -> dict[str, float]:
    """Time of one micro-batch through ``n_layers`` tensor-parallel layers when the
    tp group talks over ``link`` (a key of :data:`LINKS`, or a :class:`Link`).

    Compute: :func:`tp_layer_flops` ``/ t`` at ``mfu`` of ``peak_flops`` (default an
    H100's dense bf16). Communication: the collectives of
    :func:`tp_collectives_per_layer`, each timed by :func:`collective_time`. TP's
    collectives sit on the critical path (the next matmul needs their result), so
    the two add up. Returns ``{"compute_s", "comm_s", "total_s", "comm_fraction"}``.
    """
    if isinstance(link, str):
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}: expected one of {list(LINKS)}")
        link = LINKS[link]
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    per_layer = tp_bytes_per_layer(
        micro_batch,
        seq_len,
        d_model,
        tp,
        bytes_per_value=bytes_per_value,
        sequence_parallel=sequence_parallel,
    )
    S = per_layer["payload_bytes"]
    comm_layer = sum(
        count * collective_time(op, S, tp, link.alpha_s, link.bandwidth_Bps)
        for per_pass in per_layer["calls"].values()
        for op, count in per_pass.items()
    )
    flops = tp_layer_flops(micro_batch, seq_len, d_model, d_ff) / tp
    compute = n_layers * flops / (peak_flops * mfu)
    comm_s = n_layers * comm_layer
    total = compute + comm_s
    return {
        "compute_s": compute,
        "comm_s": comm_s,
        "total_s": total,
        "comm_fraction": comm_s / total if total else 0.0,
    }


def tp_params_per_rank(
    n_layers: int,
    d_model: int,
    vocab_size: int,
    tp: int,
    *,
    seq_len: int = 0,
    d_ff: int | None = None,
    bias: bool = False,
    layernorm: bool = False,
    tied_embeddings: bool = True,
) -> int:
    """Parameters one tensor-parallel rank holds (Megatron's split, dtlab's GPT).

    Sharded over t: q, k, v, the MLP's first matrix (columns) with their biases,
    the output projections (rows), and the vocabulary, padded to a multiple of t.
    Replicated: LayerNorms, position embeddings, and the row-parallel layers'
    biases (added once, after the all-reduce). Roughly ``12Lh²/t + Vh/t``; for
    ``tp=1`` it equals :func:`model_params`.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    h, f = d_model, 4 * d_model if d_ff is None else d_ff
    for what, n in (("d_model", h), ("d_ff", f)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what}={n}")
    per_layer = (4 * h * h + 2 * h * f) // tp
    if bias:
        per_layer += (3 * h + f) // tp + 2 * h  # column biases split, row ones whole
    if layernorm:
        per_layer += 4 * h
    v_local = -(-vocab_size // tp)  # padded_vocab(V, t) / t rows
    total = n_layers * per_layer + v_local * h + seq_len * h
    if not tied_embeddings:
        total += v_local * h
    if layernorm:
        total += 2 * h
    return total


# ---- ZeRO: what dtlab.zero holds and sends per rank (chapter 03) ---------------------
def zero_states_per_rank(
    n_params: float,
    world_size: int,
    stage: int,
    precision: str = "mixed",
    optimizer: str = "adam",
    *,
    offload: bool = False,
) -> dict[str, float]:
    """Model-state bytes one rank of :class:`dtlab.zero.FullyShardedDataParallel`
    holds at the end of a backward pass: :func:`zero_memory_per_device` (ZeRO §5.1),
    plus the one thing a plain torch optimizer adds, split into device and host.

    A torch optimizer steps a tensor with a ``.grad`` of its own dtype, so when the
    master weights differ from the compute weights (``"mixed"``, or any ``offload``)
    the optimizer reads a *master-precision gradient slice* of ``4Ψ/N_s`` bytes
    (``N_s`` = N from stage 1 on, 1 at stage 0), where the paper counts the 2-byte
    gradient. FSDP2 does the same. Everything else is the paper's: params and the
    optimizer's K (master copy included) agree exactly.

    ``offload=True`` (ZeRO-Offload, Ren et al. 2021): the master slice, its
    gradient and the optimizer state are on the host (``host_*`` keys); the device
    keeps the compute weights and, at stages 0-1, the full gradients.
    Returns ``params, grads, optimizer, total`` (device) and ``host_params,
    host_grads, host_optimizer, host``.
    """
    paper = zero_memory_per_device(n_params, world_size, stage, precision, optimizer)
    precision = _norm_choice(precision, PRECISIONS, _PRECISION_ALIASES, "precision")
    b = bytes_per_param(precision, optimizer)
    n_s = world_size if stage >= 1 else 1
    master_bytes = 2 if precision == "bf16" else 4
    separate = precision == "mixed" or bool(offload)
    # the optimizer's own states (momentum, variance): K without the master copy
    states = (b.optimizer - (4 if precision == "mixed" else 0)) * n_params / n_s
    master = master_bytes * n_params / n_s if separate else 0.0
    full_grads = b.grads * n_params if stage <= 1 else 0.0
    # without a separate master, stages 0-1 step a view of the full gradients
    grad_slice = master_bytes * n_params / n_s if (separate or stage >= 2) else 0.0
    out = {"params": paper["params"], "host_params": 0.0}
    if offload:
        out.update(grads=full_grads, optimizer=0.0)
        out.update(host_grads=grad_slice, host_optimizer=states + master)
    else:
        out.update(grads=full_grads + grad_slice, optimizer=states + master)
        out.update(host_grads=0.0, host_optimizer=0.0)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["host"] = out["host_params"] + out["host_grads"] + out["host_optimizer"]
    return out


def zero_comm_per_step(
    n_params: float, world_size: int, stage: int, bytes_per_value: float = 2
) -> dict[str, float]:
    """Communication of one ZeRO-DP step per rank (ZeRO §7.2).

    Payload S = Ψ · ``bytes_per_value``: stage 0 all-reduces the gradients (S);
    stages 1-2 reduce-scatter the gradients and all-gather the updated parameters
    (S + S); stage 3 all-gathers the parameters before forward and again before
    backward and reduce-scatters the gradients (2S + S). Under the ring algorithm
    an all-reduce sends as much as a reduce-scatter plus an all-gather, so the wire
    bytes are ``2(N-1)/N · S`` for stages 0-2 and ``3(N-1)/N · S`` for stage 3: the
    paper's 2Ψ and 3Ψ (``psi_multiple``), ZeRO-3's 1.5x.

    Returns the payload bytes per op (``all_reduce``, ``reduce_scatter``,
    ``all_gather``), ``payload`` and ``wire`` totals, and ``psi_multiple``.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage!r}: expected 0, 1, 2 or 3")
    if n_params < 0 or bytes_per_value <= 0:
        raise ValueError("n_params must be >= 0 and bytes_per_value positive")
    S = n_params * bytes_per_value
    ops = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0}
    if stage == 0:
        ops["all_reduce"] = S
    else:
        ops["reduce_scatter"] = S
        ops["all_gather"] = 2 * S if stage == 3 else S
    wire = sum(wire_bytes(op, s, world_size) for op, s in ops.items())
    return {
        **ops,
        "payload": sum(ops.values()),
        "wire": wire,
        "psi_multiple": 3 if stage == 3 else 2,
    }

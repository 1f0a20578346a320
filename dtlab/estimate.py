"""The analytic model: memory per device, bytes on the wire, time per step and per run.

Taught in chapter 00 (why distribute) and used by every later chapter to put a
prediction next to each measurement; it also answers questions for models far larger
than this machine ("does 70B fit on 8 x 80 GB with ZeRO-3?"). Chapter 09 assembles
the formulas into a planner: :func:`layout_memory` and :func:`layout_traffic` for one
dp x tp x pp (x cp x ep) layout, :func:`layout_step_time` for its step, and
:func:`plan` for every layout of a cluster.

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
    "MOE_MODELS",
    "Parallelism",
    "as_parallelism",
    "model_spec",
    "stage_params",
    "layout_memory",
    "layout_traffic",
    "kv_cache_bytes",
    "serving_memory",
    "ClusterSpec",
    "PlanRow",
    "Plan",
    "layout_step_time",
    "plan",
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
    # ---- planner (chapter 09): exact counts for dtlab's GPT, and mixture of experts
    bias: bool = False
    layernorm: bool = False
    n_experts: int = 1  # MLPs per layer (mixture of experts when > 1)
    top_k: int = 1  # experts each token is sent to

    @property
    def n_params(self) -> int:
        """Parameter count from the architecture (for the public presets norms and
        biases are left out; they are well under 0.1 % of these models). A mixture of
        experts has ``n_experts`` MLPs per layer and a router of ``h·n_experts``."""
        dense = model_params(
            self.n_layers,
            self.d_model,
            self.vocab_size,
            seq_len=self.seq_len if self.learned_positions else 0,
            d_ff=self.d_ff,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            gated_mlp=self.gated_mlp,
            bias=self.bias,
            layernorm=self.layernorm,
            tied_embeddings=self.tied_embeddings,
        )
        if self.n_experts == 1:
            return dense
        extra = (self.n_experts - 1) * _mlp_params(self) + self.d_model * self.n_experts
        return dense + self.n_layers * extra


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


# ---- layouts: memory and traffic of a dp x tp x pp (x cp x ep) job (chapter 09) ------
# The planner's building blocks. Every number below is one of the formulas above,
# applied to the slice of the model one rank holds: tp_params_per_rank's split,
# pipeline_in_flight's count, Korthikanti's activations, ZeRO's states and traffic.
MOE_MODELS: dict[str, ModelPreset] = {
    # Mixtral 8x7B (Jiang et al. 2024, Table 1): 8 SwiGLU experts per layer, top-2
    "8x7B": ModelPreset(
        "Mixtral 8x7B", 32, 4096, 32, 32000, 4096, 14336, n_kv_heads=8, n_experts=8,
        top_k=2,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Parallelism:
    """A layout with the two axes the planner adds to ``Layout(dp, tp, pp)``:

    - ``cp``, context parallelism (Liu et al. 2023, ring attention; Megatron-LM's
      context parallel): the *sequence* of every micro-batch is split over cp ranks.
      Weights are replicated over cp as over dp (their gradients are reduced over
      ``dp·cp`` ranks); activations are divided by cp; each attention layer passes
      the K/V blocks around a ring.
    - ``ep``, expert parallelism (Lepikhin et al. 2020, GShard; Fedus et al. 2021):
      a mixture-of-experts layer's experts are placed on ep ranks carved out of the
      data-parallel ones (``ep`` divides ``dp·cp``); tokens travel to their experts
      and back by two all-to-alls per MoE layer forward, two backward.

    ``world_size = dp·tp·pp·cp`` (ep re-uses dp ranks, it adds none). Any object
    with ``dp``, ``tp``, ``pp`` attributes (a :class:`dtlab.topology.Layout`) is
    accepted wherever a Parallelism is, with ``cp = ep = 1``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp*cp={self.dp * self.cp}: experts are "
                "placed on data-parallel ranks"
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        extra = "".join(
            f" {a}{getattr(self, a)}" for a in ("cp", "ep") if getattr(self, a) > 1
        )
        return f"dp{self.dp} tp{self.tp} pp{self.pp}{extra}"


def as_parallelism(layout) -> Parallelism:
    """A :class:`Parallelism` from a ``Layout``, a Parallelism, or a dict."""
    if isinstance(layout, Parallelism):
        return layout
    if isinstance(layout, dict):
        return Parallelism(**layout)
    try:
        return Parallelism(
            layout.dp,
            layout.tp,
            layout.pp,
            getattr(layout, "cp", 1),
            getattr(layout, "ep", 1),
        )
    except AttributeError:
        raise ValueError(
            f"layout must be a Layout, a Parallelism or a dict of degrees, "
            f"got {layout!r}"
        ) from None


# the planner's plain words for a custom model's shape
_CUSTOM_ALIASES = {
    "layers": "n_layers", "hidden": "d_model", "heads": "n_heads",
    "vocab": "vocab_size", "sequence": "seq_len", "kv_heads": "n_kv_heads",
    "experts": "n_experts",
}  # fmt: skip


def model_spec(model) -> ModelPreset:
    """The :class:`ModelPreset` of ``model``: a preset name (``"70B"``, ``"8x7B"``),
    a preset, a :class:`dtlab.model.GPTConfig` (counted exactly: biases, LayerNorms,
    learned positions, tied head), or a dict of a custom architecture
    (``n_layers, d_model, n_heads, vocab_size, seq_len`` — or ``layers, hidden,
    heads, vocab, sequence`` — and optionally ``d_ff`` (default 4h), ``n_kv_heads``,
    ``gated_mlp``, ``n_experts``, ``top_k``...)."""
    if isinstance(model, ModelPreset):
        return model
    if isinstance(model, str):
        table = {**MODELS, **MOE_MODELS}
        if model not in table:
            raise ValueError(f"unknown model {model!r}: expected one of {list(table)}")
        return table[model]
    if isinstance(model, dict):
        d = {_CUSTOM_ALIASES.get(k, k): v for k, v in model.items()}
        d.setdefault("name", "custom")
        d.setdefault("d_ff", 4 * d.get("d_model", 0))
        d.setdefault("gated_mlp", False)
        try:
            spec = ModelPreset(**d)
        except TypeError as e:
            raise ValueError(f"bad custom model {model!r}: {e}") from None
        _check_spec(spec)
        return spec
    if hasattr(model, "tied_head") and hasattr(model, "d_model"):  # a GPTConfig
        return ModelPreset(
            "dtlab GPT",
            model.n_layers,
            model.d_model,
            model.n_heads,
            model.vocab_size,
            model.seq_len,
            model.d_ff,
            gated_mlp=False,
            learned_positions=True,
            tied_embeddings=model.tied_head,
            bias=model.bias,
            layernorm=True,
        )
    raise ValueError(
        f"model must be a preset name, a ModelPreset, a GPTConfig or a dict, "
        f"got {type(model).__name__}"
    )


def _check_spec(spec: ModelPreset) -> None:
    for name in ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "d_ff"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 1 <= spec.top_k <= spec.n_experts:
        raise ValueError(
            f"top_k={spec.top_k} must lie in 1..n_experts={spec.n_experts}"
        )


def _mlp_params(spec: ModelPreset) -> int:
    """One MLP (one expert): ``h -> d_ff -> h``, SwiGLU's third matrix if gated."""
    h, f = spec.d_model, spec.d_ff
    n = (3 if spec.gated_mlp else 2) * h * f
    if spec.bias:
        n += (2 if spec.gated_mlp else 1) * f + h
    return n


def _layer_params(spec: ModelPreset) -> dict[str, float]:
    """One block's parameters: ``dense`` (attention, norms and, without experts, the
    MLP), ``experts`` (all experts' MLPs), ``replicated`` (what tp does not split:
    LayerNorms and the row-parallel layers' biases, Megatron §3)."""
    kw = dict(
        seq_len=spec.seq_len if spec.learned_positions else 0,
        d_ff=spec.d_ff,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        gated_mlp=spec.gated_mlp,
        bias=spec.bias,
        layernorm=spec.layernorm,
        tied_embeddings=spec.tied_embeddings,
    )
    h, V = spec.d_model, spec.vocab_size
    block = model_params(1, h, V, **kw) - model_params(0, h, V, **kw)
    replicated = (4 * h if spec.layernorm else 0) + (2 * h if spec.bias else 0)
    if spec.n_experts == 1:
        return {"dense": block, "experts": 0, "replicated": replicated}
    mlp = _mlp_params(spec)
    # the router (h x E) is small and replicated; the experts replace the MLP
    return {
        "dense": block - mlp + h * spec.n_experts,
        "experts": spec.n_experts * mlp,
        "replicated": replicated + h * spec.n_experts,
    }


def _stage_layers(n_layers: int, pp: int, stage: int) -> int:
    """Blocks on pipeline rank ``stage``: ``L/pp``, the first ``L mod pp`` ranks one
    more when pp does not divide L (Llama 3's 126 layers)."""
    return n_layers // pp + (1 if stage < n_layers % pp else 0)


def stage_params(model, layout, stage: int = 0) -> dict[str, float]:
    """Parameters one rank of pipeline stage ``stage`` holds, before ZeRO.

    Tensor parallelism splits every block as :func:`tp_params_per_rank` does
    (everything but LayerNorms and row-parallel biases) and the vocabulary, padded
    to a multiple of tp; experts are split over ep (and tp); the embedding sits on
    the first stage, the final norm and the head on the last, and a tied head on a
    last stage that is not the first is a copy (dtlab.pipeline's StageModule).

    Returns ``{"blocks": per-block count, "experts": per-block expert count,
    "layers": blocks on this rank, "root": the rest, "vocab": the embedding and
    head rows within root, "total"}``.
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if not 0 <= stage < par.pp:
        raise ValueError(f"stage {stage} is outside 0..{par.pp - 1}")
    t, h = par.tp, spec.d_model
    per = _layer_params(spec)
    block = (per["dense"] - per["replicated"]) / t + per["replicated"]
    experts = per["experts"] / (t * par.ep)
    layers = _stage_layers(spec.n_layers, par.pp, stage)
    first, last = stage == 0, stage == par.pp - 1
    vocab_rows = -(-spec.vocab_size // t) * h  # padded_vocab(V, t) / t rows
    root, vocab = 0.0, 0.0
    if first:
        vocab += vocab_rows
        root += spec.seq_len * h if spec.learned_positions else 0
    if last:
        root += 2 * h if spec.layernorm else 0
        if not spec.tied_embeddings or par.pp > 1:
            vocab += vocab_rows
    root += vocab
    return {
        "blocks": block,
        "experts": experts,
        "layers": layers,
        "root": root,
        "vocab": vocab,
        "total": root + layers * (block + experts),
    }


def _dense_count(spec, par, sp, zero_stage: int) -> float:
    """Ψ of the stage's dense weights as dtlab shards them: under ZeRO every unit
    (each block, the rest; with a tied embedding across stages, the embedding or
    the head on its own, so the two copies' slices line up) padded to a multiple
    of the ``dp·cp`` group (dtlab.zero, dtlab.parallelize)."""
    if zero_stage == 0:
        return sp["root"] + sp["layers"] * sp["blocks"]
    group = par.dp * par.cp
    units = [sp["root"]]
    if par.pp > 1 and spec.tied_embeddings and sp["vocab"]:
        units = [sp["vocab"], sp["root"] - sp["vocab"]]
    pad = sum(_padded_count(u, group) for u in units)
    return pad + sp["layers"] * _padded_count(sp["blocks"], group)


def _padded_count(n: float, group: int) -> float:
    """ZeRO pads each unit to a multiple of the group (dtlab.zero)."""
    return math.ceil(n / group) * group


def _state_precision(precision: str) -> str:
    """Training precisions (dtlab.amp's names) -> :func:`bytes_per_param`'s policies:
    16-bit compute keeps fp32 master weights, the paper's mixed precision."""
    key = str(precision).lower()
    table = {"fp32": "fp32", "bf16": "mixed", "fp16": "mixed", "mixed": "mixed"}
    table["pure_bf16"] = "bf16"  # bf16 weights and states, no master copy
    if key not in table:
        raise ValueError(
            f"unknown precision {precision!r}: expected 'fp32', 'bf16', 'fp16' "
            "(both 16-bit modes keep fp32 master weights) or 'pure_bf16'"
        )
    return table[key]


def _value_bytes(precision: str) -> int:
    """Bytes of an activation, a gathered weight, a reduced gradient."""
    return 4 if _state_precision(precision) == "fp32" else 2


def _schedule_key(schedule: str) -> str:
    key = str(schedule).lower().replace("_", "-")
    if key not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"unknown schedule {schedule!r}: expected one of {PIPELINE_SCHEDULES}"
        )
    return key


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _stage_memory(
    spec, par, stage, *, zero_stage, precision, micro_batch_size, microbatches,
    schedule, chunks, checkpointing, sequence_parallel, optimizer, offload, states,
    seq_len,
) -> dict[str, float]:  # fmt: skip
    sp = stage_params(spec, par, stage)
    group = par.dp * par.cp  # replicas of every weight (ZeRO shards over them)
    expert_group = group // par.ep
    policy = _state_precision(precision)
    dense = _dense_count(spec, par, sp, zero_stage)
    out = dict.fromkeys(("params", "grads", "optimizer"), 0.0)
    host = 0.0
    parts = [(dense, group)]
    if sp["experts"]:
        parts.append((sp["layers"] * sp["experts"], expert_group))
    for psi, n in parts:
        # DDP (stage 0) keeps 16-bit gradients; its optimizer's fp32 copy of them
        # lives only during the step, so the paper's count is what it holds
        if states == "paper" or (zero_stage == 0 and not offload):
            st = zero_memory_per_device(psi, n, zero_stage, policy, optimizer)
        else:
            st = zero_states_per_rank(
                psi, n, zero_stage, policy, optimizer, offload=offload
            )
            host += st["host"]
        for k in out:
            out[k] += st[k]
    # activations: Korthikanti per layer, for every microbatch (chunk) in flight
    s = seq_len or spec.seq_len
    b, bpv = micro_batch_size, _value_bytes(precision)
    layer_kw = dict(tp=par.tp, sequence_parallel=sequence_parallel)
    per_layer = activation_bytes_per_layer(
        s, b, spec.d_model, spec.n_heads, recompute=checkpointing,
        bytes_per_value=bpv, **layer_kw,
    ) / par.cp  # fmt: skip
    if spec.n_experts > 1 and checkpointing != "full":
        # each token runs top_k experts: the MLP's 19sbh of the 34, k times
        per_layer += (
            (spec.top_k - 1) * 19 * s * b * spec.d_model * bpv / 2 / (par.tp * par.cp)
        )
    if par.pp > 1:
        key = _schedule_key(schedule)
        v = chunks if key == "interleaved" else 1
        in_flight = pipeline_in_flight(par.pp, stage, microbatches, key, v)
        layers_in_flight = in_flight * sp["layers"] / v
        last_in_flight = 1 if key != "gpipe" else microbatches
    else:
        layers_in_flight, last_in_flight = sp["layers"], 1
    acts = layers_in_flight * per_layer
    if checkpointing == "full" and sp["layers"]:
        # backward recomputes one layer at a time: its whole activations, once
        acts += activation_bytes_per_layer(
            s, b, spec.d_model, spec.n_heads, bytes_per_value=bpv, **layer_kw
        ) / par.cp  # fmt: skip
    if stage == par.pp - 1:
        # beyond Korthikanti's blocks: the final norm's and the head's inputs
        # (2sbh) and the fp32 log-softmax of the cross-entropy (4·sb·V/t bytes)
        tokens = s * b / par.cp
        vocab = -(-spec.vocab_size // par.tp)
        acts += last_in_flight * tokens * (2 * spec.d_model * bpv + 4 * vocab)
    out["activations"] = acts
    out["total"] = sum(out.values())
    if offload:
        out["host"] = host
    return out


def layout_memory(
    model,
    layout,
    *,
    zero_stage: int = 0,
    precision: str = "fp32",
    micro_batch_size: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    chunks: int = 1,
    checkpointing: str = "none",
    sequence_parallel: bool = False,
    stage: int | None = None,
    optimizer: str = "adam",
    offload: bool = False,
    states: str = "dtlab",
    seq_len: int | None = None,
) -> dict[str, float]:
    """Bytes one device holds under ``layout``, by category:
    ``{"params", "grads", "optimizer", "activations", "total"}`` (and ``"host"``
    with ``offload``), for pipeline stage ``stage`` or, by default, the most loaded.

    - Model states: the stage's slice of the model (:func:`stage_params`: tp and
      pp split it, ep splits the experts), then ZeRO ``zero_stage`` over the
      ``dp·cp`` ranks that replicate it. ``states="dtlab"`` counts what dtlab's
      implementation holds (:func:`zero_states_per_rank`: exact against
      dtlab.memory's measurement, units padded to the group); ``states="paper"``
      is ZeRO §5.1's ``2Ψ + 2Ψ + KΨ`` split (:func:`zero_memory_per_device`).
      The two differ only for ZeRO under 16-bit precision, by the fp32 gradient
      slice (``4Ψ/N``) the optimizer reads; DDP (stage 0) holds the paper's
      count. Adam's per-tensor step counter (4 bytes a tensor) is left out.
    - Activations: Korthikanti et al. 2022 per layer
      (:func:`activation_bytes_per_layer`: ``sbh(34 + 5as/h)``, tp and sequence
      parallelism, ``checkpointing`` "none" | "selective" | "full"), divided by cp,
      times the layers of every micro-batch the stage holds at its peak
      (:func:`pipeline_in_flight`; one micro-batch without pipelining: gradient
      accumulation runs each backward right after its forward). Full
      checkpointing adds one layer's activations (the one being recomputed, live
      during its backward only); the last stage adds the head's inputs and the
      fp32 log-softmax. An upper bound
      for dtlab's GPT, which has no dropout (the paper counts dropout masks).

    ``precision``: "fp32", or "bf16"/"fp16" (16-bit compute, fp32 master weights,
    2-byte activations), or "pure_bf16". ``microbatches``: per optimizer step and
    dp rank (pipeline micro-batches, or gradient accumulation without pp).
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {zero_stage!r}: expected 0, 1, 2 or 3")
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("microbatches", microbatches),
        ("chunks", chunks),
    ):
        _check_count(name, value)
    if states not in ("dtlab", "paper"):
        raise ValueError(f"states must be 'dtlab' or 'paper', got {states!r}")
    if offload and states == "paper":
        raise ValueError("offload is modelled with states='dtlab' only")
    checkpointing = _norm_choice(checkpointing, RECOMPUTE, {}, "checkpointing")
    if par.pp > 1:
        _schedule_key(schedule)
    kw = dict(
        zero_stage=zero_stage, precision=precision,
        micro_batch_size=micro_batch_size, microbatches=microbatches,
        schedule=schedule, chunks=chunks, checkpointing=checkpointing,
        sequence_parallel=sequence_parallel, optimizer=optimizer, offload=offload,
        states=states, seq_len=seq_len,
    )  # fmt: skip
    if stage is not None:
        return _stage_memory(spec, par, stage, **kw)
    # the most loaded is the first (most layers and micro-batches in flight) or the
    # last (the head); the stages between hold no more than the first
    per_stage = [_stage_memory(spec, par, s, **kw) for s in sorted({0, par.pp - 1})]
    return max(per_stage, key=lambda m: m["total"])


def _stage_traffic(
    spec, par, stage, *, zero_stage, precision, micro_batch_size, microbatches,
    sequence_parallel, chunks, seq_len,
) -> dict[str, float]:  # fmt: skip
    bpv = _value_bytes(precision)
    k, b = microbatches, micro_batch_size
    s = seq_len or spec.seq_len
    h = spec.d_model
    sp = stage_params(spec, par, stage)
    group = par.dp * par.cp
    out = {"dp": 0.0, "tp": 0.0, "pp": 0.0}
    # dp (and cp: the same weights): gradients, and ZeRO's gathers
    dense = _dense_count(spec, par, sp, zero_stage)
    parts = [(dense, group)]
    if sp["experts"]:
        parts.append((sp["layers"] * sp["experts"], group // par.ep))
    # ZeRO 2-3 reduce-scatter after every backward (micro-batch, or pipeline
    # micro-batch); DDP and ZeRO 0-1 accumulate full gradients, sync once per step
    per_mb = k if zero_stage >= 2 else 1
    for psi, n in parts:
        if n == 1:
            continue
        one = zero_comm_per_step(psi, n, zero_stage, bpv)
        out["dp"] += per_mb * (
            wire_bytes("all_reduce", one["all_reduce"], n)
            + wire_bytes("reduce_scatter", one["reduce_scatter"], n)
        ) + (per_mb if zero_stage == 3 else 1) * wire_bytes(
            "all_gather", one["all_gather"], n
        )
    tokens = b * s // par.cp  # this rank's tokens of one micro-batch
    first, last = stage == 0, stage == par.pp - 1
    # tp: Megatron's 2 + 2 collectives per block, the vocabulary-parallel
    # embedding (g) and head (f), and the loss's three small all-reduces
    if par.tp > 1:
        t = par.tp
        S = tokens * h * bpv
        per_block = tp_bytes_per_layer(
            b, s // par.cp, h, t, bytes_per_value=bpv,
            sequence_parallel=sequence_parallel,
        )["wire_bytes"]  # fmt: skip
        mb = sp["layers"] * per_block
        if first:  # embedding: g (SP: reduce-scatter forward, all-gather back)
            mb += wire_bytes("all_reduce", S, t)
        if last:
            mb += wire_bytes("all_reduce", S, t)  # head: f (SP: gather + scatter)
            mb += 3 * wire_bytes("all_reduce", tokens * bpv, t)  # max, sum, z_t
        out["tp"] = k * mb
        if sequence_parallel:
            # the replicated weights of the sequence-split regions (norms,
            # row-parallel biases, positions) get their gradients summed over tp
            repl = sp["layers"] * _layer_params(spec)["replicated"]
            if first and spec.learned_positions:
                repl += s * h
            if last and spec.layernorm:
                repl += 2 * h
            out["tp"] += wire_bytes("all_reduce", repl * bpv, t)
    # pp: activations forward and gradients backward at every chunk boundary
    if par.pp > 1:
        S = tokens * h * bpv / (par.tp if sequence_parallel else 1)
        v = chunks
        sends = (v - (1 if last else 0)) + (v - (1 if first else 0))
        out["pp"] = k * sends * S
        if spec.tied_embeddings and (first or last):
            # the embedding group sums the two copies' gradients: whole (in the
            # compute dtype) after DDP, or ZeRO's reduced slices (master dtype)
            rows = -(-spec.vocab_size // par.tp) * h
            payload = rows * bpv
            if zero_stage >= 1:
                master = 2 if _state_precision(precision) == "bf16" else 4
                payload = _padded_count(rows, group) / group * master
            out["pp"] += wire_bytes("all_reduce", payload, 2)
    if par.cp > 1:
        # ring attention: K and V blocks go round the ring (cp-1 hops) forward;
        # backward sends them again with their gradients: 3x the forward
        kv = h * (spec.n_kv_heads or spec.n_heads) // spec.n_heads
        S_kv = 2 * b * s * kv * bpv / par.tp
        out["cp"] = k * sp["layers"] * 3 * wire_bytes("all_gather", S_kv, par.cp)
    if par.ep > 1 and spec.n_experts > 1:
        # dispatch and combine forward, their transposes backward: 4 all-to-alls
        S = tokens * spec.top_k * h * bpv
        out["ep"] = k * sp["layers"] * 4 * wire_bytes("all_to_all", S, par.ep)
    return out


def layout_traffic(
    model,
    layout,
    *,
    zero_stage: int = 0,
    precision: str = "fp32",
    micro_batch_size: int = 1,
    microbatches: int = 1,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    chunks: int = 1,
    stage: int | None = None,
    seq_len: int | None = None,
) -> dict[str, float]:
    """Wire bytes one rank sends per optimizer step, by axis: ``{"dp", "tp", "pp"}``
    (plus ``"cp"`` and ``"ep"`` when those axes are used), for pipeline stage
    ``stage`` or, by default, the busiest rank on each axis.

    - dp: :func:`zero_comm_per_step` on the stage's Ψ over the ``dp·cp`` replicas
      (2Ψ, ZeRO-3 3Ψ, times the ring's (N-1)/N). ZeRO-2 and -3 do not keep the
      full gradient, so with several micro-batches (gradient accumulation, or a
      pipeline's) they pay their reduce-scatter (and ZeRO-3 its gathers) per
      micro-batch; DDP and ZeRO-0/1 accumulate and pay once per step.
    - tp: :func:`tp_bytes_per_layer` per block and micro-batch (2 + 2 all-reduces,
      or their all-gather/reduce-scatter halves under sequence parallelism), plus
      the vocabulary-parallel embedding and head and the loss's three all-reduces
      of ``b·s`` values.
    - pp: one activation forward and one gradient backward per micro-batch at
      every stage boundary the rank owns (``chunks`` per rank when interleaved),
      plus the tied-embedding all-reduce between the first and the last stage
      (under ZeRO, of the reduced fp32 slices).
    - cp: ring attention's K/V: ``3·(cp-1)/cp · 2·b·s·h_kv·bytes`` per layer.
    - ep: 4 all-to-alls of ``b·s·top_k·h·bytes`` per MoE layer.

    Gradients and 16-bit activations travel in the compute dtype (2 bytes under
    "bf16"/"fp16", 4 under "fp32").
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {zero_stage!r}: expected 0, 1, 2 or 3")
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("microbatches", microbatches),
        ("chunks", chunks),
    ):
        _check_count(name, value)
    _value_bytes(precision)
    if par.pp > 1:
        _schedule_key(schedule)  # every schedule moves the same bytes
    kw = dict(
        zero_stage=zero_stage, precision=precision,
        micro_batch_size=micro_batch_size, microbatches=microbatches,
        sequence_parallel=sequence_parallel, chunks=chunks, seq_len=seq_len,
    )  # fmt: skip
    if stage is not None:
        return _stage_traffic(spec, par, stage, **kw)
    # the first (most layers, the embedding), a middle one (sends both ways) and the
    # last (the head) bound every stage on every axis
    stages = sorted({0, min(1, par.pp - 1), par.pp - 1})
    per_stage = [_stage_traffic(spec, par, s, **kw) for s in stages]
    return {k: max(t[k] for t in per_stage) for k in per_stage[0]}


# ---- memory techniques (chapter 08): the price of recomputation and offload --------
def recompute_overhead(
    mode: str, seq_len: int, d_model: int, *, early_stop: bool = False
) -> float:
    """Extra compute of activation checkpointing, as a fraction of a training step
    without it (Korthikanti et al. 2022, §4 and §5.3), in matmul FLOPs.

    A layer's forward costs ``F = 24·b·s·h² + 4·b·s²·h`` FLOPs (the linear layers,
    then ``QK^T`` and ``softmax·V``) and its backward ``2F``: a step is ``3F``.
    ``"full"`` runs the forward once more: ``F / 3F = 1/3``. ``"selective"`` re-runs
    ``QK^T`` and ``softmax·V``: ``4bs²h / 3F = s / (18h + 3s)``, a few per cent at
    ``s ≈ h``.

    ``early_stop=True`` counts what :func:`torch.utils.checkpoint.checkpoint` really
    re-runs: it stops once every tensor backward needs is rebuilt, so the last matmul
    of the checkpointed piece, whose output nobody saved, is skipped (``mlp.proj``,
    ``8bsh²``, under full; ``softmax·V``, ``2bs²h``, under selective). The
    embeddings, head and loss are left out (never recomputed). Softmax and masking
    are not FLOPs here; where they are memory-bound, selective recomputation costs
    more time than this share.
    """
    mode = _norm_choice(mode, RECOMPUTE, {}, "recompute mode")
    if seq_len <= 0 or d_model <= 0:
        raise ValueError(f"seq_len and d_model must be positive: {seq_len}, {d_model}")
    s, h = seq_len, d_model
    forward = 24 * h + 4 * s  # F / (b·s·h)
    if mode == "full":
        extra = forward - (8 * h if early_stop else 0)
    elif mode == "selective":
        extra = 2 * s if early_stop else 4 * s
    else:
        extra = 0
    return extra / (3 * forward)


def offload_bytes_per_step(
    n_params: float, dp: int, *, grad_bytes: int = 4, param_bytes: int = 4
) -> dict[str, float]:
    """Host <-> device (PCIe) bytes one rank moves per optimizer step under ZeRO
    with CPU offload (ZeRO-Offload, Ren et al. 2021, §4.1): its ``1/dp`` slice of
    the gradients goes to the host, where the optimizer steps the fp32 master slice,
    and the updated slice of the weights comes back.

    ``{"to_host": Ψ/dp·grad_bytes, "to_device": Ψ/dp·param_bytes, "total": ...}``
    (use 2 for 16-bit gradients or weights). Divide by the link's bandwidth
    (PCIe 4.0 x16 ≈ 25 GB/s one way, 5.0 ≈ 50 GB/s) for the time it adds where the
    copies do not overlap with compute.
    """
    if n_params <= 0:
        raise ValueError(f"n_params must be positive, got {n_params}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if grad_bytes <= 0 or param_bytes <= 0:
        raise ValueError("grad_bytes and param_bytes must be positive")
    to_host = n_params / dp * grad_bytes
    to_device = n_params / dp * param_bytes
    return {"to_host": to_host, "to_device": to_device, "total": to_host + to_device}


# ---- serving: weights and the KV cache (chapter 09) ----------------------------------
def kv_cache_bytes(
    model, batch: int, context: int, *, tp: int = 1, bytes_per_value: float = 2
) -> float:
    """Bytes of the key/value cache of ``batch`` sequences of ``context`` tokens:
    ``2 · L · batch · context · h_kv · bytes / tp`` (a key and a value per layer
    and token; grouped-query attention shrinks ``h_kv = h · n_kv_heads/n_heads``;
    tensor parallelism splits the heads)."""
    spec = model_spec(model)
    for name, value in (("batch", batch), ("context", context), ("tp", tp)):
        _check_count(name, value)
    kv = spec.d_model * (spec.n_kv_heads or spec.n_heads) / spec.n_heads
    return 2 * spec.n_layers * batch * context * kv * bytes_per_value / tp


def serving_memory(
    model, *, tp: int = 1, batch: int = 1, context: int | None = None,
    bytes_per_value: float = 2,
) -> dict[str, float]:  # fmt: skip
    """Bytes per device to *serve* ``model`` with tensor parallelism ``tp``: the
    16-bit weights (``2Ψ/tp``; no gradients, no optimizer state) and the KV cache
    (:func:`kv_cache_bytes`). Activations of one decoding step are negligible next
    to these. Returns ``{"weights", "kv_cache", "total"}``."""
    spec = model_spec(model)
    context = context or spec.seq_len
    weights = bytes_per_value * spec.n_params / tp
    kv = kv_cache_bytes(spec, batch, context, tp=tp, bytes_per_value=bytes_per_value)
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


# ---- the planner: which layouts fit, and what a step costs (chapter 09) --------------
@dataclass(frozen=True)
class ClusterSpec:
    """The machines: ``n_gpus`` accelerators, ``gpus_per_node`` per node joined by
    ``intra`` (NVLink), nodes joined by ``inter`` (InfiniBand, Ethernet). A group
    whose ranks all sit in one node talks over ``intra``, any other over ``inter``
    (its slowest link). Ranks are placed Megatron's way: tp fastest, then cp, dp,
    pp, so tp groups are the first to stay inside a node."""

    n_gpus: int
    gpus_per_node: int = 8
    intra: Link = LINKS["nvlink"]
    inter: Link = LINKS["infiniband"]
    # ZeRO-Offload: PCIe 5 x16 to the host (~50 GB/s each way), and the host
    # memory bandwidth a CPU Adam streams its states at
    pcie_Bps: float = 50e9
    host_Bps: float = 100e9

    def __post_init__(self) -> None:
        _check_count("n_gpus", self.n_gpus)
        _check_count("gpus_per_node", self.gpus_per_node)

    def link(self, span: int) -> Link:
        """The link of a group whose ranks span ``span`` consecutive ranks."""
        return self.intra if span <= self.gpus_per_node else self.inter


@dataclass
class PlanRow:
    """One layout the planner considered: its knobs, bytes per device by category,
    the step time split into compute, communication and bubble, and ``why`` it was
    rejected (empty when it fits)."""

    layout: Parallelism
    zero_stage: int
    micro_batch_size: int
    microbatches: int
    schedule: str
    chunks: int
    checkpointing: str
    sequence_parallel: bool
    memory: dict
    traffic: dict
    compute_s: float
    comm_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    fits: bool
    why: str = ""

    def as_dict(self) -> dict:
        """A flat row for a table (GB and seconds)."""
        par = self.layout
        return {
            "dp": par.dp, "tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep,
            "zero": self.zero_stage, "mbs": self.micro_batch_size,
            "m": self.microbatches, "schedule": self.schedule,
            "checkpointing": self.checkpointing, "sp": self.sequence_parallel,
            **{f"{k}_GB": v / GB for k, v in self.memory.items()},
            "compute_s": self.compute_s, "comm_s": self.comm_s,
            "bubble_s": self.bubble_s, "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "fits": self.fits, "why": self.why,
        }  # fmt: skip


@dataclass
class Plan:
    """What :func:`plan` found: ``fits`` (fastest first) and ``rejected`` (each with
    its ``why``), and the assumptions it used."""

    fits: list
    rejected: list
    assumptions: dict

    @property
    def best(self) -> PlanRow | None:
        return self.fits[0] if self.fits else None

    def table(self, n: int = 10, *, rejected: bool = False) -> list[dict]:
        rows = self.rejected if rejected else self.fits
        return [r.as_dict() for r in rows[:n]]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _flops_d_ff(spec: ModelPreset) -> float:
    """The ``d_ff`` that makes :func:`tp_layer_flops`' two-matrix MLP count a
    gated MLP's three matrices and a MoE's ``top_k`` experts per token."""
    return spec.d_ff * (1.5 if spec.gated_mlp else 1.0) * spec.top_k


def layout_step_time(
    model,
    layout,
    *,
    gpu: GPU,
    cluster: ClusterSpec,
    zero_stage: int = 0,
    precision: str = "bf16",
    micro_batch_size: int = 1,
    microbatches: int = 1,
    schedule: str = "1f1b",
    chunks: int = 1,
    checkpointing: str = "none",
    sequence_parallel: bool = False,
    seq_len: int | None = None,
    mfu: float = 0.5,
    dp_overlap: float = 0.8,
    offload: bool = False,
) -> dict[str, float]:
    """Step time of one layout, split into ``compute_s``, ``comm_s`` (exposed) and
    ``bubble_s``; ``step_s`` is their sum.

    - Compute: :func:`tp_layer_flops` (forward + backward, ``3 × 2·b·s·params``
      plus attention's s² term) for the stage's layers, divided by ``tp·cp``, at
      ``mfu`` of the GPU's peak; the head's ``6·b·s·h·V/tp``; checkpointing adds
      :func:`recompute_overhead` (full: a forward; selective: the score matmuls).
    - Tensor parallelism: the collectives of :func:`tp_step_time`, on the critical
      path; context parallelism's K/V ring and expert parallelism's all-to-alls
      likewise (:func:`collective_time` each); pipeline sends, one per micro-batch
      and boundary. Each on the intra-node link if its group fits in a node.
    - The pipeline: :func:`pipeline_step_time` with those per-micro-batch times;
      its excess over ``m·(t_f + t_b)`` is the bubble.
    - Data parallelism: :func:`zero_comm_per_step`'s collectives; ``dp_overlap``
      of them hide behind the last backward (chapter 02's overlap), the rest is
      exposed.
    - ``offload`` (ZeRO-Offload, Ren et al. 2021): the fp32 gradient slice goes to
      the host and the weights come back over PCIe
      (:func:`offload_bytes_per_step`), and the CPU's Adam streams master weights,
      moments and gradient (28 bytes per parameter of the slice) at the host's
      memory bandwidth; counted as communication.
    """
    spec, par = model_spec(model), as_parallelism(layout)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    if not 0 <= dp_overlap <= 1:
        raise ValueError(f"dp_overlap must be in [0, 1], got {dp_overlap}")
    s = seq_len or spec.seq_len
    b, m, bpv = micro_batch_size, microbatches, _value_bytes(precision)
    h, t = spec.d_model, par.tp
    key = _schedule_key(schedule) if par.pp > 1 else "1f1b"
    v = chunks if key == "interleaved" else 1
    rate = gpu.peak_bf16_flops * mfu
    layers = _stage_layers(spec.n_layers, par.pp, 0)  # the most loaded stage
    # compute of one micro-batch through this stage
    layer_flops = tp_layer_flops(b, s, h, _flops_d_ff(spec)) / (t * par.cp)
    checkpointing = _norm_choice(checkpointing, RECOMPUTE, {}, "checkpointing")
    # chapter 08's price of recomputation, a share of the layer's 3F
    recompute = recompute_overhead(checkpointing, s, h) * layer_flops
    flops = layers * (layer_flops + recompute)
    flops += 6 * b * s * h * spec.vocab_size / (t * par.cp) / par.pp  # head, spread
    compute_mb = flops / rate
    # communication on the critical path, per micro-batch
    tokens = b * s // par.cp
    comm_mb = 0.0
    if t > 1:
        link = cluster.link(t)
        comm_mb += tp_step_time(
            layers, b, s // par.cp, h, t, link=link, peak_flops=gpu.peak_bf16_flops,
            mfu=mfu, bytes_per_value=bpv, sequence_parallel=sequence_parallel,
        )["comm_s"]  # fmt: skip
    if par.cp > 1:
        link = cluster.link(t * par.cp)
        kv = h * (spec.n_kv_heads or spec.n_heads) / spec.n_heads
        S_kv = 2 * b * s * kv * bpv / t
        comm_mb += (
            layers
            * 3
            * collective_time(
                "all_gather", S_kv, par.cp, link.alpha_s, link.bandwidth_Bps
            )
        )
    if par.ep > 1 and spec.n_experts > 1:
        link = cluster.link(t * par.cp * par.ep)
        S = tokens * spec.top_k * h * bpv
        comm_mb += (
            layers
            * 4
            * collective_time("all_to_all", S, par.ep, link.alpha_s, link.bandwidth_Bps)
        )
    p2p = 0.0
    if par.pp > 1:
        link = cluster.link(t * par.cp * par.dp + 1)  # neighbours one stage apart
        S = tokens * h * bpv / (t if sequence_parallel else 1)
        p2p = 2 * v * (link.alpha_s + S / link.bandwidth_Bps)  # forward + backward
    t_f = (compute_mb + comm_mb) / 3 + p2p / 2
    t_b = 2 * (compute_mb + comm_mb) / 3 + p2p / 2
    if par.pp > 1:
        step = pipeline_step_time(par.pp, m, t_f, t_b, v=v, schedule=key)
    else:
        step = m * (t_f + t_b)
    bubble = step - m * (t_f + t_b)
    # data parallelism: once per step (ZeRO 2-3: reductions per micro-batch);
    # expert weights only among the dp·cp/ep ranks that hold the same experts
    group = par.dp * par.cp
    dp_s = 0.0
    sp0 = stage_params(spec, par, 0)
    parts = [(_dense_count(spec, par, sp0, zero_stage), group)]
    if sp0["experts"]:
        parts.append((sp0["layers"] * sp0["experts"], group // par.ep))
    per_mb = m if zero_stage >= 2 else 1
    for psi, n in parts:
        if n == 1:
            continue
        link = cluster.link(t * n)
        ops = zero_comm_per_step(psi, n, zero_stage, bpv)
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            if ops[op]:
                times = per_mb if (op == "reduce_scatter" or zero_stage == 3) else 1
                dp_s += times * collective_time(
                    op, ops[op], n, link.alpha_s, link.bandwidth_Bps
                )
    hidden = min(dp_overlap * dp_s, t_b)
    exposed_dp = dp_s - hidden
    if offload:
        psi = stage_params(spec, par, 0)["total"]
        n_s = group if zero_stage else 1
        pcie = offload_bytes_per_step(psi, n_s, grad_bytes=4, param_bytes=bpv)
        exposed_dp += pcie["total"] / cluster.pcie_Bps
        exposed_dp += 28 * psi / n_s / cluster.host_Bps  # CPU Adam streams 28 B
    compute = m * compute_mb
    comm = m * (comm_mb + p2p) + exposed_dp
    total = step + exposed_dp
    return {
        "compute_s": compute,
        "comm_s": comm,
        "bubble_s": bubble,
        "step_s": total,
        "dp_comm_s": dp_s,
        "dp_exposed_s": exposed_dp,
    }


def _why_not(mem: dict, usable: float, gpu: GPU) -> str:
    """A short reason: how far over, and the biggest category."""
    biggest = max(("params", "grads", "optimizer", "activations"), key=mem.get)
    return (
        f"needs {mem['total'] / GB:.1f} GB per GPU, {usable / GB:.1f} GB usable on "
        f"{gpu.name}; largest: {biggest} {mem[biggest] / GB:.1f} GB"
    )


def plan(
    model,
    *,
    gpu: GPU | str = "H100-80GB",
    cluster: ClusterSpec | None = None,
    n_gpus: int | None = None,
    global_batch: int = 1024,
    seq_len: int | None = None,
    precision: str = "bf16",
    zero_stages=(0, 1, 2, 3),
    micro_batch_sizes=(1, 2, 4),
    checkpointing=("none", "selective", "full"),
    schedules=("1f1b",),
    chunks: int = 2,
    cp_options=(1,),
    ep_options=(1,),
    max_tp: int | None = None,
    sequence_parallel: bool = True,
    mfu: float = 0.5,
    dp_overlap: float = 0.8,
    memory_reserve: float = 0.1,
    offload: bool = False,
) -> Plan:
    """Layouts of ``model`` on ``cluster`` for a ``global_batch`` of sequences that
    fit in ``gpu``'s memory, fastest first, with the rejected ones and why.

    Every combination of tp (a divisor of the heads, at most ``max_tp``, default
    two nodes' worth), pp (at most one stage per layer), cp and ep (from the
    options), dp (the rest of ``n_gpus``), ZeRO stage, micro-batch size,
    activation checkpointing and pipeline schedule is priced with
    :func:`layout_memory` (bytes per device by category, most loaded stage) and
    :func:`layout_step_time` (compute, communication, bubble). A layout fits if
    its total stays under ``(1 - memory_reserve)`` of the GPU's memory (the rest
    goes to the CUDA context, allocator fragmentation and communication buffers).
    Micro-batches per step ``m = global_batch / (dp · micro_batch)`` must be a
    whole number, and at least pp with a pipeline. ``sequence_parallel`` applies
    whenever tp > 1. ``states="paper"`` accounting (ZeRO §5.1) is used, the
    numbers an interviewer expects.

    The assumptions are returned with the plan (``plan.assumptions``): MFU, the
    links, the overlap of data-parallel communication, the memory reserve.
    """
    spec = model_spec(model)
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"unknown gpu {gpu!r}: expected one of {list(GPUS)}")
        gpu = GPUS[gpu]
    if cluster is None:
        if n_gpus is None:
            raise ValueError("give cluster=ClusterSpec(...) or n_gpus")
        cluster = ClusterSpec(n_gpus)
    elif n_gpus is not None and n_gpus != cluster.n_gpus:
        raise ValueError(f"n_gpus={n_gpus} but the cluster has {cluster.n_gpus}")
    _check_count("global_batch", global_batch)
    if not 0 <= memory_reserve < 1:
        raise ValueError(f"memory_reserve must be in [0, 1), got {memory_reserve}")
    s = seq_len or spec.seq_len
    world = cluster.n_gpus
    usable = gpu.memory_bytes * (1 - memory_reserve)
    max_tp = max_tp or 2 * cluster.gpus_per_node
    fits, rejected = [], []
    for cp in cp_options:
        for tp in _divisors(world):
            if tp > max_tp or spec.n_heads % tp or world % (tp * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > spec.n_layers:
                    continue
                dp = world // (tp * cp * pp)
                for ep in ep_options:
                    if (dp * cp) % ep or (ep > 1 and spec.n_experts % ep):
                        continue
                    par = Parallelism(dp, tp, pp, cp, ep)
                    for row in _price(
                        spec, par, gpu, cluster, global_batch, s, precision,
                        zero_stages, micro_batch_sizes, checkpointing,
                        schedules if pp > 1 else ("1f1b",), chunks,
                        sequence_parallel and tp > 1, mfu, dp_overlap, usable,
                        offload,
                    ):  # fmt: skip
                        (fits if row.fits else rejected).append(row)
    fits.sort(key=lambda r: (r.step_s, r.memory["total"]))
    rejected.sort(key=lambda r: r.memory["total"])
    assumptions = {
        "model": spec.name,
        "params": spec.n_params,
        "gpu": gpu.name,
        "gpu_memory_GB": gpu.memory_bytes / GB,
        "usable_GB": usable / GB,
        "peak_TFLOPs": gpu.peak_bf16_flops / 1e12,
        "mfu": mfu,
        "n_gpus": world,
        "gpus_per_node": cluster.gpus_per_node,
        "intra_GBps": cluster.intra.bandwidth_Bps / GB,
        "inter_GBps": cluster.inter.bandwidth_Bps / GB,
        "global_batch": global_batch,
        "seq_len": s,
        "precision": precision,
        "dp_overlap": dp_overlap,
    }
    return Plan(fits, rejected, assumptions)


def _price(
    spec, par, gpu, cluster, global_batch, s, precision, zero_stages,
    micro_batch_sizes, checkpointing, schedules, chunks, sp, mfu, dp_overlap,
    usable, offload,
):  # fmt: skip
    """Every knob setting of one layout, as PlanRows."""
    for mbs in micro_batch_sizes:
        per_rank = global_batch / (par.dp * mbs)
        if per_rank != int(per_rank) or per_rank < max(1, par.pp):
            continue
        m = int(per_rank)
        for sched in schedules:
            v = chunks if _schedule_key(sched) == "interleaved" else 1
            if v > 1 and (m % par.pp or spec.n_layers < par.pp * v):
                continue
            for ck in checkpointing:
                # without replicas there is nothing for ZeRO to shard
                for zero in zero_stages if par.dp * par.cp > 1 else (0,):
                    kw = dict(
                        zero_stage=zero, precision=precision, micro_batch_size=mbs,
                        microbatches=m, schedule=sched, chunks=v, checkpointing=ck,
                        sequence_parallel=sp, seq_len=s,
                    )  # fmt: skip
                    mem = layout_memory(
                        spec, par, **kw, offload=offload,
                        states="dtlab" if offload else "paper",
                    )  # fmt: skip
                    traffic = layout_traffic(
                        spec, par, **{k: kw[k] for k in kw if k != "checkpointing"}
                    )
                    time = layout_step_time(
                        spec, par, gpu=gpu, cluster=cluster, mfu=mfu,
                        dp_overlap=dp_overlap, offload=offload, **kw,
                    )  # fmt: skip
                    fits = mem["total"] <= usable
                    tokens = global_batch * s
                    model_flops = training_flops(spec.n_params, tokens)
                    yield PlanRow(
                        layout=par, zero_stage=zero, micro_batch_size=mbs,
                        microbatches=m, schedule=sched, chunks=v,
                        checkpointing=ck, sequence_parallel=sp, memory=mem,
                        traffic=traffic, compute_s=time["compute_s"],
                        comm_s=time["comm_s"], bubble_s=time["bubble_s"],
                        step_s=time["step_s"],
                        tokens_per_s=tokens / time["step_s"],
                        mfu=model_flops
                        / (par.world_size * gpu.peak_bf16_flops * time["step_s"]),
                        fits=fits, why="" if fits else _why_not(mem, usable, gpu),
                    )  # fmt: skip

"""Parameter counts and model presets.

:func:`model_params` makes the textbook ``12·L·h² + V·h`` exact (GQA, SwiGLU,
biases, norms, tied head); :data:`MODELS` and :data:`MOE_MODELS` hold public
architectures; :func:`model_spec` turns a preset name, a ``GPTConfig`` or a dict
into a :class:`ModelPreset`.

Taught in chapter 00 (why distribute); the mixture-of-experts presets,
:func:`model_spec` and the per-block split serve chapter 09's planner.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    rmsnorm: bool = False,
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
      block and a final one, weight and bias each; ``rmsnorm``: the same three
      norms as RMSNorm, a weight each (LLaMA, Llama 3: ``2h`` a block, ``h`` final);
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
    if rmsnorm:
        per_layer += 2 * h  # two RMSNorms: a weight each
    total = n_layers * per_layer + vocab_size * h + seq_len * h
    if layernorm:
        total += 2 * h  # final LayerNorm
    if rmsnorm:
        total += h  # final RMSNorm
    if not tied_embeddings:
        total += vocab_size * h
    return total


@dataclass(frozen=True)
class ModelPreset:
    """A public architecture, enough of it to count parameters, FLOPs and
    activations.

    Two families are counted exactly: GPT-style (``gated_mlp=False``, ``d_ff =
    4h``, multi-head attention, LayerNorm, ``dropout=True``: Korthikanti et al.
    2022's ``sbh(34 + 5as/h)``) and Llama-style (``gated_mlp=True``: SwiGLU with
    its own ``d_ff``, ``n_kv_heads`` for grouped-query attention, ``rmsnorm``, no
    dropout, an untied head, RoPE, so no position table: ``learned_positions``
    False)."""

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
    rmsnorm: bool = False  # Llama's norms: a weight of h each, no bias
    # dropout after attention's softmax, its output and the MLP: three masks a
    # layer (Korthikanti counts them); Llama and Mixtral train without
    dropout: bool = True

    def _count_kw(self) -> dict:
        return dict(
            seq_len=self.seq_len if self.learned_positions else 0,
            d_ff=self.d_ff,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            gated_mlp=self.gated_mlp,
            bias=self.bias,
            layernorm=self.layernorm,
            tied_embeddings=self.tied_embeddings,
            rmsnorm=self.rmsnorm,
        )

    @property
    def n_params(self) -> int:
        """Parameter count from the architecture. A mixture of experts has
        ``n_experts`` MLPs per layer and a router of ``h·n_experts``."""
        dense = model_params(
            self.n_layers, self.d_model, self.vocab_size, **self._count_kw()
        )
        if self.n_experts == 1:
            return dense
        extra = (self.n_experts - 1) * _mlp_params(self) + self.d_model * self.n_experts
        return dense + self.n_layers * extra

    @property
    def active_params(self) -> int:
        """Parameters one token uses: :attr:`n_params` less the experts it is not
        routed to (``n_experts - top_k`` MLPs a layer). Equal to ``n_params`` for a
        dense model; Mixtral 8x7B: 46.7B in all, 12.9B active."""
        idle = (self.n_experts - self.top_k) * _mlp_params(self)
        return self.n_params - self.n_layers * idle


def active_params(model) -> int:
    """Parameters a token passes through (:attr:`ModelPreset.active_params`): what
    a mixture of experts' FLOPs and MFU are counted over."""
    return model_spec(model).active_params


def _llama(name, layers, h, heads, vocab, seq, ffn, kv=None, **kw) -> ModelPreset:
    """A Llama-style preset: SwiGLU, RMSNorm, RoPE, untied head, no dropout."""
    kw = {"rmsnorm": True, "dropout": False, **kw}
    return ModelPreset(name, layers, h, heads, vocab, seq, ffn, n_kv_heads=kv, **kw)


# LLaMA-2 (Touvron et al. 2023, Table 1 and the released configs), GPT-3 (Brown et
# al. 2020, Table 2.1), Llama 3 (Dubey et al. 2024, Table 3; 8K pre-training
# context; "405B" is Llama 3.1 405B; counted exactly, norms included, no dropout).
# The LLaMA-2 presets keep chapters 00-08's counts: norms left out (2h a block,
# under 0.002 %) and Korthikanti's dropout masks in the activations (LLaMA-2 trained
# without dropout: an upper bound, by 2sbh + 3as²b of each layer's bytes).
_COURSE = dict(rmsnorm=False, dropout=True)
MODELS: dict[str, ModelPreset] = {
    "7B": _llama("LLaMA-2 7B", 32, 4096, 32, 32000, 4096, 11008, **_COURSE),
    "13B": _llama("LLaMA-2 13B", 40, 5120, 40, 32000, 4096, 13824, **_COURSE),
    "70B": _llama("LLaMA-2 70B", 80, 8192, 64, 32000, 4096, 28672, kv=8, **_COURSE),
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
        bias=True,
        layernorm=True,
    ),
    "405B": _llama("Llama 3.1 405B", 126, 16384, 128, 128256, 8192, 53248, kv=8),
    "llama3-8B": _llama("Llama 3 8B", 32, 4096, 32, 128256, 8192, 14336, kv=8),
    "llama3-70B": _llama("Llama 3 70B", 80, 8192, 64, 128256, 8192, 28672, kv=8),
}


MOE_MODELS: dict[str, ModelPreset] = {
    # Mixtral 8x7B (Jiang et al. 2024, Table 1): 8 SwiGLU experts per layer, top-2
    "8x7B": _llama(
        "Mixtral 8x7B",
        32,
        4096,
        32,
        32000,
        4096,
        14336,
        kv=8,
        n_experts=8,
        top_k=2,
        rmsnorm=False,
    ),
}


# the planner's plain words for a custom model's shape
_CUSTOM_ALIASES = {
    "layers": "n_layers", "hidden": "d_model", "heads": "n_heads",
    "vocab": "vocab_size", "sequence": "seq_len", "kv_heads": "n_kv_heads",
    "experts": "n_experts", "ffn": "d_ff",
}  # fmt: skip
CUSTOM_REQUIRED = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")
# what a custom model dict gets when it does not say: the textbook GPT block
# (12·L·h² + V·h with an untied head), Korthikanti's activations (dropout on)
CUSTOM_DEFAULTS = {
    "name": "custom",
    "d_ff": "4 × d_model",
    "n_kv_heads": None,  # multi-head attention
    "gated_mlp": False,
    "learned_positions": False,
    "tied_embeddings": False,
    "bias": False,
    "layernorm": False,
    "rmsnorm": False,
    "dropout": True,
    "n_experts": 1,
    "top_k": 1,
}


def model_spec(model) -> ModelPreset:
    """The :class:`ModelPreset` of ``model``: a preset name (``"70B"``, ``"8x7B"``),
    a preset, a :class:`dtlab.model.GPTConfig` (counted exactly: biases, LayerNorms,
    learned positions, tied head), or a dict of a custom architecture.

    A dict needs :data:`CUSTOM_REQUIRED` (``n_layers, d_model, n_heads,
    vocab_size, seq_len``, or ``layers, hidden, heads, vocab, sequence``); every
    other key is optional with the default of :data:`CUSTOM_DEFAULTS` (a GPT block
    with ``d_ff = 4h``, multi-head attention, untied head, no position table, no
    biases or norms counted, dropout on). A key that is neither is refused by
    name, as is a missing one."""
    if isinstance(model, ModelPreset):
        return model
    if isinstance(model, str):
        table = {**MODELS, **MOE_MODELS}
        if model not in table:
            raise ValueError(f"unknown model {model!r}: expected one of {list(table)}")
        return table[model]
    if isinstance(model, dict):
        d = {_CUSTOM_ALIASES.get(k, k): v for k, v in model.items()}
        known = set(CUSTOM_REQUIRED) | set(CUSTOM_DEFAULTS)
        unknown = [k for k in model if _CUSTOM_ALIASES.get(k, k) not in known]
        if unknown:
            raise ValueError(
                f"unknown key(s) {unknown} in the custom model: expected "
                f"{list(CUSTOM_REQUIRED)} and optionally {list(CUSTOM_DEFAULTS)} "
                f"(or the aliases {list(_CUSTOM_ALIASES)})"
            )
        missing = [k for k in CUSTOM_REQUIRED if k not in d]
        if missing:
            raise ValueError(
                f"the custom model misses {missing}: give {list(CUSTOM_REQUIRED)}"
            )
        d.setdefault("name", "custom")
        d.setdefault("d_ff", 4 * d["d_model"])
        d.setdefault("gated_mlp", False)
        d.setdefault("dropout", True)
        spec = ModelPreset(**d)
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
            n_experts=getattr(model, "n_experts", 1),
            top_k=getattr(model, "top_k", 1),
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
    kv = spec.n_kv_heads
    if kv is not None and (kv < 1 or spec.n_heads % kv):
        raise ValueError(
            f"n_kv_heads={kv} must divide n_heads={spec.n_heads} (grouped queries)"
        )


def _mlp_params(spec: ModelPreset) -> int:
    """One MLP (one expert): ``h -> d_ff -> h``, SwiGLU's third matrix if gated."""
    h, f = spec.d_model, spec.d_ff
    n = (3 if spec.gated_mlp else 2) * h * f
    if spec.bias:
        n += (2 if spec.gated_mlp else 1) * f + h
    return n


def layer_params(spec: ModelPreset) -> dict[str, float]:
    """One block's parameters: ``dense`` (attention, norms and, without experts, the
    MLP), ``experts`` (all experts' MLPs), ``replicated`` (what tp does not split:
    the norms and the row-parallel layers' biases, Megatron §3)."""
    kw = spec._count_kw()
    h, V = spec.d_model, spec.vocab_size
    block = model_params(1, h, V, **kw) - model_params(0, h, V, **kw)
    replicated = (4 * h if spec.layernorm else 0) + (2 * h if spec.bias else 0)
    replicated += 2 * h if spec.rmsnorm else 0
    if spec.n_experts == 1:
        return {"dense": block, "experts": 0, "replicated": replicated}
    mlp = _mlp_params(spec)
    # the router (h x E) is small and replicated; the experts replace the MLP
    return {
        "dense": block - mlp + h * spec.n_experts,
        "experts": spec.n_experts * mlp,
        "replicated": replicated + h * spec.n_experts,
    }


def matmul_params(spec: ModelPreset) -> dict[str, float]:
    """The weights a token multiplies by, the FLOPs' ``N``: ``{"block"}`` (one
    block: attention's q, k, v, output and the ``top_k`` experts' MLPs, or the
    MLP, and the router; no norms or biases) and ``{"head"}`` (``V·h``, tied or
    not; the embedding lookup and a position table are no matmuls)."""
    h, f = spec.d_model, spec.d_ff
    kv = h if not spec.n_kv_heads else h * spec.n_kv_heads // spec.n_heads
    mlp = (3 if spec.gated_mlp else 2) * h * f
    router = h * spec.n_experts if spec.n_experts > 1 else 0
    block = 2 * h * h + 2 * h * kv + spec.top_k * mlp + router
    return {"block": block, "head": spec.vocab_size * h}

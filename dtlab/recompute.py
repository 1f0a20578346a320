"""Activation checkpointing: trade compute for activation memory (chapter 08).

During a forward pass autograd keeps, for every op, the tensors its backward needs.
For one GPT layer with 16-bit activations that is (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4.1, eq. 1)::

    s·b·h·(34 + 5·a·s/h)  bytes      s seq_len, b microbatch, h d_model, a heads

Checkpointing keeps less and *recomputes* the rest in backward:

- ``"none"``: keep everything (the formula above).
- ``"selective"`` (§4.2): recompute only the attention core
  ``dropout(softmax(QK^T/√d)) V``. Its ``(B, a, s, s)`` tensors are the ``5·a·s/h``
  term, the part that grows with s², while the core is a small share of the FLOPs
  (no weights): memory drops to ``34·sbh`` for a few per cent more compute.
- ``"full"`` (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"):
  keep only each block's input (``2·sbh``) and re-run the whole block in backward:
  one extra forward, about +33 % of a step's compute (backward ≈ 2 forwards). A
  non-reentrant checkpoint stops as soon as everything backward needs is rebuilt,
  so the block's last matmul is skipped: ~22-24 % in FLOPs
  (:func:`dtlab.estimate.recompute_overhead`).

Both are applied per block with :func:`torch.utils.checkpoint.checkpoint`
(``use_reentrant=False``, ``preserve_rng_state=True``): recomputation sees the random
state the forward saw, so dropout draws the same masks and the gradients are
bit-identical to the run without checkpointing (``tests/test_recompute.py``).
Tensor parallelism draws its dropout masks from explicit generators
(:class:`dtlab.tensor_parallel.TPRandom`), which torch does not save; this module
replays those too.

The blocks are wrapped in place (the block's ``forward`` or the attention's ``core``
is shadowed by an instance attribute), so parameter names, ``state_dict`` keys and
optimizers are untouched, and any mode can be switched to any other.

Use it on any model that keeps its transformer blocks in ``.blocks``:
:class:`dtlab.model.GPT`, a pipeline :class:`dtlab.pipeline.StageModule` and
:func:`dtlab.tensor_parallel.TensorParallelGPT`. :mod:`dtlab.parallelize` calls
:func:`apply_activation_checkpointing` with ``TrainConfig.activation_checkpointing``
after tensor parallelism and before data parallelism (wrapping DDP/ZeRO around
blocks that already recompute, as torchtitan does).
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtlab.memory import SavedBytes

__all__ = [
    "MODES",
    "apply_activation_checkpointing",
    "checkpointing_mode",
    "measure_activation_memory",
]

MODES = ("none", "selective", "full")


# ---- the wrapper ---------------------------------------------------------------------
class _Recomputed:
    """Calls ``fn`` through a non-reentrant checkpoint: the inputs are saved, the
    intermediates are dropped and rebuilt in backward. ``rngs`` are explicit dropout
    generators (TP's) to replay as torch replays its global RNG."""

    def __init__(self, fn, mode: str, rngs: list) -> None:
        self.fn, self.mode, self.rngs = fn, mode, rngs

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.fn(*args, **kwargs)  # nothing is saved: nothing to recompute
        extra = {"context_fn": _replay_generators(self.rngs)} if self.rngs else {}
        return checkpoint(
            self.fn,
            *args,
            use_reentrant=False,  # works with torch.autograd.grad(inputs=...) too
            preserve_rng_state=True,  # same global RNG, same dropout masks
            **extra,
            **kwargs,
        )


def _replay_generators(rngs: list):
    """``context_fn`` for :func:`checkpoint`: the forward context remembers the
    state of every explicit generator (:meth:`TPRandom.get_states
    <dtlab.tensor_parallel.TPRandom.get_states>`); the recompute context sets them
    back to it, so recomputed masks equal the forward's, and afterwards returns
    them to where the real streams were, so they are not advanced a second time."""

    def context_fn():
        saved: list[dict] = []

        @contextmanager
        def forward():
            saved[:] = [r.get_states() for r in rngs]
            yield

        @contextmanager
        def recompute():
            real = [r.get_states() for r in rngs]
            for r, states in zip(rngs, saved, strict=True):
                # a stream first drawn from inside the forward is missing from
                # ``saved``: it starts again from its seed, as it did then
                r.set_states(states)
            try:
                yield
            finally:
                for r, states in zip(rngs, real, strict=True):
                    r.set_states(states)

        return forward(), recompute()

    return context_fn


def _explicit_rngs(module: nn.Module) -> list:
    """The explicit random streams the module's dropouts draw from (a ``.rng`` with
    ``get_states``/``set_states``: tensor parallelism's
    :class:`~dtlab.tensor_parallel.TPRandom`), each once."""
    found: dict[int, object] = {}
    for m in module.modules():
        rng = getattr(m, "rng", None)
        if callable(getattr(rng, "get_states", None)):
            found[id(rng)] = rng
    return list(found.values())


# ---- applying it ---------------------------------------------------------------------
def _blocks(module: nn.Module) -> list[nn.Module]:
    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return list(blocks)
    raise ValueError(
        f"{type(module).__name__} has no transformer blocks in `.blocks` (an "
        "nn.ModuleList or nn.ModuleDict): activation checkpointing wraps each block; "
        "pass the model that holds them (GPT, StageModule, TensorParallelGPT)"
    )


def _unwrap(block: nn.Module) -> None:
    """Remove this module's wrappers from a block (back to ``"none"``)."""
    if isinstance(block.__dict__.get("forward"), _Recomputed):
        del block.__dict__["forward"]
    attn = getattr(block, "attn", None)
    if attn is not None and isinstance(attn.__dict__.get("core"), _Recomputed):
        del attn.__dict__["core"]


def apply_activation_checkpointing(module: nn.Module, mode: str) -> nn.Module:
    """Make every block of ``module.blocks`` recompute its activations in backward.

    ``mode`` is ``TrainConfig.activation_checkpointing``:

    - ``"none"``: no recomputation (removes wrappers applied earlier);
    - ``"selective"``: each block's attention core ``attn.core(q, k, v)`` (softmax
      of ``QK^T`` and its product with V) is checkpointed: the ``5·a·s/h`` term of
      Korthikanti et al. 2022 is not stored;
    - ``"full"``: each whole block is checkpointed: only its input is stored.

    Works in place and returns ``module``. Parameter names do not change, so call it
    before or after building optimizers, and before wrapping the model in DDP/ZeRO
    (:mod:`dtlab.parallelize` does: TP, then this, then data parallelism). Calling it
    again with another mode replaces the previous one.

    Raises ``ValueError`` for an unknown mode or a module without ``.blocks``, and
    ``NotImplementedError`` for ``"selective"`` when a block's attention has no
    separate ``core(q, k, v)`` method to recompute.
    """
    if mode not in MODES:
        raise ValueError(
            f"activation checkpointing mode must be one of {list(MODES)}, got {mode!r}"
        )
    blocks = _blocks(module)
    for block in blocks:
        _unwrap(block)
    if mode == "selective":
        for block in blocks:
            attn = getattr(block, "attn", None)
            if attn is None or not callable(getattr(type(attn), "core", None)):
                raise NotImplementedError(
                    f"selective recomputation needs the attention of "
                    f"{type(block).__name__} to compute softmax(QK^T)V in a separate "
                    f"`core(q, k, v)` method (as dtlab.model.CausalSelfAttention "
                    f"does); {type(attn).__name__} has none: use 'full' instead"
                )
    for block in blocks:
        rngs = _explicit_rngs(block)
        if mode == "full":
            # the instance attribute shadows the class's forward; nn.Module.__call__
            # (and its hooks) still runs, and no parameter name changes
            block.forward = _Recomputed(block.forward, mode, rngs)
        elif mode == "selective":
            block.attn.core = _Recomputed(block.attn.core, mode, rngs)
    return module


def checkpointing_mode(module: nn.Module) -> str:
    """The mode :func:`apply_activation_checkpointing` left on ``module``'s blocks
    (``"none"`` if it was never applied)."""
    modes = set()
    for block in _blocks(module):
        attn = getattr(block, "attn", None)
        if isinstance(block.__dict__.get("forward"), _Recomputed):
            modes.add("full")
        elif attn is not None and isinstance(attn.__dict__.get("core"), _Recomputed):
            modes.add("selective")
        else:
            modes.add("none")
    if len(modes) > 1:
        raise ValueError(f"blocks are checkpointed differently: {sorted(modes)}")
    return modes.pop() if modes else "none"


# ---- measuring it --------------------------------------------------------------------
class BlockSavedBytes:
    """The bytes autograd saves for backward during a forward
    (:class:`dtlab.memory.SavedBytes`: weights excluded, each storage once),
    attributed to the block whose forward saved them first (the rest: embeddings,
    head and loss, to :attr:`other`)."""

    def __init__(self, module: nn.Module) -> None:
        self.blocks = _blocks(module)
        self.per_block = [0] * len(self.blocks)
        self.other = 0
        self._current: int | None = None
        self._saved = SavedBytes(list(module.parameters()), on_new=self._attribute)

    def _attribute(self, nbytes: int) -> None:
        if self._current is None:
            self.other += nbytes
        else:
            self.per_block[self._current] += nbytes

    @contextmanager
    def counting(self):
        def enter(i):
            def hook(mod, args):
                self._current = i

            return hook

        def leave(mod, args, out):
            self._current = None

        handles = []
        for i, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(enter(i)))
            handles.append(block.register_forward_hook(leave))
        try:
            with self._saved:
                yield self
        finally:
            for h in handles:
                h.remove()


def _loss_of(model: nn.Module, x, y):
    """GPT-like models return ``(logits, loss)``; a pipeline stage returns a tensor
    (the loss of a last stage is ``model.loss(logits, y)``; other stages backward
    the sum of their output, a stand-in for the next stage's gradient)."""
    out = model(x, y) if y is not None and _takes_targets(model) else model(x)
    if isinstance(out, tuple):
        return out[1]
    if y is not None and getattr(model, "last", False) and hasattr(model, "loss"):
        return model.loss(out, y)
    return out.sum()


def _takes_targets(model: nn.Module) -> bool:
    return len(inspect.signature(model.forward).parameters) >= 2


def measure_activation_memory(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor | None, mode: str
) -> dict:
    """One forward and backward of ``model`` on ``(x, y)`` with checkpointing
    ``mode``: the bytes saved for backward and the time each pass takes.

    Returns ``{mode, saved_bytes, per_block, block_bytes, other_bytes, forward_s,
    backward_s, loss}``: ``saved_bytes`` is everything the forward kept (weights
    excluded), ``per_block`` the share of each block (``block_bytes`` their mean,
    comparable to :func:`dtlab.estimate.activation_bytes_per_layer`), ``other_bytes``
    the embeddings, head and loss. The model's previous mode is restored and its
    gradients are left in ``.grad`` (accumulated, as a backward does).

    Full recomputation also holds one block's activations *during* backward, while
    that block is rebuilt; that transient peak is not in ``saved_bytes``.
    """
    before = checkpointing_mode(model)
    apply_activation_checkpointing(model, mode)
    try:
        counter = BlockSavedBytes(model)
        t0 = time.perf_counter()
        with counter.counting():
            loss = _loss_of(model, x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
    finally:
        apply_activation_checkpointing(model, before)
    n = len(counter.per_block)
    return {
        "mode": mode,
        "saved_bytes": sum(counter.per_block) + counter.other,
        "per_block": list(counter.per_block),
        "block_bytes": sum(counter.per_block) / n if n else 0.0,
        "other_bytes": counter.other,
        "forward_s": t1 - t0,
        "backward_s": t2 - t1,
        "loss": float(loss.detach()),
    }

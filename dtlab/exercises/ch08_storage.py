"""What a forward leaves allocated, for chapter 08's checkers: every tensor the
model's modules output and every tensor autograd saves, followed by weak reference
to its storage (:class:`.storages.Storages`).

Counting what autograd saves is not enough: a learner's code can keep a hidden
activation alive itself (a detached copy in a list, a hook's output), and autograd
would never see it. So the checker follows the storages and asks, when it samples,
which are still allocated, by anyone. It also counts how many saved tensors
autograd still holds on each storage, to say *who* holds the bytes::

    with ForwardStorages(model, exclude=[x, y]) as held:
        loss = model(x, y)[1]
        held.sample()          # the bytes allocated now, kept in held.peak
"""

from __future__ import annotations

import torch

from dtlab.exercises.storages import Storage, Storages

__all__ = ["ForwardStorages", "describe", "label", "ROOT", "SAVED"]

SAVED = "saved for backward"
ROOT = "output of the model"


def label(rec: Storage) -> str:
    """What a storage is: the outermost module that output it (outer modules'
    hooks run after their children's), else a tensor autograd saved."""
    outputs = [k for k in rec.kinds if k != SAVED]
    return outputs[-1] if outputs else SAVED


class _Saved:
    """What autograd keeps instead of a saved tensor: tells the follower when
    autograd drops it (after its backward ran)."""

    __slots__ = ("tensor", "rec", "owner")

    def __init__(self, tensor, rec, owner):
        self.tensor, self.rec, self.owner = tensor, rec, owner
        owner.by_autograd[id(rec)] = owner.by_autograd.get(id(rec), 0) + 1

    def __del__(self):
        counts = self.owner.by_autograd
        counts[id(self.rec)] = counts.get(id(self.rec), 1) - 1


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class ForwardStorages:
    """Follow, while entered, the outputs of every module of ``model`` (forward
    hooks, labelled ``output of <name>``) and every tensor autograd saves
    (``saved for backward``). The weights and ``exclude`` (the checker's own
    inputs) are never counted.

    ``sample_each=True`` samples after every output and every saved tensor;
    otherwise call :meth:`sample`. ``spare_root_output``: the whole model's output,
    once no graph holds it, is not counted (a loop variable that keeps the last
    prediction until it is reassigned is not an activation kept)."""

    def __init__(
        self, model, exclude=(), *, sample_each=False, spare_root_output=False
    ):
        self.model = model
        self.held = Storages(exclude=[*model.parameters(), *model.buffers(), *exclude])
        self.by_autograd: dict[int, int] = {}  # id(Storage) -> saved tensors held
        self.sample_each = sample_each
        self.spare_root_output = spare_root_output
        self.peak = 0
        # at the peak: (storage, its bytes then, whether autograd held it then)
        self.at_peak: list[tuple[Storage, int, bool]] = []
        self._handles = []
        self._ctx = None

    # ---- following ------------------------------------------------------------
    def _output(self, name):
        kind = ROOT if not name else f"output of {name}"

        def hook(module, args, output):
            for t in _tensors(output):
                self.held.track(t, kind)
            if self.sample_each:
                self.sample()

        return hook

    def _pack(self, t):
        rec = self.held.track(t, SAVED)
        saved = t if rec is None else _Saved(t, rec, self)
        if self.sample_each:
            self.sample()
        return saved

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self):
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._output(name)))
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- measuring -------------------------------------------------------------
    def by_autograd_now(self, rec: Storage) -> bool:
        return self.by_autograd.get(id(rec), 0) > 0

    def alive(self) -> list[tuple[Storage, int, bool]]:
        """The storages counted now: each with its bytes and whether autograd still
        holds it."""
        out = []
        for rec in self.held.alive():
            kept = self.by_autograd_now(rec)
            if self.spare_root_output and not kept and ROOT in rec.kinds:
                continue
            out.append((rec, rec.nbytes, kept))
        return out

    def sample(self) -> int:
        """The bytes allocated now; the largest sample is :attr:`peak`."""
        now = self.alive()
        total = sum(n for _, n, _ in now)
        if total > self.peak:
            self.peak, self.at_peak = total, now
        return total

    @staticmethod
    def split(found) -> tuple[int, int]:
        """(bytes autograd holds, bytes only something else keeps) of ``found``."""
        graph = sum(n for _, n, kept in found if kept)
        return graph, sum(n for _, n, _ in found) - graph

    @staticmethod
    def by_kind(found, *, kept_by_code_only=False) -> dict[str, int]:
        """Bytes by what each storage is (:func:`label`), largest first."""
        out: dict[str, int] = {}
        for rec, n, kept in found:
            if kept_by_code_only and kept:
                continue
            out[label(rec)] = out.get(label(rec), 0) + n
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def describe(kinds: dict[str, int], most: int = 4) -> str:
    """``"1536 B output of 1, 64 B saved for backward"``."""
    parts = [f"{n} B {kind}" for kind, n in list(kinds.items())[:most]]
    if len(kinds) > most:
        parts.append(f"and {len(kinds) - most} more")
    return ", ".join(parts)

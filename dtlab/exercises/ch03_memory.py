"""How chapter 03's checkers measure memory: by the storages really allocated, not
by the tensor objects or fields they can see (:mod:`.storages`).

- ZeRO-1: the optimizer state a rank keeps, counted by storage
  (:func:`state_storages`): moments kept as slices of full-size buffers count the
  buffers.
- ZeRO-2: the full gradients still allocated after each hook
  (:func:`full_gradients_alive`), whoever keeps them (p.grad, a list, a view), and
  what a rank that kept too many is told (:func:`zero2_held`).
"""

from __future__ import annotations

import torch
from torch import nn

from dtlab.exercises.storages import storage_elements

__all__ = [
    "state_storages",
    "per_element_state",
    "full_gradients_alive",
    "zero2_held",
]


def state_storages(state, weights=()) -> dict:
    """The optimizer state's memory, by storage: ``values`` allocated (each storage
    counted once, whole: a moment kept as a slice of a larger buffer keeps the
    buffer) and ``shown``, the values the state's tensors show. Found in nested
    dicts, lists and a torch optimizer's own state. A step counter is no
    per-element state (a storage of one value, whether an int or torch AdamW's
    0-dim tensor), a parameter (a slice kept as the optimizer's nn.Parameter) is a
    weight, not state, and nor is a view of ``weights``."""
    weight_storages = [w.untyped_storage() for w in weights]
    storages: dict[int, int] = {}
    shown = [0]

    def visit(x):
        if isinstance(x, nn.Parameter):
            return
        if torch.is_tensor(x):
            s = x.untyped_storage()
            values = storage_elements(x)
            if values <= 1 or any(s is w for w in weight_storages):
                return
            storages[s.data_ptr()] = values
            shown[0] += x.numel()
        elif isinstance(x, torch.optim.Optimizer):
            visit(list(x.state.values()))
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(state)
    return {"values": sum(storages.values()), "shown": shown[0]}


def per_element_state(state, weights=()) -> int:
    """The optimizer-state values kept allocated per parameter element, counted by
    storage (:func:`state_storages`)."""
    return state_storages(state, weights)["values"]


def full_gradients_alive(params, held, after) -> dict:
    """What of the full gradients followed is still allocated, after the hook of
    parameter ``after`` (``None``: after the backward): bytes in all, and by who
    still shows them (p.grad, or only something else: a view, a list)."""
    grads = {q.grad.untyped_storage().data_ptr() for q in params if q.grad is not None}
    found = {"after": after, "bytes": 0, "in_grad": [], "elsewhere": [], "buffers": 0}
    for rec in held.alive():
        found["bytes"] += rec.nbytes
        if "gradient" not in rec.kinds:
            found["buffers"] += rec.nbytes
        elif rec.ref().data_ptr() in grads:
            found["in_grad"].append(rec.owner)
        else:
            found["elsewhere"].append(rec.owner)
    return found


def zero2_held(r: int, worst: dict, one_gradient: int, total: int) -> str:
    """What a rank whose full gradients outlived their hooks is told: the bytes,
    after which hook, and who kept them."""
    when = (
        f"after the hook of parameter {worst['after']}"
        if worst["after"] is not None
        else "after the backward"
    )
    head = (
        f"rank {r} still had {worst['bytes']} B of full gradients (or full-size "
        f"copies of them) allocated {when} (the whole model's gradients are {total} "
        f"B); ZeRO-2 holds at most one gradient whole ({one_gradient} B here) beyond "
        "its 1/N slices."
    )
    if worst["elsewhere"]:
        return head + (
            f" p.grad is None, yet the gradients of parameters "
            f"{sorted(worst['elsewhere'])} are still allocated: something still "
            "refers to their storage. A "
            "slice or view of a gradient (a reshape, an index, a chunk) shares its "
            "storage and keeps the whole gradient allocated: clone what you keep."
        )
    if len(worst["in_grad"]) > 1:
        return head + (
            f" p.grad still holds the gradients of parameters "
            f"{sorted(worst['in_grad'])}: "
            "reduce-scatter and free each gradient in its own hook, not all at the "
            "end."
        )
    return head + (
        f" {worst['buffers']} B of it are buffers you reduced (full-size copies), "
        "still allocated after their hooks: a buffer kept per parameter holds as "
        "much as the gradients ZeRO-2 frees. Let each go when its reduce-scatter "
        "is done."
    )

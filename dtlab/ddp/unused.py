"""``find_unused_parameters``: parameters a forward never used get no gradient, so
their bucket would never be complete. PyTorch DDP searches the autograd graph after
each forward and treats what it cannot reach as ready (with a zero gradient); at the
synchronization a small all-reduce of a 0/1 mask (the "local used map") says which
parameters *no* rank used, and those keep their ``.grad`` untouched.
Taught in chapter 02.
"""

from __future__ import annotations

import torch

from dtlab import comm

__all__ = ["reachable_params", "globally_used"]


def reachable_params(roots) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``roots`` reaches."""
    found: set[int] = set()
    seen: set = set()
    stack = []
    for t in roots:
        if t.grad_fn is None:
            found.add(id(t))
        else:
            stack.append(t.grad_fn)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            found.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def globally_used(params, used: set[int], group) -> set[int]:
    """ids of the ``params`` that some rank of ``group`` used (``used``: this
    rank's ids): one all-reduce of a 0/1 mask. A collective."""
    mask = torch.tensor(
        [1 if id(p) in used else 0 for p in params],
        dtype=torch.int32,
        device=params[0].device,  # nccl reduces device tensors only
    )
    comm.all_reduce(mask, group=group, tag="ddp-unused")
    return {id(p) for p, flag in zip(params, mask.tolist()) if flag}

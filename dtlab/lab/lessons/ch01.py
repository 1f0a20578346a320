"""Chapter 01's lesson helpers (``notebooks/01_collectives.ipynb``): the ring
all-reduce as bookkeeping, before any byte moves.

:func:`ring_bookkeeping` follows, step by step, which ranks' contributions every
rank's copy of every chunk holds under the ring algorithm (Patarasuk & Yuan 2009) of
:func:`dtlab.comm.ring_all_reduce`: in reduce-scatter step s rank r receives chunk
``r−s−1`` from its left neighbour and adds it in; in all-gather step s it receives
the finished chunk ``r−s`` and overwrites its copy. :func:`format_held` prints one
step as ``r2[012 123 ...]``.
"""

from __future__ import annotations

__all__ = ["ring_bookkeeping", "format_held"]


def ring_bookkeeping(n: int) -> list[tuple[str, list[list[frozenset]]]]:
    """``[(step name, held)]`` for the 2(N−1) steps of a ring all-reduce on ``n``
    ranks; ``held[rank][chunk]`` is the set of ranks whose contributions that copy
    of the chunk holds after the step."""
    held = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    steps = []
    for s in range(n - 1):  # reduce-scatter: receive chunk r-s-1 from r-1, add it
        sent = [held[(r - 1) % n][(r - s - 1) % n] for r in range(n)]
        for r in range(n):
            held[r][(r - s - 1) % n] = held[r][(r - s - 1) % n] | sent[r]
        steps.append((f"reduce-scatter {s + 1}", [row[:] for row in held]))
    for s in range(n - 1):  # all-gather: receive finished chunk r-s, overwrite
        sent = [held[(r - 1) % n][(r - s) % n] for r in range(n)]
        for r in range(n):
            held[r][(r - s) % n] = sent[r]
        steps.append((f"all-gather {s + 1}", [row[:] for row in held]))
    return steps


def format_held(held) -> str:
    """One step of :func:`ring_bookkeeping` as text: ``r2[012 123 ...]`` means rank
    2's chunk 0 holds the contributions of ranks 0, 1 and 2."""
    return "  ".join(
        f"r{r}[" + " ".join("".join(map(str, sorted(c))) for c in row) + "]"
        for r, row in enumerate(held)
    )

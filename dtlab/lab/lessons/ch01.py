"""Chapter 01's lesson helpers (``notebooks/01_collectives.ipynb``): the chapter's
questions, the ring all-reduce as bookkeeping, the sweep's table and a hang watched
from the notebook.

``QUESTIONS`` are the numbers the learner predicts before the live runs: the bytes
each rank sends in a ring all-reduce, and how much longer a 4096× larger all-reduce
takes. :func:`ring_bookkeeping` follows, step by step, which ranks' contributions
every rank's copy of every chunk holds under the ring algorithm (Patarasuk & Yuan
2009) of :func:`dtlab.comm.ring_all_reduce`: in reduce-scatter step s rank r
receives chunk ``r−s−1`` from its left neighbour and adds it in; in all-gather step
s it receives the finished chunk ``r−s`` and overwrites its copy.
:func:`format_held` prints one step as ``r2[012 123 ...]``. :func:`sweep_table`
prints the time, algorithm and bus bandwidth of each size of the all-reduce sweep;
:func:`watch_hang` runs a function that hangs and reads every rank's status board
while the others wait.
"""

from __future__ import annotations

import threading
import time

from dtlab import estimate as est
from dtlab.lab.predictions import Question

__all__ = [
    "QUESTIONS",
    "format_held",
    "ring_bookkeeping",
    "sweep_table",
    "watch_hang",
]

QUESTIONS = [
    Question(
        "ring_bytes_per_rank",
        "01",
        "bytes each rank sends in a ring all-reduce of a 64 KiB fp32 tensor "
        "(S = 65,536 B) on 4 ranks",
        "KiB",
    ),
    Question(
        "allreduce_time_ratio",
        "01",
        "how many times longer a 4 MiB all-reduce takes than a 1 KiB one on the "
        "4 ranks (4096× the bytes)",
        "x",
    ),
]


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


def sweep_table(sizes, times, fit: est.AlphaBeta, n: int) -> str:
    """The all-reduce sweep as text: per size S (bytes), the median time, the
    algorithm bandwidth S/t, the bus bandwidth (S/t · 2(N−1)/N, as nccl-tests
    reports it) and the α-β fit's time; then the fit and the size at which its
    latency and bandwidth terms are equal."""
    rows = [f"{'S':>9} {'time':>9} {'algbw':>11} {'busbw':>11} {'fit':>9}"]
    for s, t in zip(sizes, times):
        busbw = est.bus_bandwidth("all_reduce", s, n, t)  # algbw * 2(N-1)/N
        fitted = fit.predict(est.wire_bytes("all_reduce", s, n))
        rows.append(
            f"{s:>9,} {t * 1e3:>7.2f}ms {s / t / 1e6:>7.1f}MB/s "
            f"{busbw / 1e6:>7.1f}MB/s {fitted * 1e3:>7.2f}ms"
        )
    crossover = fit.alpha_s / fit.beta_s_per_byte * n / (2 * (n - 1))
    rows.append(
        f"fit: alpha = {fit.alpha_s * 1e3:.2f} ms per call, 1/beta = "
        f"{fit.bandwidth_Bps / 1e9:.2f} GB/s; latency and bandwidth terms are equal "
        f"at S = {crossover / 1e6:.1f} MB"
    )
    return "\n".join(rows)


def watch_hang(cluster, fn, *args, waiting_in: str, timeout: float = 60):
    """Run ``fn(*args)`` on every rank, expecting a hang: as soon as every rank but
    the last waits in the collective tagged ``waiting_in``, read every rank's status
    board (:meth:`~dtlab.lab.kernel.cluster.LabCluster.doing`). Returns
    ``(boards, error, seconds)``: what the boards said mid-hang, the
    :class:`~dtlab.launch.RankError`
    the call ended in (None if it did not), and how long the call took."""
    from dtlab.launch import RankError

    boards: dict[int, str] = {}
    n = cluster.world_size

    def look():
        deadline = time.monotonic() + cluster.timeout
        while time.monotonic() < deadline:
            if all(f"tag {waiting_in!r}" in cluster.doing()[r] for r in range(n - 1)):
                time.sleep(1.0)  # well inside the wait: every board has settled
                boards.update(cluster.doing())
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    error = None
    try:
        cluster.run(fn, *args, timeout=timeout)
    except RankError as err:
        error = err
    seconds = time.perf_counter() - t0
    watcher.join()
    return boards, error, seconds

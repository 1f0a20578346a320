"""Chapter 01's exercises: a ring reduce-scatter and a ring all-reduce, built from
``isend``/``irecv`` alone.

The ring (Patarasuk & Yuan 2009): ranks form a ring, each sending only to its right
neighbour ``(r+1) mod N`` and receiving from its left. A reduce-scatter of ``S``
bytes takes ``N−1`` steps of ``S/N`` bytes, ``(N−1)/N·S`` per rank; an all-reduce is
a reduce-scatter phase followed by an all-gather phase, ``2(N−1)/N·S``. The checkers
run the learner's function on every rank with integer-valued data (integers add
exactly in fp32, in any order, so the results must be exact) and read from the comm
events what each rank sent, to whom, and how many bytes.
"""

from __future__ import annotations

import itertools

import torch

from dtlab import comm
from dtlab.exercises.ch01_solutions import ring_all_reduce, ring_reduce_scatter
from dtlab.exercises.grading import ExerciseFailed, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.watch import Watch

__all__ = [
    "check_ring_reduce_scatter",
    "check_ring_all_reduce",
]

CHUNK_SIZES = (1, 5, 64)  # elements per chunk: one, an odd few, a bigger message


# ---- on every rank -------------------------------------------------------------------
def _integers(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (numel,), generator=gen).float()  # (numel,)


def probe_ring(solution, kind: str, chunk_sizes) -> list[dict]:
    """Run the learner's ring on this rank for every chunk size; what it produced
    and what dtlab.comm saw it send and receive."""
    r, n = rank_and_size()
    found = []
    for k in chunk_sizes:
        inputs = [_integers(n * k, seed=1000 * k + q) for q in range(n)]  # every rank's
        mine = inputs[r].clone()
        forbidden = {comm.ring_all_reduce: "dtlab.comm.ring_all_reduce"}
        with Watch(forbidden) as seen:
            if kind == "reduce_scatter":
                output = torch.full((k,), float("nan"))
                solution(output, mine)
            else:
                solution(mine)
                output = mine
        found.append(
            {
                "k": k,
                "output": output,
                "total": torch.stack(inputs).sum(0),  # (N·k,) what the sum is
                "inputs": torch.stack(inputs),  # (N, N·k) every rank's input
                "input_changed": kind == "reduce_scatter"
                and not torch.equal(mine, inputs[r]),
                "events": [
                    {key: e.get(key) for key in ("op", "peer", "payload_bytes")}
                    for e in seen.events
                ],
                "forbidden": seen.forbidden,
            }
        )
    return found


# ---- judging -------------------------------------------------------------------------
def _judge_traffic(r: int, n: int, case: dict, sends_expected: int, what: str) -> None:
    """Only point-to-point messages (isend/irecv, or send/recv ordered so the ring
    cannot deadlock), only to the right and from the left, the ring's count and
    size of messages."""
    where = f"rank {r}, {case['k']} element(s) per chunk"
    if case["forbidden"]:
        raise ExerciseFailed(
            f"{where}: you called {', '.join(case['forbidden'])}. Build the {what} "
            "yourself from dtlab.comm.isend and dtlab.comm.irecv."
        )
    events = case["events"]
    other = sorted({e["op"] for e in events} - {"send", "recv"})
    if other:
        raise ExerciseFailed(
            f"{where}: you used dtlab.comm.{other[0]}, the library's collective. "
            f"Build the {what} from isend and irecv only."
        )
    sends = [e for e in events if e["op"] == "send"]
    recvs = [e for e in events if e["op"] == "recv"]
    right, left = (r + 1) % n, (r - 1) % n
    wrong_peers = sorted({e["peer"] for e in sends} - {right})
    if wrong_peers == [left] and n > 2:
        raise ExerciseFailed(
            f"{where}: rank {r} sent to rank {left}, its left neighbour: your ring "
            f"runs the other way round. Send to the right, (r+1) mod N = {right}, "
            f"and receive from the left, (r-1) mod N = {left}."
        )
    if wrong_peers:
        raise ExerciseFailed(
            f"{where}: rank {r} sent to rank(s) {wrong_peers}. In a ring every rank "
            f"sends only to its right neighbour (r+1) mod N = {right}; sending a "
            "chunk straight to the rank that needs it is a direct exchange, not a "
            "ring."
        )
    if sorted({e["peer"] for e in recvs} - {left}):
        raise ExerciseFailed(
            f"{where}: rank {r} received from rank(s) "
            f"{sorted({e['peer'] for e in recvs})}; in a ring it receives only from "
            f"its left neighbour (r-1) mod N = {left}."
        )
    chunk_bytes = case["k"] * 4
    sizes = [e["payload_bytes"] for e in sends]
    if len(sends) != sends_expected or any(b != chunk_bytes for b in sizes):
        count = (
            f"2(N−1) = {sends_expected} messages (N−1 in the reduce-scatter phase, "
            "N−1 in the all-gather phase)"
            if what == "all-reduce"
            else f"N−1 = {sends_expected} messages (one partial sum per step)"
        )
        raise ExerciseFailed(
            f"{where}: rank {r} sent {len(sends)} message(s) of {sorted(set(sizes))} "
            f"bytes. A ring {what} on N = {n} ranks sends {count}, each one chunk "
            f"of S/N = {chunk_bytes} bytes: {sends_expected * chunk_bytes} bytes "
            "in all."
        )


def _which_chunk(output: torch.Tensor, total: torch.Tensor, n: int) -> int | None:
    for j, chunk in enumerate(total.chunk(n)):
        if torch.equal(output, chunk):
            return j
    return None


def _contents(got: torch.Tensor, inputs: torch.Tensor, n: int):
    """(j, ranks): ``got`` is chunk j summed over exactly those ranks' inputs (the
    largest such set), or None. Exact: the inputs are integers."""
    for size in range(n, 0, -1):
        for ranks in itertools.combinations(range(n), size):
            for j, chunk in enumerate(inputs[list(ranks)].chunk(n, dim=1)):
                if torch.equal(got, chunk.sum(0)):
                    return j, list(ranks)
    return None


def _partial_said(got, inputs, n: int, r: int, chunk: int, why=True) -> str:
    """What a wrong ``got`` (meant to be chunk ``chunk`` summed over all ranks)
    holds instead, and (``why``) the cause that suggests."""
    found = _contents(got, inputs, n)
    if found is None:
        return "is no sum of the ranks' chunks"
    j, ranks = found
    if j != chunk:
        return f"holds chunk {j} summed over ranks {ranks}, not chunk {chunk}"
    missing = sorted(set(range(n)) - set(ranks))
    if why and ranks == [r]:  # its own chunk went round and never came back
        return (
            f"holds only this rank's own part of chunk {j}: the partial sums of "
            f"chunk {j} travelled on and never came back, so the chunk order is off"
        )
    why = (
        ""
        if not why
        else ": what arrived was copied over the chunk instead of added to it"
        if missing == [r]
        else ": a step's arriving partial sum was dropped or overwritten"
    )
    return f"holds chunk {j} without the contributions of ranks {missing}{why}"


@exercise(
    "ring_reduce_scatter",
    chapter=1,
    reference=ring_reduce_scatter,
    measures=(
        "output == slice r of the sum (exact); only point-to-point, every send to "
        "(r+1) mod N, N−1 sends of S/N bytes; input left untouched"
    ),
)
def check_ring_reduce_scatter(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(
        cluster, probe_ring, solution, "reduce_scatter", CHUNK_SIZES
    )
    for r, cases in enumerate(reports):
        for case in cases:
            _judge_traffic(r, n, case, n - 1, "reduce-scatter")
            want = case["total"].chunk(n)[r]
            if not torch.equal(case["output"], want):
                j = _which_chunk(case["output"], case["total"], n)
                if j is None:  # judged on the largest chunks: no chance matches
                    big = cases[-1]
                    raise ExerciseFailed(
                        f"rank {r}, {big['k']} element(s) per chunk: the output is "
                        f"not slice {r} of the sum; it "
                        f"{_partial_said(big['output'], big['inputs'], n, r, r)}. "
                        "At step s rank r sends chunk (r−s−1) mod N and adds what "
                        "it receives into its copy of chunk (r−s−2) mod N, so the "
                        "last chunk it completes is chunk r."
                    )
                raise ExerciseFailed(
                    f"rank {r}, {case['k']} element(s) per chunk: the output is not "
                    f"slice {r} of the sum; it holds the whole sum of chunk {j}, not "
                    f"of chunk {r}. The messages went to the right neighbour with "
                    "the right sizes, so the chunk order is off: at step s rank r "
                    "sends chunk (r−s−1) mod N and adds what it receives into chunk "
                    "(r−s−2) mod N, so the last chunk it completes is chunk r."
                )
            if case["input_changed"]:
                raise ExerciseFailed(
                    f"rank {r}: your function changed `input`. A reduce-scatter "
                    "leaves its input as it was: add into a copy (input.clone())."
                )
    return [
        f"output is slice r of the sum on all {n} ranks, for {len(CHUNK_SIZES)} sizes",
        f"only point-to-point messages; every send went to (r+1) mod N; {n - 1} "
        "sends of S/N bytes each: (N−1)/N·S per rank",
    ]


@exercise(
    "ring_all_reduce",
    chapter=1,
    reference=ring_all_reduce,
    measures=(
        "result == the sum (exact); only point-to-point, every send to (r+1) mod N, "
        "2(N−1) sends of S/N bytes: (N−1)/N·S per phase"
    ),
)
def check_ring_all_reduce(solution, cluster=None):
    n = world_size_of(cluster)
    reports = on_every_rank(cluster, probe_ring, solution, "all_reduce", CHUNK_SIZES)
    for r, cases in enumerate(reports):
        for case in cases:
            _judge_traffic(r, n, case, 2 * (n - 1), "all-reduce")
            got, total = case["output"], case["total"]
            if torch.equal(got, total):
                continue
            where = f"rank {r}, {case['k']} element(s) per chunk"
            if torch.allclose(got * n, total):
                raise ExerciseFailed(
                    f"{where}: the result is the mean, not the sum. An all-reduce "
                    "sums; dividing by N is the caller's business (DDP does it)."
                )
            if not torch.equal(cases[-1]["output"], cases[-1]["total"]):
                case = cases[-1]  # the largest chunks: no chance matches below
                got, total = case["output"], case["total"]
                where = f"rank {r}, {case['k']} element(s) per chunk"
            whole = [
                j
                for j, c in enumerate(got.chunk(n))
                if torch.equal(c, total.chunk(n)[j])
            ]
            wrong = next(j for j in range(n) if j not in whole)
            held = _partial_said(
                got.chunk(n)[wrong], case["inputs"], n, r, wrong, False
            )
            right = f"chunks {whole} are right" if whole else "no chunk is right"
            raise ExerciseFailed(
                f"{where}: the result is not the sum; {right}, and chunk {wrong} "
                f"{held}. "
                "After the reduce-scatter phase each rank holds one finished chunk: "
                "the all-gather phase must pass the finished chunks on round the "
                "ring, each rank overwriting its copy."
            )
    return [
        f"every rank holds the exact sum, on all {n} ranks, for "
        f"{len(CHUNK_SIZES)} sizes",
        "only point-to-point messages; every send went to (r+1) mod N; "
        f"2(N−1) = {2 * n - 2} sends of S/N bytes: (N−1)/N·S in each phase",
    ]

"""Chapter 05's exercises: the 1F1B schedule as data, and an executor that runs it
over ``isend``/``irecv``.

1. ``one_f_one_b``: the learner's compute order of one stage is put into a 1F1B
   pipeline (the other stages keep dtlab's) and proven with
   :func:`dtlab.pipeline.validate` (complete, ordered, deadlock-free), then all
   stages run the learner's order through :func:`dtlab.pipeline.simulate`: the
   bubble must be ``(p−1)/(m+p−1)`` and stage ``s`` must never hold more than
   ``p − s`` microbatches, on configurations the learner does not see.
2. ``pipeline_executor``: every rank is a stage of a small pipeline and runs the
   learner's executor over dtlab's 1F1B actions. The checker's ``io`` does the
   compute and the messages, whose every wait is *bounded*: a deadlocking
   executor fails within seconds with the stage it stopped on, never hangs. Then
   every gradient is compared with one process, and the comm events show every
   send went to a neighbour, was posted without blocking the stage, and was
   waited before the step ended. Memory is measured, not inferred from the
   order: ``io`` follows the storages of every tensor it hands out or receives
   and of what autograd saves, and the bytes still allocated at any of its calls
   must fit 1F1B's budget for the stage, ``(p − s)`` microbatches in flight plus
   one microbatch's messages (:func:`stage_budget`), however the executor keeps
   them (a dict never cleared, a view).
"""

from __future__ import annotations

import datetime

import torch
from torch import nn

from dtlab import comm, estimate
from dtlab import pipeline as pp
from dtlab.exercises.ch05_solutions import one_f_one_b_order, run_stage
from dtlab.exercises.grading import ExerciseFailed, attempt, exercise
from dtlab.exercises.ranks import on_every_rank, rank_and_size, world_size_of
from dtlab.exercises.storages import Storages
from dtlab.exercises.watch import Watch
from dtlab.model import param_generator

__all__ = [
    "Deadlock",
    "StageIO",
    "check_one_f_one_b",
    "check_pipeline_executor",
    "stage_budget",
]

# hidden configurations (p, m): more microbatches than stages, as many, fewer
CONFIGS = ((4, 8), (4, 4), (2, 5), (3, 7), (4, 2))


# ---- 1. the schedule as data ---------------------------------------------------------
@exercise(
    "one_f_one_b",
    chapter=5,
    reference=one_f_one_b_order,
    local=True,
    measures=(
        "on 5 hidden (p, m): each stage's order valid and deadlock-free among "
        "dtlab's 1F1B stages; peak in flight ≤ p − stage; simulated bubble == "
        "(p−1)/(m+p−1)"
    ),
)
def check_one_f_one_b(solution, cluster=None):
    for p, m in CONFIGS:
        orders = [attempt(solution, s, p, m) for s in range(p)]
        for s, order in enumerate(orders):
            where = f"p={p}, m={m}, stage {s}"
            mixed = [pp.one_f_one_b(p, m).compute_order(r) for r in range(p)]
            mixed[s] = order
            try:
                pp.validate(pp.from_compute_orders("yours", p, m, mixed))
            except (pp.ScheduleError, ValueError, TypeError) as exc:
                raise ExerciseFailed(f"{where}: {exc}") from None
            ops = [a[0] for a in order]
            peak = max(pp.in_flight(pp.from_compute_orders("y", p, m, mixed))[s])
            if ops == ["F"] * m + ["B"] * m and m > p - s:
                raise ExerciseFailed(
                    f"{where}: every forward, then every backward: that is GPipe's "
                    f"order, holding all {m} microbatches at once. 1F1B starts the "
                    "backwards after a warm-up of p − stage − 1 forwards."
                )
            if peak > min(p - s, m):
                warmup = ops.index("B") if "B" in ops else len(ops)
                raise ExerciseFailed(
                    f"{where}: the stage holds {peak} microbatches at its peak; 1F1B "
                    f"holds at most p − stage = {p - s}. Your warm-up has {warmup} "
                    f"forwards: warm up with p − stage − 1 = {p - s - 1}."
                )
        schedule = pp.from_compute_orders("yours", p, m, orders)
        try:
            bubble = pp.bubble(pp.simulate(schedule))
        except pp.ScheduleError as exc:
            raise ExerciseFailed(f"p={p}, m={m}, every stage yours: {exc}") from None
        want = estimate.pipeline_bubble_fraction(p, m)
        if abs(bubble - want) > 1e-9:
            raise ExerciseFailed(
                f"p={p}, m={m}: the simulated bubble is {bubble:.1%}, 1F1B's is "
                f"(p−1)/(m+p−1) = {want:.1%}. A stage that starts its backwards "
                "before p − stage − 1 warm-up forwards idles waiting for them."
            )
    return [
        f"valid and deadlock-free on {len(CONFIGS)} hidden (p, m), every stage",
        "peak in flight p − stage; bubble (p−1)/(m+p−1) in simulation",
    ]


# ---- 2. the executor -----------------------------------------------------------------
WIDTH, MICRO = 6, 2  # each stage Linear(6, 6); microbatches of 2 samples
M = 6  # microbatches: more than stages, so GPipe's peak (m) shows


class Deadlock(RuntimeError):
    """A bounded wait ran out: the stage waited for a peer that never came."""


class BoundedHandle:
    """A p2p handle whose ``wait()`` gives up after ``wait_s`` seconds, raising
    :class:`Deadlock`; ``io`` counts the handles dropped without a wait."""

    def __init__(self, work, io, what: str):
        self.work, self.io, self.what = work, io, what
        self.waited = False

    def wait(self):
        self.io.sample(f"a wait for {self.what}")
        self.waited = True
        if self.work is None:  # waited before
            return True
        try:
            self.work.wait(datetime.timedelta(seconds=self.io.wait_s))
        except RuntimeError as exc:
            if "imed out" not in str(exc):
                raise
            raise Deadlock(self.io.stuck(self.what)) from None
        self.work = None  # a completed message holds no buffer of the stage
        return True

    def __del__(self):
        if not self.waited:
            self.io.dropped += 1


def _stage_layer(s: int) -> nn.Linear:
    lin = nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        gen = param_generator(0, f"pp-exercise/{s}")
        lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH**0.5)
        lin.bias.copy_(torch.randn(WIDTH, generator=gen) * 0.1)
    return lin


def _microbatch(i: int):
    gen = param_generator(0, f"pp-exercise/data/{i}")
    return torch.randn(MICRO, WIDTH, generator=gen), torch.randn(
        MICRO, WIDTH, generator=gen
    )


# what a microbatch's storages are seen as, in the order a message names them
SAVED, OUTPUT, RECEIVED, INPUT_GRAD = (
    "activations saved for backward",
    "outputs",
    "received buffers",
    "input gradients",
)


class StageIO:
    """What the executor of stage ``stage`` of ``p`` calls: the compute of the
    stage (``forward``, ``backward``) and its messages (``isend``, ``irecv``), all
    bounded by ``wait_s`` seconds per wait.

    It follows, by weak reference to their storages (:class:`.storages.Storages`),
    every tensor it hands out or is handed (forward's outputs, the buffers
    received, backward's input gradients) and every tensor autograd saves for
    backward in the stage's forward, and samples the bytes still allocated at every
    call and every wait: what the executor keeps alive, however it keeps it (a
    dict never cleared, a handle, a view). A send hands its bytes to the transport
    (a copy), so a send handle keeps none of the stage's tensors."""

    def __init__(self, stage: int, p: int, wait_s: float):
        self.stage, self.p, self.wait_s = stage, p, wait_s
        self.layer = _stage_layer(stage)
        self.inputs: dict[int, torch.Tensor] = {}
        self.held = Storages(exclude=list(self.layer.parameters()))
        self.forwarded: set[int] = set()
        self.backwarded: set[int] = set()
        self.peak: dict = {"bytes": 0}  # the largest sample, and what it held
        self.dropped = 0  # send handles dropped without a wait
        self.calls: list[float] = []  # when each io call was made (wall clock)

    def stuck(self, what: str) -> str:
        """What a wait that ran out says."""
        dropped = (
            f" This stage dropped {self.dropped} send handle(s) that were never "
            "waited: a send is only sure to be delivered once its handle is waited."
            if self.dropped
            else ""
        )
        return (
            f"stage {self.stage} waited {self.wait_s:g} s for {what} and it never "
            "completed: the stages wait for each other. An action ran out of the "
            "schedule's order (a receive before the send it depends on, or a send "
            "waited at once while its receiver is itself waiting to send)." + dropped
        )

    def _note(self, where: str) -> None:
        import time

        self.calls.append(time.time())
        self.sample(where)

    def sample(self, where: str) -> None:
        """Bytes the stage's tensors keep allocated now; the peak keeps what they
        were (:meth:`breakdown`)."""
        total = self.held.bytes()
        if total > self.peak["bytes"]:
            self.peak = {"bytes": total, "at": where, **self.breakdown()}

    def breakdown(self) -> dict:
        """What is alive now, by kind: microbatches in flight (forwarded, not yet
        backwarded) and what each storage was seen as; for a microbatch whose
        backward ran, what it still keeps."""
        flight = self.forwarded - self.backwarded
        kinds: dict[str, list] = {}  # kind -> [bytes, microbatches]
        for rec in self.held.alive():
            i = rec.owner
            if i in flight and SAVED in rec.kinds:
                kind = "in flight: " + SAVED
            elif i in flight or i is None:
                kind = "in flight: " + rec.kinds[0]
            else:  # its backward is done: kept
                kind = "kept: " + next((k for k in rec.kinds if k != SAVED), SAVED)
            row = kinds.setdefault(kind, [0, set()])
            row[0] += rec.nbytes
            if i is not None:
                row[1].add(i)
        return {
            "in_flight": len(flight),
            "kinds": {k: (b, sorted(mbs)) for k, (b, mbs) in kinds.items()},
        }

    def forward(self, i: int, x):
        self._note(f"its forward of microbatch {i}")
        if self.stage == 0:
            x = _microbatch(i)[0]
        elif x is None:
            raise ValueError(f"stage {self.stage} forward of microbatch {i}: no input")
        else:
            rec = self.held.find(x)
            if rec is not None and rec.owner is None:
                rec.owner = i  # the buffer received for this microbatch
            x = x.detach().requires_grad_()
        self.inputs[i] = x

        def saved(t):
            self.held.track(t, SAVED, i)
            return t

        with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
            out = self.layer(x)  # (b, WIDTH)
            if self.stage < self.p - 1:
                out = torch.tanh(out)
            else:  # the last stage: this microbatch's share of the mean loss
                out = nn.functional.mse_loss(out, _microbatch(i)[1]) / M
        self.held.track(out, OUTPUT, i)
        self.forwarded.add(i)
        return out

    def backward(self, i: int, out, grad):
        self._note(f"its backward of microbatch {i}")
        mine = self.held.find(out)
        if mine is None or OUTPUT not in mine.kinds or mine.owner != i:
            whose = (
                f"the output of microbatch {mine.owner}"
                if mine is not None and OUTPUT in mine.kinds
                else "no output io.forward returned"
            )
            raise ValueError(
                f"stage {self.stage} backward of microbatch {i}: `out` is {whose}, "
                f"not the output of microbatch {i}. Each backward runs through its "
                "own microbatch's output: keep every output until its backward."
            )
        rec = self.held.find(grad)
        if rec is not None and rec.owner is None:
            rec.owner = i  # the gradient received for this microbatch
        torch.autograd.backward(out, grad)
        self.backwarded.add(i)
        x = self.inputs.pop(i)
        if self.stage == 0:
            return None
        self.held.track(x.grad, INPUT_GRAD, i)
        return x.grad

    def isend(self, tensor, peer: int) -> BoundedHandle:
        self._note(f"a send to stage {peer}")
        work = comm.isend(tensor.detach().clone(), peer, tag="pp-exercise")
        return BoundedHandle(work, self, f"its send to stage {peer}")

    def irecv(self, peer: int):
        self._note(f"a receive from stage {peer}")
        buf = torch.empty(MICRO, WIDTH)
        self.held.track(buf, RECEIVED)
        work = comm.irecv(buf, peer, tag="pp-exercise")
        return BoundedHandle(work, self, f"a message from stage {peer}"), buf


def one_microbatch(stage: int, p: int) -> dict:
    """The bytes one microbatch makes stage ``stage`` of ``p`` hold, measured by
    running it alone through :class:`StageIO`'s own compute (no messages): from
    its forward to its backward (the input received, what autograd saves, the
    output) and in all (with the gradient received and the input's gradient)."""
    io = StageIO(stage, p, wait_s=0.0)
    last = stage == p - 1
    x = None if stage == 0 else torch.empty(MICRO, WIDTH)
    io.held.track(x, RECEIVED, 0)
    out = io.forward(0, x)
    flight = io.held.bytes()
    grad = None if last else torch.ones(MICRO, WIDTH)
    io.held.track(grad, RECEIVED, 0)
    kept = [x, out, grad, io.backward(0, out, grad)]  # noqa: F841 - all alive
    return {"flight": flight, "all": sum(r.size for r in io.held.seen)}


def stage_budget(stage: int, p: int) -> dict:
    """What 1F1B lets stage ``stage`` of ``p`` hold at once: ``p − stage``
    microbatches in flight, each with its activations, plus one microbatch's
    messages in transit (a gradient received, an input gradient not yet sent,
    the next input received): ``(p − stage)·flight + all``."""
    one = one_microbatch(stage, p)
    k = p - stage
    return {**one, "k": k, "bytes": k * one["flight"] + one["all"]}


def probe_executor(solution, wait_s: float) -> dict:
    s, p = rank_and_size()
    io = StageIO(s, p, wait_s)
    actions = pp.one_f_one_b(p, M).actions[s]
    forbidden = {pp.Pipeline: "dtlab.pipeline.Pipeline"}
    # every rank starts together (one may still have been importing), so a bounded
    # wait measures the pipeline only
    comm.barrier(tag="pp-exercise")
    with Watch(forbidden) as seen:
        solution(list(actions), io)
    io.sample("the end of the step")
    return {
        "grads": [q.grad for q in io.layer.parameters()],
        "held": io.peak,
        "budget": stage_budget(s, p),
        "launches": seen.launches,
        "peers": [(e["op"], e.get("peer")) for e in seen.events],
        "calls": io.calls,
        "forbidden": seen.forbidden,
    }


def _one_process(p: int) -> list[list[torch.Tensor]]:
    layers = [_stage_layer(s) for s in range(p)]
    for i in range(M):
        h = _microbatch(i)[0]
        for s, layer in enumerate(layers):
            h = layer(h) if s == p - 1 else torch.tanh(layer(h))
        (nn.functional.mse_loss(h, _microbatch(i)[1]) / M).backward()
    return [[q.grad for q in layer.parameters()] for layer in layers]


@exercise(
    "pipeline_executor",
    chapter=5,
    reference=run_stage,
    measures=(
        "every stage's gradients == one process; a deadlock caught by a bounded "
        "wait (seconds, a clear message); sends only to stage ± 1, posted without "
        "blocking, all waited by the end; bytes of the stage's tensors allocated "
        "at once (by storage: outputs, buffers received, input gradients, what "
        "autograd saved) ≤ (p − stage) microbatches in flight + one in transit"
    ),
)
def check_pipeline_executor(solution, cluster=None, wait_s: float = 3.0):
    p = world_size_of(cluster)
    if p < 2:
        raise ValueError("the pipeline exercise needs at least 2 ranks (stages)")
    reports = on_every_rank(cluster, probe_executor, solution, wait_s)
    want = _one_process(p)
    for s, rep in enumerate(reports):
        if rep["forbidden"]:
            raise ExerciseFailed(
                f"stage {s}: you called {', '.join(rep['forbidden'])}: write the "
                "executor loop yourself."
            )
        peers = {peer for op, peer in rep["peers"] if op == "send"}
        if peers - {s - 1, s + 1}:
            raise ExerciseFailed(
                f"stage {s} sent to stage(s) {sorted(peers - {s - 1, s + 1})}: a "
                "pipeline stage talks only to its neighbours."
            )
        sends = [x for x in rep["launches"] if x["op"] == "send"]
        if any(x["t_waited"] is None for x in sends):
            raise ExerciseFailed(
                f"stage {s}: {sum(x['t_waited'] is None for x in sends)} send(s) "
                "were never waited: wait for every send handle before the step "
                "ends, or its buffer may be reused while still on the wire."
            )
        blocked = [
            x
            for x in sends
            if any(t > x["t_waited"] for t in rep["calls"])
            and not any(x["t_launch"] < t < x["t_waited"] for t in rep["calls"])
        ]
        if blocked:
            raise ExerciseFailed(
                f"stage {s} waited {len(blocked)} send(s) right after posting them, "
                "blocking until the neighbour received: post sends and wait for "
                "them at the end."
            )
        if rep["held"]["bytes"] > rep["budget"]["bytes"]:
            raise ExerciseFailed(_held_too_much(s, rep["held"], rep["budget"]))
        for name, g, w in zip(("weight", "bias"), rep["grads"], want[s]):
            if g is None or not torch.allclose(g, w, atol=1e-6):
                off = "none" if g is None else f"off by {(g - w).abs().max():.2e}"
                raise ExerciseFailed(
                    f"stage {s}: the gradient of its {name} differs from one "
                    f"process's ({off}). Does each backward get the gradient "
                    "received for its own microbatch, and does send_grad send the "
                    "input's gradient io.backward returned?"
                )
    held = [f"{r['held']['bytes']}/{r['budget']['bytes']}" for r in reports]
    return [
        f"every stage's gradients equal one process's (p={p}, m={M})",
        "sends only to neighbours, posted without blocking, all waited",
        f"bytes of tensors held at once, per stage / its 1F1B budget: {held}",
    ]


def _mbs(n: int) -> str:
    return f"{n} microbatch" if n == 1 else f"{n} microbatches"


def _held_too_much(s: int, held: dict, budget: dict) -> str:
    """What a stage that held more than 1F1B's budget is told: the bytes, what
    they were, and the rule."""
    k, flight = budget["k"], budget["flight"]
    now = [(kind.split(": ", 1), b, mbs) for kind, (b, mbs) in held["kinds"].items()]
    in_flight = [f"{what} {b} B" for (state, what), b, _ in now if state == "in flight"]
    kept = sorted(
        ((b, what, mbs) for (state, what), b, mbs in now if state == "kept"),
        reverse=True,
    )
    found = []
    if held["in_flight"] or in_flight:
        found.append(f"{_mbs(held['in_flight'])} in flight ({', '.join(in_flight)})")
    if kept:
        found.append(
            "kept after their backward: "
            + ", ".join(f"{what} of {_mbs(len(mbs))} ({b} B)" for b, what, mbs in kept)
        )
    head = (
        f"stage {s} held {held['bytes']} B of tensors at once, at {held['at']}: "
        f"{held['bytes'] / flight:.1f} microbatches' worth ({flight} B each from its "
        f"forward to its backward). Found: {'; '.join(found)}. 1F1B lets stage {s} "
        f"hold p − stage = {k} microbatches in flight ({k} × {flight} B) and one "
        f"microbatch's messages in transit ({budget['all']} B): {budget['bytes']} B."
    )
    if held["in_flight"] > k:
        return head + (
            " Every forward ran before the backwards that free them: run the "
            "actions in the schedule's order, whose warm-up is p − stage − 1 "
            "forwards."
        )
    return head + (
        " A microbatch's tensors are needed from its forward to its backward (its "
        "input gradient until it is sent): whatever still refers to them after that "
        "(a dict entry never removed, a list, a view) keeps their whole storage "
        "allocated."
    )

"""The pipeline executor: any valid schedule, run for real over ``isend``/``irecv``.

Taught in chapter 05 (pipeline parallelism); chapter 07 composes it with tensor and
data parallelism (:mod:`dtlab.parallelize` hands :class:`Pipeline` tensor-parallel
stages, or stages wrapped by ZeRO).

:meth:`Pipeline.step` is the textbook's executor: for each action of its rank's
list (:mod:`dtlab.pipeline.schedules`) it receives, runs a forward, sends, or runs a
backward (``B``, or the zero-bubble schedules' ``B`` and ``W``: :func:`backward_pass`),
in the order the schedule says; its bookkeeping lives in
:class:`dtlab.pipeline.step_state.StepState`. Sends are posted without waiting and
receives wait, the communication model that :func:`dtlab.pipeline.validate` proved
deadlock-free for this schedule; a message to this very rank (a V schedule's turn
from stage ``p-1`` to ``p``) is handed over in memory. :func:`train_pipeline` is a
whole training loop around it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from dtlab import comm, telemetry
from dtlab.events import Span
from dtlab.gradsync import all_reduce_flat
from dtlab.model import GPTConfig, SyntheticTokens, shard_batch
from dtlab.pipeline.catalogue import make_schedule
from dtlab.pipeline.schedules import Schedule
from dtlab.pipeline.simulator import validate
from dtlab.pipeline.stages import StageModule, build_stages
from dtlab.pipeline.step_state import StepState
from dtlab.reference import make_optimizer
from dtlab.topology import Axis

__all__ = ["Pipeline", "backward_pass", "train_pipeline"]

_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pipeline_axes(topo) -> dict[str, Axis | None]:
    """Process groups of this rank's pipeline: ``act`` (the topology's pp axis),
    ``grad`` (a second group over the same ranks, so gradients never queue behind
    activations on one link) and ``tied`` (first and last stage, for a tied
    embedding). Created once per topology, on every rank in the same order."""
    import torch.distributed as dist

    topo.group("pp")  # raises if this topology's groups were torn down
    if topo in _GROUPS:
        return _GROUPS[topo]
    pp = topo.axis("pp")
    axes = {"act": pp, "grad": pp, "tied": None}
    if dist.is_available() and dist.is_initialized() and pp.size > 1:
        for ranks in topo.layout.groups("pp"):  # collective: every group, every rank
            g = dist.new_group(ranks)
            if topo.rank in ranks:
                axes["grad"] = Axis("pp", pp.ranks, pp.index, g)
        for ranks in topo.layout.groups("pp"):
            ends = [ranks[0], ranks[-1]]
            g = dist.new_group(ends)
            if topo.rank in ends:
                axes["tied"] = Axis("pp", tuple(ends), ends.index(topo.rank), g)
    _GROUPS[topo] = axes
    return axes


class Pipeline:
    """Runs any valid schedule for real on this rank's stages.

    ``Pipeline(config, topo, "1f1b", microbatches=8)``; ``chunks=v`` with
    ``"interleaved"`` (``"zb_v"`` and ``"dualpipe_v"`` hold 2 chunks per rank, in a
    V); a :class:`Schedule` object works too. Every rank of the world
    constructs it together (it may create process groups). ``step(x, y)`` runs
    forward and backward of every microbatch of this data-parallel rank's batch and
    leaves the summed gradient of ``mean(loss_i)`` in ``.grad``; an optimizer then
    steps :meth:`parameters`.

    - Loss: microbatch ``i``'s mean cross-entropy ``L_i`` is back-propagated as
      ``L_i / m``, so the gradients are those of ``mean_i L_i``, which equals the
      mean over the whole batch because microbatches are equal in size.
    - Megatron's trick: once a stage output's send completes, its storage is freed
      unless backward saved it; ``backward(out, grad)`` needs only its shape.
    - Gradient sync only after the last microbatch: the tied embedding copy over
      the first and last stage, then data-parallel averaging over ``dp``.

    With ``dropout > 0`` each stage draws masks from its own process's RNG, so the
    numbers are no longer those of one process (the parity tests use dropout 0).

    Composition (:mod:`dtlab.parallelize`, chapter 07): ``stages`` hands in this
    rank's chunks ready-made (tensor-parallel stages, or stages wrapped by ZeRO), with
    ``loss_fn(out, targets)`` for the last one (default :meth:`StageModule.loss`),
    ``act_dtype`` for the activations on the wire (default: the first stage's
    parameter dtype) and ``seq_split`` (tp under sequence parallelism: each rank
    sends its ``T/t`` slice of the sequence).
    """

    def __init__(
        self,
        config: GPTConfig,
        topo,
        schedule: str | Schedule = "1f1b",
        *,
        microbatches: int | None = None,
        chunks: int = 1,
        seed: int = 0,
        stages: list[nn.Module] | None = None,
        loss_fn=None,
        act_dtype: torch.dtype | None = None,
        seq_split: int = 1,
    ):
        p = topo.size("pp")
        if isinstance(schedule, Schedule):
            if schedule.p != p:
                raise ValueError(f"schedule is for p={schedule.p}, the topology pp={p}")
            if microbatches not in (None, schedule.m) or chunks not in (1, schedule.v):
                raise ValueError("microbatches/chunks come from the Schedule object")
        else:
            if microbatches is None:
                raise ValueError("microbatches is required with a schedule name")
            name, schedule = schedule, make_schedule(schedule, p, microbatches, chunks)
            topo.layout.validate(
                n_layers=config.n_layers,
                microbatches=microbatches,
                schedule=None if schedule.name == "gpipe" else str(name),
                chunks=schedule.v,  # 2 for the V schedules
            )
        self.schedule = validate(schedule)
        self.config, self.topo = config, topo
        self.rank = topo.coords["pp"]
        if stages is None:
            stages = build_stages(
                config, p, self.rank, schedule.v, seed, placement=schedule.placement
            )
        elif len(stages) != schedule.v:
            raise ValueError(f"need {schedule.v} stage chunks, got {len(stages)}")
        self.stages = list(stages)
        self.loss_fn = loss_fn or StageModule.loss
        self.act_dtype = act_dtype
        self.seq_split = seq_split
        self.axes = _pipeline_axes(topo)
        self.last_stats: dict = {}

    def parameters(self):
        for stage in self.stages:
            yield from stage.parameters()

    def named_parameters(self):
        """``(name in GPT, parameter)`` for this rank's chunks."""
        for stage in self.stages:
            yield from stage.global_named_parameters()

    def zero_grad(self) -> None:
        for param in self.parameters():
            param.grad = None

    # ---- one step: the schedule's actions, in order -------------------------------
    def step(
        self, x: torch.Tensor, y: torch.Tensor, loss_scale: float = 1.0, sync=True
    ) -> dict:
        """Forward and backward of every microbatch of ``(x, y)``, this dp rank's
        ``(B, T)`` batch (every stage passes it; only the first reads ``x``, only
        the last ``y``). ``loss_scale`` multiplies the loss before backward (fp16's
        dynamic loss scaling, :mod:`dtlab.amp`); activations and gradients travel
        in the stages' own dtype. Returns ``{"loss"}`` (``mean_i L_i`` on the rank
        holding the head, ``None`` elsewhere) and what it measured on this rank:
        peak microbatch-chunks in flight, peak activation bytes saved for backward,
        bytes freed after sends. ``sync=False`` leaves the gradients unsynchronized
        (several flushes per optimizer step: call :meth:`sync_gradients` after the
        last)."""
        s = self.schedule
        xs, ys = self._microbatches(x, y)  # m x (b, T)
        st = self._new_step(xs[0])
        if self.axes["act"].size > 1:
            comm.barrier(self.axes["act"], tag="pp-step")  # a common time origin
        with st.span(Span.STEP, schedule=s.name):
            for a in s.actions[self.rank]:
                key = (a.chunk, a.microbatch)
                if a.op == "recv_act":  # our input: the previous stage's output
                    st.inputs[key] = self._recv(a, st).requires_grad_()
                elif a.op == "recv_grad":  # dL/d(our output), from the next stage
                    st.grads[key] = self._recv(a, st)
                elif a.op == "F":
                    st.outputs[key] = self._forward(a, xs, ys, loss_scale, st)
                elif a.op.startswith("send") and a.peer == self.rank:
                    st.hand_over(a, key)  # a V's turn: the next stage is ours too
                elif a.op == "send_act":  # posted, not waited for
                    out = st.outputs[key]
                    work = comm.isend(out.detach(), a.peer, self.axes["act"], tag="act")
                    st.sending(work, out, output_of=key)  # freed once sent
                elif a.op == "send_grad":  # dL/d(our input), to the previous stage
                    g = st.inputs.pop(key).grad  # (b, T, C)
                    work = comm.isend(g, a.peer, self.axes["grad"], tag="grad")
                    st.sending(work, g)
                else:  # B; with a split backward (ZB-H1, ZB-V, DualPipeV), B then W
                    with st.span(Span(a.op), a):
                        self._backward(a.op, key, st)
                    if a.op == s.last_pass:  # the microbatch's activations can go
                        st.release(key, a)
                st.reap()  # finish the sends that completed
            st.reap(wait_all=True)
        if sync:
            self.sync_gradients()
        self.last_stats = st.stats()
        return dict(self.last_stats)

    def _microbatches(self, x, y):
        m = self.schedule.m
        if x.shape[0] % m:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split into m={m} equal "
                "microbatches: make the batch size a multiple of m"
            )
        # each microbatch its own tensors: a stage keeps only the microbatches in
        # flight (views would keep the whole batch alive)
        xs = [part.clone() for part in x.tensor_split(m)]
        ys = [part.clone() for part in y.tensor_split(m)]
        return xs, ys

    def _new_step(self, x0: torch.Tensor) -> StepState:
        b, T = x0.shape
        act_shape = (b, T // self.seq_split, self.config.d_model)  # (b, T, C)
        # bf16/fp16 stages send 16 bits
        dtype = self.act_dtype or next(self.stages[0].parameters()).dtype
        # the weights the stages compute with (inside a ZeRO wrapper too)
        weights = [
            q
            for stage in self.stages
            for q in getattr(stage, "module", stage).parameters()
        ]
        return StepState(
            telemetry.current(),
            stage=self.rank,
            replica=self.topo.coords["dp"],
            weights=weights,
            message=(act_shape, dtype, x0.device),
        )

    def _recv(self, a, st: StepState) -> torch.Tensor:
        """``recv_act`` or ``recv_grad``: wait for the peer's message, or, at a
        V's turn, take the one this rank handed itself (``StepState.hand_over``)."""
        kind = a.op[5:]  # act or grad, each on its own group
        if a.peer == self.rank:
            return st.local[kind].popleft()
        buf = st.new_message()  # (b, T, C)
        work = comm.irecv(buf, a.peer, self.axes[kind], tag=kind)
        with st.span(Span.IDLE, a):  # waiting is the bubble
            work.wait()
        return buf

    def _forward(self, a, xs, ys, loss_scale: float, st: StepState) -> torch.Tensor:
        """``F``: chunk ``a.chunk`` on microbatch ``a.microbatch``, counting what
        autograd saves. The last virtual stage returns the loss as backward
        starts from it, ``L_i · loss_scale / m``."""
        s, key = self.schedule, (a.chunk, a.microbatch)
        vs = s.vstage(self.rank, a.chunk)
        inp = xs[a.microbatch] if vs == 0 else st.inputs[key]
        with st.span(Span.F, a), st.recording(key):
            out = self.stages[a.chunk](inp)  # (b, T, C) or (b, T, V)
            if vs == s.n_virtual - 1:
                loss = self.loss_fn(out, ys[a.microbatch])
                st.losses.append(loss.detach())
                if loss_scale != 1.0:
                    loss = loss * loss_scale
                out = loss / s.m  # d(mean_i L_i) = sum_i d(L_i / m)
        st.note_memory(a)
        return out

    def _backward(self, op: str, key, st: StepState) -> None:
        """``B`` (or ``W``) of microbatch-chunk ``key``: :func:`backward_pass`."""
        weights = [q for q in self.stages[key[0]].parameters() if q.requires_grad]
        backward_pass(
            op,
            st.outputs[key],
            st.grads.get(key),  # None on the last virtual stage: out is the loss
            st.inputs.get(key),  # None on the first: no input gradient to send
            weights,
            split=self.schedule.split_backward,
        )

    def sync_gradients(self, data_parallel: bool = True) -> None:
        """After the last microbatch only: sum the tied embedding's two copies (over
        the first and last rank, or on rank 0 in a V), then average over
        data-parallel replicas, dp·cp under context parallelism (one flat all-reduce;
        ``data_parallel=False`` leaves that to a data-parallel wrapper)."""
        s, tied = self.schedule, self.axes["tied"]
        copies = [
            q
            for stage in self.stages
            for name, q in stage.named_parameters()
            if name in ("wte.weight", "head.weight") and q.grad is not None
        ]
        if self.config.tied_head and s.place(0)[0] == s.loss_rank:
            # a V: first and last stage are two chunks of this rank (a lone stage
            # ties the very same tensor: one copy, nothing to add)
            if len(copies) == 2:
                total = copies[0].grad + copies[1].grad
                for q in copies:
                    q.grad.copy_(total)
        elif self.config.tied_head and tied is not None:
            for q in copies:
                comm.all_reduce(q.grad, group=tied, tag="tied-embedding")
        dp = self.topo.replicas()  # dp, or dp·cp: the ranks of the same weights
        if data_parallel and dp.size > 1:
            grads = [q.grad for q in self.parameters() if q.grad is not None]
            all_reduce_flat(grads, dp, tag="dp-grads", divide_by=dp.size)


# ---- the backward, whole or split -------------------------------------------------
def backward_pass(op: str, out, grad, inp, weights, *, split: bool = True) -> None:
    """One backward pass of one microbatch-chunk, from ``out`` (its output, or the
    loss on the last virtual stage) with ``grad`` = dL/d(out) (``None`` for the
    loss). ``inp``: its input (``None`` on the first stage), whose ``.grad`` goes
    upstream; ``weights``: the chunk's parameters.

    ``split=False``: the whole backward at once, input and weight gradients. Split
    (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2): ``B`` computes only
    dL/d(input), which the stage before waits for, and keeps the graph; ``W``
    computes dL/d(weights), which nobody waits for, whenever the schedule says.
    (This ``W`` walks the graph again instead of reusing ``B``'s intermediate
    gradients as a production split does, so it costs about as much as ``B``: the
    same numbers, less saving.)"""
    if not split:
        torch.autograd.backward(out, grad)
    elif op == "B":
        if inp is not None:
            torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
    else:
        torch.autograd.backward(out, grad, inputs=weights)


# ---- training loop -------------------------------------------------------------------
def train_pipeline(
    config: GPTConfig,
    topo,
    *,
    steps: int,
    global_batch_size: int,
    schedule: str | Schedule = "1f1b",
    microbatches: int | None = None,
    chunks: int = 1,
    lr: float = 1e-3,
    seed: int = 0,
    data_seed: int = 0,
) -> list[dict]:
    """Train like :func:`dtlab.reference.train_reference`, pipelined: each dp
    replica takes its slice of ``SyntheticTokens(...).batch(step, B)``. Returns one
    record per step on every rank: ``{"step", "loss", ...}``, the loss sent from
    the last stage and averaged over replicas, and this rank's
    :meth:`Pipeline.step` measurements."""
    pipe = Pipeline(
        config, topo, schedule, microbatches=microbatches, chunks=chunks, seed=seed
    )
    opt = make_optimizer(pipe.parameters(), lr)
    data = SyntheticTokens(config.vocab_size, config.seq_len, seed=data_seed)
    dp, pp = topo.axis("dp"), topo.axis("pp")
    records = []
    for n in range(steps):
        telemetry.current().step = n
        x, y = shard_batch(*data.batch(n, global_batch_size), dp.index, dp.size)
        opt.zero_grad(set_to_none=True)
        out = pipe.step(x, y)
        opt.step()
        loss = torch.tensor([out["loss"] if out["loss"] is not None else 0.0])
        if pp.size > 1:  # from the rank with the last stage (rank 0 in a V)
            comm.broadcast(loss, src=pipe.schedule.loss_rank, group=pp, tag="loss")
        if dp.size > 1:
            comm.all_reduce(loss, group=dp, tag="loss")
            loss /= dp.size
        records.append({"step": n, **pipe.last_stats, "loss": loss.item()})
    return records

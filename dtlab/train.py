"""One training loop for every layout: a :class:`TrainConfig` in, per-step records
out, on the current process group.

Taught in chapter 02 (its first user, DDP); chapter 03 adds the ZeRO stages, and
chapters 07 (3D parallelism) and 08 (memory techniques) drive every composition
through it, so the lab, the benchmarks and the parity tests run all of them the same
way. ``strategy`` names what runs over the data-parallel axis (``ddp``,
``zero1``-``zero3``); tensor and pipeline parallelism come from ``layout``.
:func:`dtlab.parallelize.parallelize` builds the parts (in one fixed order, for every
config, plain DDP included); :class:`Trainer` runs the steps on them.

``train(config, topo=None)`` runs on *every* rank of the world: under the lab's
engines (``dtlab.lab.kernel.training.train_on_cluster(cluster, config)``), under
:func:`dtlab.launch.spawn`, or under torchrun. Each step:

1. every rank draws the same global batch (:class:`dtlab.model.SyntheticTokens`, a
   pure function of the step) and keeps its data-parallel slice, cut into
   ``grad_accum_steps`` microbatches (with a pipeline, pipeline flushes);
2. forward and backward of each, the loss divided by their number so that their
   gradients add up to the gradient of the slice's mean; every one but the last
   accumulates without communicating where the gradients are held in full (DDP,
   ZeRO 0-1; ZeRO 2-3 reduce-scatter each one);
3. the gradient synchronization finishes, the global gradient norm is measured (and
   clipped, if asked), and the optimizer steps (skipped everywhere on an overflow);
4. a record ``{step, rank, strategy, loss, local_loss, grad_norm, lr, tokens,
   time_s, ...}`` is returned, and emitted as a telemetry event of kind ``"step"``
   (what the notebook's live plots listen to). ``loss`` is the mean over the global
   batch (the local losses averaged over the data-parallel ranks), the number to
   compare with :func:`dtlab.reference.train_reference`.

Random state: a trainer seeds every generator its dropouts draw from, from
``config.seed`` and this rank's coordinates, when it is built: torch's (the CPU's,
and this rank's GPU's; context and expert parallelism draw from it too) and tensor
parallelism's two streams (:class:`~dtlab.tensor_parallel.TPRandom`, from every
coordinate but tp, so a tp group keeps one replicated stream). Two runs of one
config then draw the same masks on every rank at every layout, and each dp replica
and pipeline stage draws its own (Megatron offsets its seed by the pipeline
stage; without an offset by the dp rank, as Megatron's default, the replicas would
drop the same positions of different sequences).

Resuming: :meth:`Trainer.state_dict` is this rank's whole training state (its
shards, optimizer, loss scaler, step, and random state: torch's generators and the
tensor-parallel streams, as torchtitan's and Megatron's checkpoints keep them); a
fresh trainer of the same config at the same coordinates continues from it with
the same losses, dropout on or off.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from dtlab import comm, telemetry
from dtlab.config import TrainConfig, check_strategy
from dtlab.context_parallel import shard_sequence
from dtlab.events import CHECKPOINTING, PRECISIONS, SCHEDULES, STRATEGIES, Kind, Span
from dtlab.memory import SavedBytes
from dtlab.model import SyntheticTokens, param_generator, shard_batch
from dtlab.parallelize import (
    Parallelized,
    parallelize,
    replica_axis,
)
from dtlab.tensor_parallel import TPRandom
from dtlab.topology import Topology

__all__ = [
    "TrainConfig",  # defined in dtlab.config, here where every caller looks
    "Trainer",
    "train",
    "check_strategy",
    "default_device",
    "STRATEGIES",
    "PRECISIONS",
    "SCHEDULES",
    "CHECKPOINTING",
]


def default_device() -> torch.device:
    """Where this rank computes: its GPU under nccl (the launcher chose it with
    ``torch.cuda.set_device``), the CPU under gloo or without a process group."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- running -------------------------------------------------------------------------
class Trainer:
    """Build ``config``'s parts on this rank (:func:`dtlab.parallelize.parallelize`,
    a collective call: every rank of the world constructs one) and train with
    :meth:`fit`.

    ``topo`` reuses an existing :class:`~dtlab.topology.Topology` (its layout must be
    the config's); without one, a topology is built (creating process groups).
    """

    # Saved-tensor hooks see every tensor autograd keeps, which costs about 10 % of
    # a small CPU step, and a config saves the same activations every step: count
    # the first recorded steps, then report what they counted.
    COUNTED_STEPS = 2

    def __init__(self, config: TrainConfig, topo: Topology | None = None):
        if not isinstance(config, TrainConfig):
            raise ValueError(f"config must be a TrainConfig, got {type(config)}")
        live = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if live else 1
        if topo is not None and config.layout is None:
            config = config.replace(layout=topo.layout)
        layout = config.check(world)
        if topo is None:
            topo = Topology(layout, None if live else 0)
        elif topo.layout != layout:
            raise ValueError(
                f"topo has layout {topo.layout} but the config asks for {layout}: "
                "pass a matching topology, or topo=None"
            )
        self.config = config
        self.topo = topo
        self.dp = topo.axis("dp")
        self.device = default_device()
        cfg = config.model
        self.data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=config.data_seed)
        self.parts: Parallelized = parallelize(config, topo, self.device)
        self.records: list[dict] = []
        self.step = 0
        self._counted_steps, self._activation_peak = 0, 0
        # every generator this rank's dropouts draw from, seeded from the config
        # and this rank's place: TP's streams from every coordinate but tp (one
        # replicated stream per tp group), torch's from all of them
        self._streams = _random_streams(self.parts.modules)
        group = {a: i for a, i in topo.coords.items() if a != "tp"}
        for stream in self._streams:
            stream.manual_seed(rank_seed(config.seed, group))
        torch.manual_seed(rank_seed(config.seed, topo.coords))  # CPU and GPUs

    @property
    def model(self):
        """The wrapped model forward runs on (``None`` with a pipeline)."""
        return self.parts.model

    @property
    def optimizer(self):
        """The :class:`~dtlab.amp.MixedPrecisionOptimizer` (its ``.optimizer`` is the
        torch AdamW over :meth:`parameters`)."""
        return self.parts.optimizer

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer steps: ZeRO's flat fp32 shards, fp32 masters
        of a 16-bit model, or the model's own parameters."""
        return list(self.parts.optimizer.masters)

    def fit(self, steps: int | None = None) -> list[dict]:
        """Run ``steps`` more steps (default: the config's); return all records."""
        rec = telemetry.current()
        steps = self.config.steps if steps is None else steps
        for _ in range(steps):
            rec.step = self.step
            record = self.train_step(self.step)
            self.records.append(record)
            rec.emit(Kind.STEP, **record)
            self.step += 1
        return self.records

    # ---- one step ------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        """One optimizer step on every layout (see the module docstring)."""
        parts, cfg, rec = self.parts, self.config, telemetry.current()
        t0 = telemetry.clock()
        parts.optimizer.zero_grad()
        for w in parts.wrapped:
            w.zero_grad(set_to_none=True)
        x, y = self.data.batch(step, cfg.global_batch_size)  # (B, T) each
        x, y = shard_batch(x, y, self.dp.index, self.dp.size)  # (B/dp, T)
        if self.topo.layout.cp > 1:  # this rank's tokens of every sequence
            cp, variant = self.topo.axis("cp"), cfg.cp_variant
            x, y = (shard_sequence(t, cp, variant).clone() for t in (x, y))
        x, y = x.to(self.device), y.to(self.device)
        k = cfg.grad_accum_steps
        counter = self._activation_counter(rec)
        losses, peak = [], 0
        if k > 1:  # each microbatch its own tensors, as a loader hands them
            x, y = [c.clone() for c in x.chunk(k)], [c.clone() for c in y.chunk(k)]
        else:
            x, y = [x], [y]
        for m, (xm, ym) in enumerate(zip(x, y)):  # (B/(dp·k), T)
            # without a pipeline the last microbatch's backward synchronizes (and
            # overlaps doing so); a pipeline synchronizes after its last flush
            quiet = parts.pipe is not None or m < k - 1
            with parts.sync.no_sync() if quiet else nullcontext():
                loss, held = self._forward_backward(xm, ym, k, m, counter, rec)
            losses.append(loss)
            peak = max(peak, held)
        parts.sync.finish_gradient_synchronization()
        with rec.span(Span.OPT):
            stepped = parts.optimizer.step()
        local = self._local_loss(losses)
        if counter is not None or parts.pipe is not None:
            self._activation_peak = peak if parts.pipe is not None else counter.peak
        if rec.enabled:
            rec.memory("step", **parts.memory(self._activation_peak))
        out = self._record(step, local, parts.optimizer.last_grad_norm, t0)
        out["skipped"] = not stepped
        out["loss_scale"] = parts.optimizer.scaler.scale_value
        return out

    def _forward_backward(self, x, y, k, m, counter, rec):
        """Microbatch (or pipeline flush) ``m`` of ``k``: forward, the loss scaled
        by ``1/k`` (and the loss scale), backward. Returns this rank's loss (None
        on a pipeline stage without the loss) and the activation bytes held."""
        parts, scaler = self.parts, self.parts.optimizer.scaler
        if parts.pipe is not None:
            scale = scaler.scale_value / k
            out = parts.pipe.step(x, y, loss_scale=scale, sync=False)
            return out["loss"], out["peak_activation_bytes"]
        with rec.span(Span.F, microbatch=m), counter or nullcontext():
            _, loss = parts.model(x, y)
        scaled = scaler.scale(loss / k if k > 1 else loss)
        # DDP records its own "B" span (with its bucket timings)
        own = parts.sync.records_backward
        with nullcontext() if own else rec.span(Span.B, microbatch=m):
            scaled.backward()
        return float(loss.detach()), 0

    def _local_loss(self, losses) -> float:
        """This rank's mean loss over its microbatches; with a pipeline it lives
        on the last stage and is sent along the pipe."""
        pp = self.topo.axis("pp")
        if self.parts.pipe is None:
            return sum(losses) / len(losses)
        known = [v if v is not None else 0.0 for v in losses]
        t = torch.tensor([sum(known) / len(known)], dtype=torch.float64)
        t = t.to(self.device)
        if pp.size > 1:  # the last stage's rank: pp - 1, or 0 in a V
            src = self.parts.pipe.schedule.loss_rank
            comm.broadcast(t, src=src, group=pp, tag="loss")
        return float(t[0])

    def _activation_counter(self, rec) -> SavedBytes | None:
        """A counter of this step's saved activations, or None when not needed."""
        if self.parts.pipe is not None:
            return None  # the pipeline counts its own, per microbatch
        if not rec.enabled or self._counted_steps >= self.COUNTED_STEPS:
            return None
        self._counted_steps += 1
        return SavedBytes(self.parts.weights)

    def _mean_over_dp(self, value: float) -> float:
        """The mean over every replica (dp, and cp: its ranks hold equal shares of
        every sequence)."""
        replicas = replica_axis(self.topo)
        if replicas.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, group=replicas, tag="metrics")
        return float(t[0]) / replicas.size

    def _record(self, step, local, norm, t0) -> dict:
        """The step's record (see the module docstring), with this rank's layout
        coordinates and the global throughput of the step."""
        cfg = self.config
        loss = self._mean_over_dp(local)
        seconds = telemetry.clock() - t0
        tokens_step = cfg.global_batch_size * cfg.model.seq_len
        return {
            "step": step,
            "rank": self.topo.rank,
            "strategy": cfg.strategy,
            "loss": loss,
            "local_loss": local,
            "grad_norm": norm,
            "lr": cfg.lr,
            "tokens": (step + 1) * tokens_step,
            "time_s": seconds,
            "tokens_per_s": tokens_step / seconds if seconds > 0 else float("inf"),
            "coords": dict(self.topo.coords),
            **self.parts.sync.stats(),  # DDP: its bucket timings
        }

    # ---- parity and resume -----------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """``{name in GPT: full tensor}`` of this rank's stage (parity tests)."""
        return self.parts.full_parameters()

    def random_state(self) -> dict:
        """This rank's random state: torch's CPU generator, its GPU's (under nccl)
        and the explicit streams of the model (tensor parallelism's, in module
        order). Copies."""
        cuda = self.device.type == "cuda"
        return {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if cuda else None,
            "streams": [s.get_states() for s in self._streams],
        }

    def set_random_state(self, state) -> None:
        """Put :meth:`random_state` back (of this rank, same config)."""
        if torch.is_tensor(state):  # saved before the streams were saved too
            state = {"torch": state, "cuda": None, "streams": None}
        torch.set_rng_state(state["torch"])
        if state["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)
        streams = state["streams"]
        if streams is not None:
            if len(streams) != len(self._streams):
                raise ValueError(
                    f"the random state holds {len(streams)} explicit streams, this "
                    f"trainer's model draws from {len(self._streams)}: load the "
                    "state of a trainer built with the same config"
                )
            for stream, states in zip(self._streams, streams):
                stream.set_states(states)

    def state_dict(self) -> dict:
        """Everything this rank needs to continue the run: its model state (its
        shards, under ZeRO, TP or PP), its optimizer state (master weights and the
        loss scaler under 16 bits), the step counter and the random state
        (:meth:`random_state`). Per rank: every rank saves its own, and loads it
        back into a trainer built with the same config at the same coordinates;
        :meth:`fit` then continues with the losses of the run that never
        stopped."""
        return {
            "step": self.step,
            "config": self.config.to_dict(),
            "coords": dict(self.topo.coords),
            "rng": self.random_state(),
            "parts": self.parts.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (of this rank, same config)."""
        mine = self.config.to_dict()
        theirs = state["config"]
        changed = sorted(
            k for k in mine if k not in ("steps",) and mine[k] != theirs.get(k)
        )
        if changed:
            raise ValueError(
                f"the state was saved from another config (differs in {changed}): "
                "build the trainer with the config it was saved from"
            )
        if state["coords"] != self.topo.coords:
            raise ValueError(
                f"the state belongs to the rank at {state['coords']}, this rank is at "
                f"{self.topo.coords}: load each rank's own state"
            )
        self.parts.load_state_dict(state["parts"])
        self.set_random_state(state["rng"])
        self.step = int(state["step"])


def rank_seed(seed: int, coords: dict[str, int]) -> int:
    """The seed of torch's generators on the rank at ``coords``: ``seed`` mixed with
    every coordinate (as dtlab mixes every seed: :func:`dtlab.model.param_generator`),
    so each rank draws its own masks, and the same ones in every run."""
    where = "/".join(f"{axis}{coords[axis]}" for axis in sorted(coords))
    return param_generator(seed, f"rank-rng/{where}").initial_seed()


def _random_streams(modules) -> list[TPRandom]:
    """The explicit generators the modules' dropouts draw from, each once, in module
    order (the same on every rank of one layout)."""
    found: dict[int, TPRandom] = {}
    for module in modules:
        for m in module.modules():
            rng = getattr(m, "rng", None)
            if isinstance(rng, TPRandom):
                found.setdefault(id(rng), rng)
    return list(found.values())


def train(config: TrainConfig, topo: Topology | None = None) -> list[dict]:
    """Train ``config`` on the current process group; this rank's per-step records."""
    return Trainer(config, topo).fit()

"""The one job every framework runs, and dtlab's run of it to compare with.

Taught in the "from dtlab to the real thing" sections (chapters 02, 03, 06, 07).
A :class:`~dtlab.train.TrainConfig` says what to train; here are its parts as
plain torch objects, so that a framework can wrap them its own way:

- :func:`build_model`: ``GPT(config.model, seed=config.seed)``, the weights every
  dtlab strategy starts from;
- :func:`build_optimizer`: the reference's AdamW
  (:func:`dtlab.reference.make_optimizer`) with the config's ``lr``, ``betas``,
  ``weight_decay``;
- :func:`local_batch`: the step's global batch of
  :class:`~dtlab.model.SyntheticTokens` and this rank's contiguous slice of it
  (:func:`~dtlab.model.shard_batch`), the slice dtlab's data-parallel strategies
  train on;
- :func:`mean_over_world`: the record's loss, this rank's loss averaged over the
  ranks in float64, as :class:`~dtlab.train.Trainer` reports it.

:func:`dtlab_run` trains the same config with dtlab's :class:`~dtlab.train.Trainer`
and returns the same fields as the framework runs: losses, the bytes sent per step
(counted by :class:`~dtlab.frameworks.traffic.CollectiveCounter`, the yardstick the
framework runs use) and the bytes of model state this rank holds.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dtlab.events import STATE_CATEGORIES, Kind
from dtlab.frameworks.traffic import CollectiveCounter
from dtlab.model import GPT, SyntheticTokens, shard_batch
from dtlab.reference import make_optimizer

__all__ = [
    "LAUNCH_ENV",
    "world",
    "check_job",
    "build_model",
    "build_optimizer",
    "build_data",
    "local_batch",
    "mean_over_world",
    "launch_env",
    "state_bytes",
    "dtlab_run",
]

# what a launcher tells each process (torchrun sets all of them; mp.spawn none)
LAUNCH_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_job(config, what: str) -> None:
    """Raise ``ValueError`` unless ``config`` is a job the framework runs take: data
    parallelism over the whole world, one microbatch per step, no clipping
    schedule they cannot express (what each framework supports is its own
    module's business; this is what they all share)."""
    _, n = world()
    layout = config.resolve_layout(n)
    if layout.tp > 1 or layout.pp > 1:
        raise ValueError(
            f"{what} runs data parallelism only, but the config's layout is {layout}: "
            "use layout=None (dp = world size)"
        )
    if config.grad_accum_steps != 1:
        raise ValueError(
            f"{what} runs one microbatch per step: use grad_accum_steps=1, not "
            f"{config.grad_accum_steps}"
        )
    if config.activation_checkpointing != "none":
        raise ValueError(
            f"{what} does not recompute activations: use "
            "activation_checkpointing='none'"
        )
    config.check(n)


def build_model(config) -> GPT:
    """The config's GPT in fp32, in training mode (its seeded weights)."""
    model = GPT(config.model, seed=config.seed)
    return model.train()


def build_optimizer(params, config) -> torch.optim.AdamW:
    """The reference's AdamW with the config's hyper-parameters (eps 1e-8)."""
    return make_optimizer(params, config.lr, config.weight_decay, config.betas)


def build_data(config) -> SyntheticTokens:
    return SyntheticTokens(
        config.model.vocab_size, config.model.seq_len, seed=config.data_seed
    )


def local_batch(data: SyntheticTokens, step: int, config):
    """This rank's slice of step ``step``'s global batch: ``(B/N, T)`` each."""
    rank, n = world()
    x, y = data.batch(step, config.global_batch_size)  # (B, T)
    return shard_batch(x, y, rank, n)  # (B/N, T)


def mean_over_world(value: float) -> float:
    """``value`` averaged over the ranks, summed in float64 (the Trainer's loss)."""
    rank, n = world()
    if n == 1:
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0]) / n


def launch_env() -> dict[str, str | None]:
    """The launcher's variables as this process sees them (``None``: unset)."""
    return {k: os.environ.get(k) for k in LAUNCH_ENV}


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def state_bytes(params, optimizer=None) -> dict[str, int]:
    """Bytes of model state on this rank: the parameters it holds (a DTensor's
    local shard), their gradients, and the optimizer's tensors (its own
    parameters when they are not the model's, e.g. fp32 masters or flat
    partitions, and every state tensor: Adam's moments)."""
    params = list(params)
    held = {id(p) for p in params}
    out = {
        "params": _bytes(params),
        "grads": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        own = [p for g in optimizer.param_groups for p in g["params"]]
        out["optimizer"] = _bytes(p for p in own if id(p) not in held) + _bytes(
            v
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )
    return out


def dtlab_run(config) -> dict:
    """Train ``config`` with dtlab's :class:`~dtlab.train.Trainer` on this rank
    (every rank of the world calls it). Returns ``{"losses", "grad_norms",
    "skipped", "loss_scale", "traffic": CollectiveCounter.per_step of each step,
    "memory": the last step's memory record}``."""
    from dtlab import telemetry
    from dtlab.train import Trainer

    rank, _ = world()
    recorder = telemetry.Recorder(rank)
    counter = CollectiveCounter()
    with telemetry.use(recorder):
        trainer = Trainer(config)
        for step in range(config.steps):
            counter.step = step
            with counter:
                trainer.fit(1)
    records = trainer.records
    memory = [e for e in recorder.events if e["kind"] == Kind.MEMORY][-1]
    return {
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],
        "skipped": [r["skipped"] for r in records],
        "loss_scale": [r["loss_scale"] for r in records],
        "traffic": [counter.per_step(s) for s in range(config.steps)],
        "memory": {k: memory[k] for k in STATE_CATEGORIES if k in memory},
    }

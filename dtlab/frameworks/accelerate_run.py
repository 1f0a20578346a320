"""HF accelerate on dtlab's job: ``Accelerator(cpu=True).prepare(model, optimizer,
dataloader)`` on the lab's engines, and ``accelerate launch`` headless.

Taught in chapter 07 ("from dtlab to the real thing"): the "three-line change" to
a training loop is ``accelerator = Accelerator()``, ``prepare(...)`` and
``accelerator.backward(loss)`` instead of ``loss.backward()``. What ``prepare``
does is visible in what it returns (:func:`train_accelerate` reports the types):
under the launcher's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*``
variables ``Accelerator(cpu=True)`` picks ``DistributedType.MULTI_CPU`` on gloo
(using the process group that exists, or starting one), the model comes back
inside ``torch.nn.parallel.DistributedDataParallel``, the optimizer inside an
``AcceleratedOptimizer`` (it steps the torch AdamW; with mixed precision it would
hold the GradScaler), and the data loader as a ``DataLoaderShard`` that hands each
rank its part of every batch. With ``split_batches=True`` that part is the
contiguous slice dtlab's :func:`~dtlab.model.shard_batch` takes, so the run is
torch's DDP on dtlab's slices: the same losses as dtlab's DDP, bit for bit on 2
ranks.

Two things accelerate does to a process: it sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` in ``os.environ``, and without
``OMP_NUM_THREADS`` it sets torch's thread count to the physical cores divided by
the local processes; :func:`train_accelerate` sets ``OMP_NUM_THREADS=1`` first,
as the lab's engines run one thread each. Its state is one per process (the
``AcceleratorState`` singleton): a second ``Accelerator`` in the same engine with a
different ``mixed_precision`` is refused, so these runs use one precision per
engine session.

``accelerate launch`` (:func:`launch`): on a machine without GPUs, ``--cpu`` starts
a single process unless an MPI host file is given; ``--multi_gpu`` hands the
processes to torch's own launcher (``torch.distributed.run``), and the script's
``Accelerator(cpu=True)`` then picks MULTI_CPU on gloo. That is what runs here:
``accelerate launch --multi_gpu --num_processes N -m dtlab.frameworks.accelerate_run``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from dtlab.frameworks import require
from dtlab.frameworks.job import (
    build_data,
    build_model,
    build_optimizer,
    check_job,
    launch_env,
    mean_over_world,
    world,
)
from dtlab.frameworks.launcher import (
    free_loopback_port,
    loopback_env,
    read_rank_records,
    run_bounded,
    write_rank_record,
)
from dtlab.frameworks.translate import MIXED_PRECISION

__all__ = ["train_accelerate", "launch", "main"]

MODULE = "dtlab.frameworks.accelerate_run"


def _type_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _dataset(config) -> torch.utils.data.TensorDataset:
    """Every step's global batch, in step order: a loader of ``batch_size =
    global_batch_size`` without shuffling yields them back one per step."""
    data = build_data(config)
    xs, ys = zip(
        *(data.batch(s, config.global_batch_size) for s in range(config.steps))
    )
    return torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))  # (S·B, T)


def _export_world_env() -> None:
    """The launcher's variables, from the world that exists (on the engines no
    launcher set them); nothing connects to ``MASTER_PORT``."""
    rank, n = world()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def train_accelerate(config) -> dict:
    """Train ``config`` through ``Accelerator(cpu=True).prepare`` on every rank of
    the current world. Returns ``{"losses", "prepared" (type names of what
    prepare returned), "distributed_type", "backend", "num_processes",
    "local_batch" (the shape of a rank's batch), "env" (the launcher's variables
    as found)}``."""
    require("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    check_job(config, "train_accelerate")
    found = launch_env()
    if torch.distributed.is_initialized():
        _export_world_env()
    accelerator = Accelerator(
        cpu=True,
        mixed_precision=MIXED_PRECISION[config.precision],
        # each rank takes its contiguous slice of every batch, as shard_batch does
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    model = build_model(config)
    optimizer = build_optimizer(model.parameters(), config)
    loader = torch.utils.data.DataLoader(
        _dataset(config), batch_size=config.global_batch_size, shuffle=False
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, shape = [], None
    for x, y in loader:  # (B/N, T) each
        shape = tuple(x.shape)
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        accelerator.backward(loss)  # loss.backward(), scaled under fp16
        if config.grad_clip is not None:
            accelerator.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(mean_over_world(loss.item()))
    return {
        "losses": losses,
        "prepared": [_type_name(t) for t in (model, optimizer, loader)],
        "distributed_type": str(accelerator.distributed_type).rsplit(".", 1)[-1],
        "backend": accelerator.state.backend,
        "num_processes": accelerator.num_processes,
        "local_batch": shape,
        "env": found,
    }


# ---- accelerate launch --------------------------------------------------------------
def main(argv=None) -> int:
    """The script ``accelerate launch`` runs: one rank of its world."""
    from dtlab.config import TrainConfig

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--config", required=True, help="TrainConfig JSON file")
    parser.add_argument("--out", required=True, help="directory for rank*.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with open(args.config) as f:
        config = TrainConfig.from_dict(json.load(f))
    out = train_accelerate(config)  # Accelerator() starts the process group
    out["rank"], _ = world()
    out["pid"], out["ppid"] = os.getpid(), os.getppid()
    write_rank_record(args.out, out)
    torch.distributed.barrier()  # no rank tears its sockets down under a peer's op
    torch.distributed.destroy_process_group()
    return 0


def launch(config, nproc: int = 2, *, timeout: float = 120) -> list[dict]:
    """``accelerate launch --multi_gpu --num_processes nproc`` of this module's
    script, from a subprocess killed after ``timeout`` seconds, on loopback.
    Returns each rank's record of :func:`train_accelerate`, in rank order."""
    require("accelerate")
    config.check(nproc)
    with tempfile.TemporaryDirectory(prefix="dtlab-accelerate-") as out:
        config_file = os.path.join(out, "config.json")
        with open(config_file, "w") as f:
            json.dump(config.to_dict(), f)
        command = [sys.executable, "-m", "accelerate.commands.launch"]
        command += ["--multi_gpu", "--num_processes", str(nproc)]
        command += ["--num_machines", "1", "--machine_rank", "0"]
        command += ["--main_process_ip", "127.0.0.1"]
        command += ["--main_process_port", str(free_loopback_port())]
        command += ["--mixed_precision", MIXED_PRECISION[config.precision]]
        command += ["--dynamo_backend", "no", "-m", MODULE]
        command += ["--config", config_file, "--out", out]
        start = time.monotonic()
        # HF_HOME: accelerate looks for a default config file there; none is used
        env = loopback_env(HF_HOME=os.path.join(out, "hf"))
        output = run_bounded(command, timeout=timeout, env=env)
        records = read_rank_records(out, nproc, output)
    for r in records:
        r.update(launcher="accelerate launch", wall_s=time.monotonic() - start)
    return records


if __name__ == "__main__":
    code = main()
    # the record is written and the world destroyed; leave without the interpreter's
    # teardown, where a C++ thread left behind by accelerate's state aborted one rank
    # in one run of many ("terminate called without an active exception", -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

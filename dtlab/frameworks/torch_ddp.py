"""PyTorch's own DDP on dtlab's job, on the lab's engines and as a script started by
``torch.multiprocessing.spawn`` or ``torchrun``.

Taught in chapter 02 ("from dtlab to the real thing"). :func:`train_ddp` is
:class:`dtlab.ddp.DistributedDataParallel`'s job with
``torch.nn.parallel.DistributedDataParallel`` instead: the same GPT, batch slices
and AdamW. Its reducer does what dtlab's does (buckets of ``bucket_cap_mb`` in
reverse order of the parameters, each all-reduced as soon as its gradients are
ready, divided by N first), so on 2 ranks the two give the same bits; on more,
gloo's all-reduce may add the ranks' shares in another order, a few ulp.

**Launchers.** The same job, as a script (``python -m dtlab.frameworks.torch_ddp``)
that reads its world from its launcher:

- ``--spawn N``: the script calls ``torch.multiprocessing.spawn(fn, nprocs=N)``
  itself. That starts N fresh interpreters (start method ``spawn``: nothing is
  inherited but what is pickled) and calls ``fn(i, *args)`` in each with its index
  ``i``: it sets no environment variable. The process is rank ``i``, and the
  rendezvous is the script's to make: rank 0 hosts a ``TCPStore`` on
  ``MASTER_ADDR:MASTER_PORT`` (what ``init_method="env://"`` does, but on a
  socket bound to 127.0.0.1 here, since torch's own store listens on every
  interface), the others connect to it.
- torchrun (``python -m torch.distributed.run --nproc-per-node N -m
  dtlab.frameworks.torch_ddp``): an agent process starts N workers as plain
  subprocesses and gives each ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_*`` and ``OMP_NUM_THREADS=1``; the store is the agent's own
  (``TORCHELASTIC_USE_AGENT_STORE``), hosted at ``--master-addr:--master-port``
  (static rendezvous) and listening on every interface, which torchrun cannot
  change (see ``cluster/torchrun.sh``).

Each rank writes ``rank{R}.json`` (its losses, the launcher's variables as it
found them, its start method and parent) to ``--out``. :func:`launch` runs either
launcher from a subprocess with a bounded wait, on loopback (``MASTER_ADDR``
127.0.0.1, ``GLOO_SOCKET_IFNAME=lo``), and returns those records in rank order.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad_norm_

from dtlab.amp import grad_norm
from dtlab.frameworks.job import (
    build_data,
    build_model,
    build_optimizer,
    check_job,
    launch_env,
    local_batch,
    mean_over_world,
    state_bytes,
    world,
)
from dtlab.frameworks.launcher import (
    free_loopback_port,
    loopback_env,
    read_rank_records,
    run_bounded,
    write_rank_record,
)
from dtlab.frameworks.traffic import CollectiveCounter

__all__ = ["LAUNCHERS", "train_ddp", "launch", "main"]

LAUNCHERS = ("spawn", "torchrun")
MODULE = "dtlab.frameworks.torch_ddp"


def _type_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def train_ddp(config) -> dict:
    """Train ``config`` with ``torch.nn.parallel.DistributedDataParallel`` on every
    rank of the current world (or on one process without one). Returns
    ``{"losses", "grad_norms", "traffic" (per step), "memory", "wrapped"}``;
    ``losses`` are the global-batch means, as :class:`dtlab.train.Trainer`'s."""
    check_job(config, "train_ddp")
    if config.strategy != "ddp" or config.precision != "fp32":
        raise ValueError(
            "train_ddp runs plain fp32 DDP: use strategy='ddp', precision='fp32' "
            "(ZeRO is fsdp2's or deepspeed_run's, 16 bits autocast's)"
        )
    model = build_model(config)
    _, n = world()
    if n > 1:
        # broadcasts rank 0's weights (already equal: GPT's init is seeded)
        model = torch.nn.parallel.DistributedDataParallel(
            model,
            bucket_cap_mb=config.bucket_cap_mb,
            find_unused_parameters=config.find_unused_parameters,
        )
    optimizer = build_optimizer(model.parameters(), config)
    data = build_data(config)
    counter = CollectiveCounter()
    losses, norms = [], []
    for step in range(config.steps):
        x, y = local_batch(data, step, config)  # (B/N, T)
        optimizer.zero_grad(set_to_none=True)
        counter.step = step
        with counter:
            _, loss = model(x, y)
            loss.backward()  # DDP's hooks all-reduce the buckets in here
        params = list(model.parameters())
        if config.grad_clip is None:
            norms.append(grad_norm(params))  # clip_grad_norm_'s order, no clipping
        else:
            norms.append(float(clip_grad_norm_(params, config.grad_clip)))
        optimizer.step()
        losses.append(mean_over_world(loss.item()))
    return {
        "losses": losses,
        "grad_norms": norms,
        "traffic": [counter.per_step(s) for s in range(config.steps)],
        "memory": state_bytes(model.parameters(), optimizer),
        "wrapped": _type_name(model),
    }


# ---- the script's side: one rank under a launcher ----------------------------------
def _rank_record(config, found_env: dict, rendezvous: str) -> dict:
    rank, n = world()
    out = train_ddp(config)
    return {
        "rank": rank,
        "world_size": n,
        "losses": out["losses"],
        "env": found_env,
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "rendezvous": rendezvous,
        "wrapped": out["wrapped"],
    }


def _loopback_store(rank: int, world_size: int, port: int, timeout: float):
    """The env:// rendezvous, made by hand: rank 0 hosts a TCPStore on a socket
    bound to 127.0.0.1 (torch's own would listen on every interface), the others
    connect to ``127.0.0.1:port``."""
    wait = datetime.timedelta(seconds=timeout)
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=wait)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        True,
        timeout=wait,
        master_listen_fd=sock.detach(),  # the store owns the socket from now on
    )
    return store


def _spawned(index: int, world_size: int, config_dict: dict, out_dir: str) -> None:
    """What ``mp.spawn`` runs in each child: ``index`` is all it is told."""
    from dtlab.config import TrainConfig

    torch.set_num_threads(1)
    found = launch_env()  # before this function sets anything: what spawn gave
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index))
    os.environ["WORLD_SIZE"] = str(world_size)
    port = int(os.environ["MASTER_PORT"])
    store = _loopback_store(index, world_size, port, timeout=60)
    wait = datetime.timedelta(seconds=60)
    dist.init_process_group(
        "gloo", store=store, rank=index, world_size=world_size, timeout=wait
    )
    try:
        config = TrainConfig.from_dict(config_dict)
        write_rank_record(
            out_dir, _rank_record(config, found, "TCPStore on 127.0.0.1 (rank 0)")
        )
        dist.barrier()  # no rank tears its sockets down under a peer's op
    finally:
        dist.destroy_process_group()
    # the record is written and the world destroyed: leave without the interpreter's
    # teardown, where a thread gloo left behind aborted one spawned rank in one run
    # of several ("terminate called without an active exception", SIGABRT); exit
    # code 0 is what torch.multiprocessing.spawn's join waits for
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _under_torchrun(config, out_dir: str) -> None:
    torch.set_num_threads(1)
    found = launch_env()
    # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun; the store
    # is the agent's (TORCHELASTIC_USE_AGENT_STORE), this process connects to it
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        write_rank_record(
            out_dir, _rank_record(config, found, "torchrun agent's TCPStore")
        )
        dist.barrier()  # no rank tears its sockets down under a peer's op
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """The script: under torchrun (``RANK`` set) one rank; with ``--spawn N``
    the parent of N ranks started by ``torch.multiprocessing.spawn``."""
    from dtlab.config import TrainConfig

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--config", required=True, help="TrainConfig JSON file")
    parser.add_argument("--out", required=True, help="directory for rank*.json")
    parser.add_argument("--spawn", type=int, default=0, metavar="N")
    args = parser.parse_args(argv)
    with open(args.config) as f:
        config_dict = json.load(f)
    config = TrainConfig.from_dict(config_dict)
    if args.spawn:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_loopback_port()))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.multiprocessing.spawn(
            _spawned,
            args=(args.spawn, config_dict, args.out),
            nprocs=args.spawn,
            join=True,  # raises ProcessRaisedException with the child's traceback
            start_method="spawn",
        )
        return 0
    if "RANK" not in os.environ:
        parser.error("run under torchrun (RANK is not set), or pass --spawn N")
    _under_torchrun(config, args.out)
    return 0


# ---- the caller's side: a launcher in a subprocess, with a bounded wait ------------
def _command(launcher: str, nproc: int, config_file: str, out: str) -> list[str]:
    script = ["-m", MODULE, "--config", config_file, "--out", out]
    if launcher == "spawn":
        return [sys.executable, *script, "--spawn", str(nproc)]
    port = str(free_loopback_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    torchrun += ["--nproc-per-node", str(nproc), "--max-restarts", "0"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", port]
    return [*torchrun, *script]


def launch(launcher: str, config, nproc: int = 2, *, timeout: float = 120) -> list:
    """Run the script under ``launcher`` (``"spawn"`` or ``"torchrun"``) on
    ``nproc`` local processes, from a subprocess that is killed after
    ``timeout`` seconds. Returns each rank's record, in rank order."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, not {launcher!r}")
    config.check(nproc)
    with tempfile.TemporaryDirectory(prefix=f"dtlab-{launcher}-") as out:
        config_file = os.path.join(out, "config.json")
        with open(config_file, "w") as f:
            json.dump(config.to_dict(), f)
        start = time.monotonic()
        command = _command(launcher, nproc, config_file, out)
        output = run_bounded(command, timeout=timeout, env=loopback_env())
        records = read_rank_records(out, nproc, output)
    for r in records:
        r.update(launcher=launcher, wall_s=time.monotonic() - start)
    return records


if __name__ == "__main__":
    code = main()
    # the record is written and the world destroyed; leave without the interpreter's
    # teardown, where a C++ thread left behind by gloo aborted one torchrun rank in
    # one run of many ("terminate called without an active exception", -6), as
    # dtlab.frameworks.accelerate_run does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

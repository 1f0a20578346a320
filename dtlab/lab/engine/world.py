"""Joining and leaving the world: what the notebook calls on every engine at start,
at each ``cluster.reset()`` and at ``cluster.stop()``.

Engine ids are not ranks, and the local launcher gives every engine the same
environment, so the notebook passes each engine its rank (and, on GPU, its device)
explicitly; :func:`whereami` tells it, before any world exists, where each engine
runs so that it can choose them (:mod:`dtlab.lab.kernel.placement`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dtlab import launch
from dtlab.lab.engine import board, rawdist
from dtlab.lab.engine.failfast import on_cell_error
from dtlab.lab.engine.state import state, user_namespace
from dtlab.topology import Layout, Topology


def whereami() -> dict:
    """Where this engine runs: its pid, its host's name, its cores and the GPUs it
    sees (``visible``: its ``CUDA_VISIBLE_DEVICES``, which Slurm sets per task). The
    notebook maps ranks to GPUs from these, before any world exists."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "gpus": gpus,
        "cpus": os.cpu_count() or 1,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def setup(
    rank,
    world_size,
    backend,
    store_file,
    timeout,
    device,
    generation,
    peers=(),
    board_file=None,
    check_collectives=False,
    single_host=True,
):
    """Join the world as ``rank`` and expose ``rank``, ``world_size``, ``topo`` to
    ``%%px`` cells. Called on every engine at start and at each reset.

    ``peers``: the pids of the other engines on this engine's host (what
    :func:`~dtlab.lab.engine.failfast.sever_peer_connections` looks at).
    ``single_host=False``: the world spans machines; ``store_file`` is then on a
    filesystem they share. ``board_file``: the file this rank keeps its current op
    in (:mod:`~dtlab.lab.engine.board`). ``check_collectives``: wrap the groups in
    torch's collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``): every
    collective first compares op, shapes and dtypes across ranks, so a mismatch is
    a clean error on every rank instead of a hang or an aborted process, at a cost
    of a few milliseconds per collective (measured on 2 CPU ranks)."""
    torch.set_num_threads(1)
    launch.abort_process_group()  # leave any previous world first
    # read when a group is created: it applies to this world's groups only
    if check_collectives:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    else:
        dist.set_debug_level_from_env()  # off, unless the engines' environment says
    os.makedirs(os.path.dirname(store_file), mode=0o700, exist_ok=True)
    board.open_board(board_file)
    rawdist.install()  # raw torch.distributed calls are on the board too
    launch.init_process_group(
        rank,
        world_size,
        backend=backend,
        store_file=store_file,
        timeout=timeout,
        device=device,
        single_host=single_host,
    )
    state.rank, state.world_size, state.generation = rank, world_size, generation
    state.broken = None
    state.peers = [p for p in peers if p != os.getpid()]
    topo = Topology(Layout(dp=world_size), rank)
    namespace = user_namespace()
    namespace.update(
        rank=rank, world_size=world_size, topo=topo, dist=dist, torch=torch
    )
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None and on_cell_error not in shell.events.callbacks.get(
            "post_run_cell", []
        ):
            shell.events.register("post_run_cell", on_cell_error)
    except ImportError:  # pragma: no cover
        pass
    return {"rank": rank, "pid": os.getpid(), "host": os.uname().nodename}


def health() -> dict:
    """This rank's view of itself: pid, process group up, why it is broken."""
    return {
        "rank": state.rank,
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "broken": state.broken,
        "generation": state.generation,
    }


def teardown() -> None:
    """Leave the world for good (the cluster is stopping)."""
    launch.abort_process_group()
    state.broken = "stopped"
    board.open_board(None)

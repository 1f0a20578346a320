"""Which rank runs where: pure functions of what this machine and the engines report.

Taught in chapter 01 (engines are not ranks) and chapter 07 (placing a 3D layout).

Two decisions, both before any process group exists:

- :func:`check_request`: can *this* machine give what ``LabCluster(world_size,
  backend=...)`` asks for? Only without a profile: a profile's engines may run
  elsewhere, and are checked once they report.
- :func:`host_order`: ranks follow hosts (each host's contiguous, the notebook's
  first), then engine ids;
- :func:`place`: from what each engine reported (``pid``, ``host``, ``cpus``,
  ``gpus``, ``visible``: :func:`dtlab.lab.engine.world.whereami`), rank ``r`` is the
  ``r``-th engine in that order; each rank's GPU is its position among the
  engines of its own host that see the same GPUs; ``backend="auto"`` becomes nccl
  when every engine sees a GPU. A world that spans hosts meets in a folder they
  all share (:func:`rendezvous_folder`), as nothing may listen for it.

Raises ``ValueError`` naming what the machines cannot give.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dtlab.checks import positive_int
from dtlab.launch import max_cpu_world_size

BACKENDS = ("auto", "gloo", "nccl")


def check_request(
    world_size: int | None, backend: str, *, gpus: int | None, engines: str = "local"
) -> tuple[int, str]:
    """``(world_size, backend)`` for what ``LabCluster(world_size, backend=...)``
    asks, checked against this machine's ``gpus`` and cores when its engines run
    here (``engines="local"``; another launcher's are checked for GPUs only).
    ``world_size=None``: one engine per GPU, or 4 CPU engines. ``gpus=None``: the
    engines run where a profile puts them, so only the request itself is checked
    (and ``backend="auto"`` waits for what the engines report)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if gpus is None:
        if world_size is None:
            raise ValueError(
                "with a profile, give world_size: the engines' machines decide "
                "how many GPUs there are, not this one"
            )
        return positive_int("world_size", world_size), backend
    if backend == "auto":
        backend = "nccl" if gpus else "gloo"
    if world_size is None:
        world_size = gpus if backend == "nccl" else 4
    positive_int("world_size", world_size)
    if backend == "nccl":
        if not gpus:
            raise ValueError(
                "backend 'nccl' needs GPUs, and this machine has none: "
                "use backend='gloo' (CPU engines)"
            )
        if world_size > gpus and engines == "local":
            raise ValueError(
                f"world_size={world_size} needs one GPU per engine, but "
                f"{gpus} are visible: use world_size <= {gpus}, or backend='gloo'"
            )
    elif engines == "local" and world_size > max_cpu_world_size():
        raise ValueError(
            f"world_size={world_size} CPU engines is more than this machine can "
            f"run ({os.cpu_count()} cores): use at most {max_cpu_world_size()}"
        )
    return world_size, backend


@dataclass(frozen=True)
class Placement:
    """Where each rank runs: its engine's ``pids`` (on its own host), ``hosts``,
    ``devices`` (its GPU on nccl, ``None`` on gloo), the ``backend`` the world uses,
    and ``here``, the name of the machine the notebook runs on."""

    backend: str
    pids: dict[int, int]
    hosts: dict[int, str]
    devices: dict[int, int | None]
    here: str

    @property
    def single_host(self) -> bool:
        """Whether every engine runs on the notebook's machine."""
        return set(self.hosts.values()) == {self.here}

    def local_pids(self) -> dict[int, int]:
        """Rank -> pid for the engines of this machine (only those can be watched
        and signalled by pid here)."""
        return {r: p for r, p in self.pids.items() if self.hosts.get(r) == self.here}

    def peers(self, rank: int) -> list[int]:
        """The pids of the engines that share ``rank``'s host (``rank``'s own too)."""
        return [p for r, p in self.pids.items() if self.hosts[r] == self.hosts[rank]]


def place(
    where: list[dict],
    backend: str = "auto",
    *,
    store_dir: str | None = None,
    here: str | None = None,
) -> Placement:
    """Ranks onto hosts and GPUs from what each engine reported, rank ``r`` from
    ``where[r]``.

    Engines of one host that see the same GPUs (the ssh profile, a local start)
    take them in rank order: device 0, 1, ... Engines that each see their own
    (Slurm's ``--gpus-per-task=1`` sets ``CUDA_VISIBLE_DEVICES`` per task) each take
    their device 0. ``store_dir``: the shared folder a world across hosts needs.
    ``here``: this machine's name (``os.uname().nodename`` by default)."""
    here = here or os.uname().nodename
    if backend == "auto":
        backend = "nccl" if all(w["gpus"] for w in where) else "gloo"
    by_host: dict[str, list[int]] = {}
    by_view: dict[tuple, list[int]] = {}  # engines sharing one set of GPUs
    for r, w in enumerate(where):
        by_host.setdefault(w["host"], []).append(r)
        by_view.setdefault((w["host"], w.get("visible")), []).append(r)
    devices: dict[int, int | None] = {}
    for (host, visible), ranks in by_view.items():
        gpus = where[ranks[0]]["gpus"]
        if backend == "nccl" and len(ranks) > gpus:
            seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""
            raise ValueError(
                f"host {host} runs {len(ranks)} engines (ranks {ranks}) that "
                f"share {gpus} GPUs{seen}: nccl needs one GPU per engine; ask "
                "for fewer engines per host, or use backend='gloo'"
            )
        for i, r in enumerate(ranks):  # rank order among those engines
            devices[r] = i if backend == "nccl" else None
    for host, ranks in by_host.items():
        cpus = where[ranks[0]]["cpus"]
        if backend == "gloo" and len(ranks) > max_cpu_world_size(cpus):
            raise ValueError(
                f"host {host} runs {len(ranks)} CPU engines on {cpus} cores: "
                f"use at most {max_cpu_world_size(cpus)} per host"
            )
    placement = Placement(
        backend=backend,
        pids={r: w["pid"] for r, w in enumerate(where)},
        hosts={r: w["host"] for r, w in enumerate(where)},
        devices=devices,
        here=here,
    )
    if not placement.single_host and store_dir is None:
        raise ValueError(
            f"the engines run on {sorted(by_host)}, not only on this machine "
            f"({here}): their rendezvous file must be on a filesystem "
            "they all share. Pass store_dir='/shared/folder' (or set "
            "DTLAB_STORE_DIR), the same path on every host"
        )
    return placement


def host_order(where: list[dict], ids: list[int], here: str | None = None):
    """The engines (indices into ``where``, which lists them by engine id ``ids``)
    in rank order: each host's contiguous, this machine's (``here``) first, then
    by engine id. A layout's innermost axis, tensor parallelism, then stays
    within a host (ipyparallel numbers engines in the order they register, which
    mixes hosts)."""
    here = here or os.uname().nodename
    return sorted(
        range(len(where)),
        key=lambda i: (where[i]["host"] != here, where[i]["host"], ids[i]),
    )


def rendezvous_folder(
    placement: Placement, *, private_dir: str, shared_dir: str | None, token: str
) -> str:
    """Where the ranks' file store goes: the cluster's ``private_dir`` when every
    engine runs on this machine, else a folder of its own (``dtlab-<token>``) in
    ``shared_dir``, which every host sees at the same path."""
    if placement.single_host:
        return private_dir
    if shared_dir is None:
        raise ValueError("a world across hosts needs a shared folder (store_dir)")
    return os.path.join(shared_dir, f"dtlab-{token}")

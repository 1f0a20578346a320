"""The live cluster: one ipyparallel engine per rank, driven from the notebook.

Taught in chapter 01; every later chapter starts with ``cluster = start(...)``.

    from dtlab.lab import start             # dtlab.lab.kernel.notebook.start
    cluster = start(world_size=4)           # 4 CPU engines on gloo (or 1 per GPU)
    cluster.run(fn, *args)                  # fn on every rank; results in rank order
    cluster.reset()                         # fresh process group, same engines
    cluster.restart()                       # fresh engines
    cluster.stop()

Each engine is a separate Python process that joined one ``torch.distributed`` world
with an explicit rank (engine ids are not ranks: :mod:`dtlab.lab.kernel.placement`).
``%%px`` cells see ``rank``, ``world_size`` and ``topo`` on every engine. What runs
*on* the engines is in :mod:`dtlab.lab.engine`; this module is the notebook's side.

An error on a rank, a rank that never arrives, a dead engine, the notebook's Stop
button: each comes back as an error that names the rank and says what every rank
was doing (:mod:`dtlab.lab.kernel.failures`); :meth:`LabCluster.doing` shows that any
time.

Everything listens on loopback only: the ipyparallel controller is bound to
127.0.0.1, and the torch.distributed rendezvous is a file store (torch's TCPStore
would listen on every interface).

Engines on several machines (the ``cluster/ssh`` and ``cluster/slurm`` profiles):
each engine reports its host, pid and GPUs before the world forms. Ranks get the
GPUs of their own host in rank order; the rendezvous file goes into ``store_dir``
(or ``$DTLAB_STORE_DIR``), a folder every host sees at the same path (a shared
filesystem), so nothing listens for it; gloo uses the profile's interface instead
of loopback; engines of other hosts are watched through ipyparallel's heartbeat and
signalled through its control channel, never by a pid of this machine.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable

from dtlab.lab.engine import call, world
from dtlab.lab.kernel import (
    failures,
    output,
    placement,
    processes,
    replacing,
    shipping,
    teardown,
    variables,
    waiting,
)
from dtlab.lab.kernel.failures import WorldDown


class LabCluster:
    """A local (or profile-launched) ipyparallel cluster with a torch.distributed
    world over its engines. Usable as a context manager; stopped at exit.

    ``world_size``: engines (ranks); by default one per GPU, or 4 CPU engines.
    ``backend``: ``"gloo"``, ``"nccl"`` or ``"auto"`` (nccl when every engine sees a
    GPU). ``timeout``: the process group's collective timeout in seconds.
    ``profile_dir``: an ipyparallel profile deciding where the controller and the
    engines run (``cluster/local``, ``cluster/ssh``, ``cluster/slurm``).
    ``store_dir`` (or ``$DTLAB_STORE_DIR``): a folder every engine's host sees at
    the same path, for the rendezvous of a world that spans machines.
    ``check_collectives``: torch's collective checker on every group (mismatched
    collectives become clean errors, for a few ms per collective:
    :mod:`dtlab.lab.kernel.failures`).
    """

    def __init__(
        self,
        world_size: int | None = None,
        *,
        backend: str = "auto",
        timeout: float = 30.0,
        call_timeout: float = 600.0,
        engines: str = "local",
        start_timeout: float = 120.0,
        heartbeat_ms: int = 100,
        profile_dir: str | os.PathLike | None = None,
        check_collectives: bool = False,
        store_dir: str | os.PathLike | None = None,
    ):
        import torch

        if profile_dir is not None and not os.path.isdir(profile_dir):
            raise ValueError(f"no ipyparallel profile folder at {profile_dir!r}")
        # without a profile the engines are this machine's processes: check now
        # what it can give; a profile's engines may run elsewhere, so their GPUs and
        # cores are checked once they report (see place)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.world_size, self.backend = placement.check_request(
            world_size,
            backend,
            gpus=gpus if profile_dir is None else None,
            engines=engines,
        )
        self.timeout = float(timeout)
        self.call_timeout = float(call_timeout)
        self.engines = engines
        self.start_timeout = start_timeout
        self.heartbeat_ms = heartbeat_ms
        self.check_collectives = bool(check_collectives)
        self.profile_dir = os.path.abspath(profile_dir) if profile_dir else None
        # where the rendezvous file goes when the engines span machines
        store_dir = store_dir or os.environ.get("DTLAB_STORE_DIR") or None
        if store_dir is not None and not os.path.isdir(store_dir):
            raise ValueError(
                f"store_dir {str(store_dir)!r} is not a folder: give one that every "
                "engine's machine sees at the same path (a shared filesystem)"
            )
        self.store_dir = os.path.abspath(store_dir) if store_dir else None
        self.ipp_cluster = None  # the ipyparallel.Cluster, while running
        self.client = None
        self.view = None
        self.rank_to_engine: dict[int, int] = {}
        self.placement: placement.Placement | None = None
        self.generation = 0
        self.private_dir: str | None = None  # the rendezvous file, the status boards
        self.last_events: list[dict] = []
        self.start_seconds: float | None = None
        self.start_phases: dict[str, float] = {}
        self.last_epoch: float | None = None  # the time axis of the last run's events
        self.needs_reset = False  # the next run starts with a fresh process group
        self.px_active = False  # %%px cells target this cluster (see start())
        self._token = secrets.token_hex(8)  # names this cluster's shared folder

    # ---- where the ranks are (dtlab.lab.kernel.placement) -------------------------
    @property
    def pids(self) -> dict[int, int]:
        """Each rank's engine pid, on its own host."""
        return dict(self.placement.pids) if self.placement else {}

    def local_pids(self) -> dict[int, int]:
        """Rank -> pid for the engines of this machine."""
        return self.placement.local_pids() if self.placement else {}

    def place(self, where: list[dict]) -> placement.Placement:
        """Decide each rank's host and GPU, and the backend ``"auto"`` stands for,
        from what every engine reported (:func:`dtlab.lab.engine.world.whereami`);
        :meth:`start` calls it before the world forms. Raises ``ValueError`` for
        what the machines cannot give (:func:`dtlab.lab.kernel.placement.place`)."""
        self.placement = placement.place(where, self.backend, store_dir=self.store_dir)
        self.backend = self.placement.backend
        return self.placement

    def rendezvous_folder(self) -> str:
        """Where the ranks meet
        (:func:`dtlab.lab.kernel.placement.rendezvous_folder`)."""
        return placement.rendezvous_folder(
            self.placement,
            private_dir=self.private_dir,
            shared_dir=self.store_dir,
            token=self._token,
        )

    def store_file(self) -> str:
        """The rendezvous file of the current generation's world."""
        return os.path.join(self.rendezvous_folder(), f"store-{self.generation}")

    def board_file(self, rank: int) -> str | None:
        """The status file rank ``rank`` writes what it is doing into
        (:mod:`dtlab.lab.engine.board`): in the private folder when every engine
        runs here, in the shared one (``store_dir``) when they span machines;
        ``None`` when there is no folder every engine can write."""
        if self.private_dir is None or self.placement is None:
            return None
        if not self.placement.single_host and self.store_dir is None:
            return None
        return os.path.join(self.rendezvous_folder(), f"board-{rank}")

    # ---- lifecycle --------------------------------------------------------------
    def start(self) -> LabCluster:
        """Start the controller and the engines, and form the world. Where the time
        went is kept in :attr:`start_phases` (seconds per phase)."""
        t0 = last = time.perf_counter()
        self.start_phases = {}

        def phase(name: str) -> None:
            nonlocal last
            now = time.perf_counter()
            self.start_phases[name] = now - last
            last = now

        self.private_dir = tempfile.mkdtemp(prefix="dtlab-cluster-")
        self.ipp_cluster = processes.ipp_cluster(
            self.world_size,
            engines=self.engines,
            heartbeat_ms=self.heartbeat_ms,
            profile_dir=self.profile_dir,
            private_dir=self.private_dir,
        )
        teardown.register(self)
        try:
            # not start_and_connect: in a notebook it draws a progress widget;
            # every process under a lifeline that ends it with this kernel
            processes.start_controller(self.ipp_cluster)
            phase("controller")
            processes.start_engines(self.ipp_cluster, self.world_size)
            self.client = self.ipp_cluster.connect_client_sync()
            phase("engines launched")
            self.client.wait_for_engines(
                self.world_size, timeout=self.start_timeout, interactive=False
            )
            phase("engines registered")
            ids = sorted(self.client.ids)[: self.world_size]
            # an explicit rank map (engine ids are not ranks): by engine id, to
            # ask each engine where it runs, then by host
            self.rank_to_engine = dict(enumerate(ids))
            self.connect_view()
            where = self.view.apply_async(world.whereami).get(
                timeout=self.start_timeout
            )
            phase("torch imported")
            # each host's ranks contiguous (placement.host_order)
            order = placement.host_order(where, ids)
            self.rank_to_engine = {r: ids[i] for r, i in enumerate(order)}
            self.connect_view()
            self.place([where[i] for i in order])
            # the first setup also imports torch on every engine: on a busy machine
            # that alone takes tens of seconds, so it gets the start-up budget
            self._init_world(wait=self.start_timeout + self.timeout)
            phase("process group")
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        return self

    def connect_view(self) -> None:
        """The view of every rank's engine, in rank order (again, after an engine
        was replaced); ``%%px`` cells use it once :func:`start` activated it."""
        self.view = self.client[
            [self.rank_to_engine[r] for r in sorted(self.rank_to_engine)]
        ]
        self.view.use_cloudpickle()
        if self.px_active:
            # %%px cells wait for their ranks and show their output in the cell
            # (a non-blocking view would leave only "<AsyncResult: pending>")
            self.view.block = True
            self.view.activate()

    def signal(self, ranks, signum: int) -> None:
        """Send ``signum`` to the engines of ``ranks``: by pid on this machine,
        through ipyparallel's control channel on another."""
        local = self.local_pids()
        remote = [self.rank_to_engine[r] for r in ranks if r not in local]
        processes.signal_engines(
            self.ipp_cluster, [local[r] for r in ranks if r in local], remote, signum
        )

    def _init_world(self, wait: float | None = None) -> None:
        """(Re)create the torch.distributed world on every engine."""
        self.generation += 1
        store_file = self.store_file()
        pending = [
            self.client[eid].apply_async(
                world.setup,
                rank,
                self.world_size,
                self.backend,
                store_file,
                self.timeout,
                self.placement.devices.get(rank),
                self.generation,
                self.placement.peers(rank),
                self.board_file(rank),
                self.check_collectives,
                self.placement.single_host,
            )
            for rank, eid in self.rank_to_engine.items()
        ]
        waiting.wait_for_ranks(
            self,
            pending,
            timeout=wait or self.timeout + 30,
            what="joining the process group",
        )
        for rank, eid in self.rank_to_engine.items():
            self.client[eid].push({"rank": rank}, block=True)
        self.needs_reset = False

    def reset(self, *, check_collectives: bool | None = None) -> LabCluster:
        """A fresh process group on the same engines (after an error or a hang that
        ended in a timeout). Engine state other than the group is kept.

        ``check_collectives=True`` turns torch's collective checker on for the new
        group (mismatched ops or shapes become clean errors on every rank instead of
        a hang or an aborted engine; each collective costs a few ms more)."""
        self.check_running()
        if check_collectives is not None:
            self.check_collectives = bool(check_collectives)
        waiting.check_alive(self, stopped_for=0.0)
        replacing.replace_dropped(self)  # alive, but the controller forgot them
        self._init_world()
        return self

    def restart(self) -> LabCluster:
        """Stop every engine and the controller, and start new ones."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        """Stop the engines and the controller; return once every process of
        this machine that the cluster started has exited. Safe to call twice.

        Local processes are killed at once, whatever they are doing (a cluster
        that stops has nothing left to save: a learner's state lives in the
        notebook); ipyparallel's own stop then finds them gone, and stops the
        engines of other hosts through their launchers."""
        ipp_cluster, self.ipp_cluster = self.ipp_cluster, None
        procs = self.kill(ipp_cluster)
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        self.client = self.view = None
        left = processes.wait_gone(procs)
        if ipp_cluster is not None:
            try:
                ipp_cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001
                pass
        if left:  # pragma: no cover - SIGKILL does not fail on our own processes
            raise RuntimeError(f"processes {[p.pid for p in left]} did not exit")
        if self.placement is not None and not self.placement.single_host:
            shutil.rmtree(self.rendezvous_folder(), ignore_errors=True)
        self.placement = None
        if self.private_dir:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = None
        teardown.forget(self)

    def kill(self, ipp_cluster=None) -> list:
        """SIGKILL every local process of the cluster (controller, engines, their
        children) without waiting or asking ipyparallel: what the kernel's SIGTERM
        handler does (:mod:`dtlab.lab.kernel.teardown`). Returns the processes
        (psutil)."""
        ipp_cluster = ipp_cluster or self.ipp_cluster
        pids = [x.process.pid for x in processes.local_launchers(ipp_cluster)]
        pids += list(self.local_pids().values())  # whatever the launcher missed
        return processes.kill(pids)

    @property
    def running(self) -> bool:
        return self.ipp_cluster is not None and self.client is not None

    def __enter__(self) -> LabCluster:
        return self if self.running else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<LabCluster {self.world_size}×{self.backend} {state}>"

    # ---- running code on every rank -------------------------------------------
    def run(
        self,
        fn: Callable,
        *args,
        timeout: float | None = None,
        record: bool = False,
        on_events: Callable[[list[dict]], None] | None = None,
        publish_interval: float = 0.1,
        show_output: bool | None = None,
        **kwargs,
    ) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank
        order.

        ``record=True`` (or an ``on_events`` callback) turns telemetry on for the
        call: every rank records comm/compute/memory events, ``on_events`` receives
        batches live while the call runs, and all events end up in
        :attr:`last_events` afterwards. ``timeout`` bounds the whole call (default:
        the cluster's ``call_timeout``). What ``fn`` prints shows under the cell,
        one area per rank (``show_output``; by default from the main thread only:
        :mod:`dtlab.lab.kernel.output`).
        """
        self.check_running()
        replacing.require_registered(self)  # a dropped engine: say reset/restart
        shipping.ship_by_value(fn)
        record = record or on_events is not None
        interval = publish_interval if on_events is not None else 0.0
        for attempt in range(2):
            if self.needs_reset:
                self.reset()
            epoch = self.last_epoch = time.time()  # one time axis for every rank
            pending = [
                self.client[eid].apply_async(
                    call.call, fn, args, kwargs, record, interval, epoch
                )
                for _, eid in sorted(self.rank_to_engine.items())
            ]
            delivered = [0] * len(pending)  # events handed to on_events, per rank
            live = None
            if on_events is not None:

                def live(rank, batch, delivered=delivered):
                    delivered[rank] += len(batch)
                    on_events(batch)

            try:
                out = waiting.wait_for_ranks(
                    self,
                    pending,
                    timeout=timeout or self.call_timeout,
                    what=getattr(fn, "__name__", "the function"),
                    on_events=live,
                    output=output.per_rank(pending, show_output),
                )
                break
            except WorldDown:
                # a %%px cell failed on some rank and took the group down: nothing
                # of fn ran yet, so reset and run it once more
                self.needs_reset = True
                if attempt:
                    raise
            except BaseException:
                self.needs_reset = True
                raise
        values = [v for v, _ in out]
        if record:
            self.last_events = [e for _, events in out for e in (events or [])]
        if on_events is not None:
            # Publications can arrive after the result (ipyparallel stops updating
            # AsyncResult.data once the task returns): the result carries every
            # event, and the live stream was a prefix of it, so hand on the rest.
            for rank, (_, events) in enumerate(out):
                rest = (events or [])[delivered[rank] :]
                if rest:
                    on_events(rest)
        return values

    def train(self, config, **kwargs):
        """Train a :class:`dtlab.train.TrainConfig` on every rank, with a live loss
        plot by default: see :func:`dtlab.lab.kernel.training.train_on_cluster`."""
        from dtlab.lab.kernel.training import train_on_cluster

        return train_on_cluster(self, config, **kwargs)

    def health(self) -> list[dict]:
        """Each rank's view of itself: pid, process group up, broken reason."""
        self.check_running()
        replacing.require_registered(self)
        return waiting.wait_for_ranks(
            self,
            [
                self.client[eid].apply_async(world.health)
                for _, eid in sorted(self.rank_to_engine.items())
            ],
            timeout=10,
            what="health check",
        )

    # ---- the ranks' namespaces and status ---------------------------------------
    def push(self, values: dict | None = None, *, ranks=None, **named) -> None:
        """Set variables in every rank's namespace (or ``ranks``'), the one
        ``%%rank`` cells see: ``cluster.push(lr=0.1)``
        (:mod:`dtlab.lab.kernel.variables`)."""
        variables.push(self, {**(values or {}), **named}, ranks)

    def pull(self, name: str, *, ranks=None) -> list:
        """Each rank's variable ``name``, in rank order."""
        return variables.pull(self, name, ranks)

    def status(self):
        """Every rank's pid, host, device, memory, current or last operation and
        heartbeat age, as a table (:mod:`dtlab.lab.kernel.status`)."""
        from dtlab.lab.kernel.status import status

        return status(self)

    def doing(self) -> dict[int, str]:
        """What each rank is doing right now, in words (``"in all_reduce(numel=8,
        float32, group dp) for 2.1s"``), read from the status file each engine
        keeps, so it answers while ranks are stuck, and names a dead rank's last
        collective. Costs no engine time."""
        if self.private_dir is None:
            return {}
        now = time.time()
        return {
            r: failures.describe_board(failures.read_board(self.board_file(r)), now)
            for r in sorted(self.rank_to_engine)
        }

    def check_running(self) -> None:
        """Raise ``RuntimeError`` unless the cluster is running."""
        if not self.running:
            raise RuntimeError(
                "the cluster is not running: call cluster.start() or dtlab.lab.start()"
            )

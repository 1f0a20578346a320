"""The live cluster: one ipyparallel engine per rank, driven from the notebook.

Taught in chapter 01; every later chapter starts with ``cluster = start(...)``.

    from dtlab.lab import start
    cluster = start(world_size=4)           # 4 CPU engines on gloo (or 1 per GPU)
    cluster.run(fn, *args)                  # fn on every rank; results in rank order
    cluster.reset()                         # fresh process group, same engines
    cluster.restart()                       # fresh engines
    cluster.stop()

Each engine is a separate Python process that joined one ``torch.distributed`` world
with an explicit rank (engine ids are not ranks: :mod:`dtlab.lab.placement`).
``%%px`` cells see ``rank``, ``world_size`` and ``topo`` on every engine. What runs
*on* the engines is in :mod:`dtlab.lab.engine`; this module is the notebook's side.

An error on a rank, a rank that never arrives, a dead engine, the notebook's Stop
button: each comes back as an error that names the rank and says what every rank
was doing (:mod:`dtlab.lab.failures`); :meth:`LabCluster.doing` shows that any time.

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

import atexit
import os
import secrets
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable

from dtlab.lab import failures, placement, processes, waiting
from dtlab.lab.engine import call, world
from dtlab.lab.failures import WorldDown

_LIVE: weakref.WeakSet = weakref.WeakSet()  # clusters started by this process


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
    :mod:`dtlab.lab.failures`).
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
        heartbeat_ms: int = 500,
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
        self.needs_reset = False  # the next run starts with a fresh process group
        self._token = secrets.token_hex(8)  # names this cluster's shared folder

    # ---- where the ranks are (dtlab.lab.placement) -------------------------------
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
        what the machines cannot give (:func:`dtlab.lab.placement.place`)."""
        self.placement = placement.place(where, self.backend, store_dir=self.store_dir)
        self.backend = self.placement.backend
        return self.placement

    def rendezvous_folder(self) -> str:
        """Where the ranks meet (:func:`dtlab.lab.placement.rendezvous_folder`)."""
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
        (:mod:`dtlab.lab.engine.board`); ``None`` for engines elsewhere, which
        cannot write into this machine's files."""
        if self.private_dir is None or self.engines != "local" or self.profile_dir:
            return None
        return os.path.join(self.private_dir, f"board-{rank}")

    # ---- lifecycle --------------------------------------------------------------
    def start(self) -> LabCluster:
        """Start the controller and the engines, and form the world."""
        t0 = time.perf_counter()
        self.private_dir = tempfile.mkdtemp(prefix="dtlab-cluster-")
        self.ipp_cluster = processes.ipp_cluster(
            self.world_size,
            engines=self.engines,
            heartbeat_ms=self.heartbeat_ms,
            profile_dir=self.profile_dir,
            private_dir=self.private_dir,
        )
        _LIVE.add(self)
        try:
            # not start_and_connect: in a notebook it draws a progress widget
            self.ipp_cluster.start_cluster_sync()
            self.client = self.ipp_cluster.connect_client_sync()
            self.client.wait_for_engines(
                self.world_size, timeout=self.start_timeout, interactive=False
            )
            ids = sorted(self.client.ids)[: self.world_size]
            self.view = self.client[ids]
            self.view.use_cloudpickle()
            # explicit rank map: sorted engine ids -> ranks 0..N-1
            self.rank_to_engine = dict(enumerate(ids))
            where = self.view.apply_async(world.whereami).get(
                timeout=self.start_timeout
            )
            self.place(where)
            # the first setup also imports torch on every engine: on a busy machine
            # that alone takes tens of seconds, so it gets the start-up budget
            self._init_world(wait=self.start_timeout + self.timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        return self

    def signal(self, ranks, signum: int) -> None:
        """Send ``signum`` to the engines of ``ranks``: by pid on this machine,
        through ipyparallel's control channel on another."""
        local = self.local_pids()
        processes.signal_engines(
            self.ipp_cluster,
            [local[r] for r in ranks if r in local],
            [
                self.rank_to_engine[r]
                for r in ranks
                if r not in local and r in self.rank_to_engine
            ],
            signum,
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
        self._require_started()
        if check_collectives is not None:
            self.check_collectives = bool(check_collectives)
        waiting.check_alive(self)
        self._init_world()
        return self

    def restart(self) -> LabCluster:
        """Stop every engine and the controller, and start new ones."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        """Stop the engines and the controller. Safe to call twice."""
        ipp_cluster, self.ipp_cluster = self.ipp_cluster, None
        if self.view is not None:
            try:
                self.view.apply_async(world.teardown).get(timeout=5)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        self.client = self.view = None
        if ipp_cluster is not None:
            try:
                ipp_cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001
                pass
        for pid in self.local_pids().values():  # whatever the launcher missed
            processes.kill(pid)
        if self.placement is not None and not self.placement.single_host:
            shutil.rmtree(self.rendezvous_folder(), ignore_errors=True)
        self.placement = None
        if self.private_dir:
            shutil.rmtree(self.private_dir, ignore_errors=True)
            self.private_dir = None
        _LIVE.discard(self)

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
        **kwargs,
    ) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank
        order.

        ``record=True`` (or an ``on_events`` callback) turns telemetry on for the
        call: every rank records comm/compute/memory events, ``on_events`` receives
        batches live while the call runs, and all events end up in
        :attr:`last_events` afterwards. ``timeout`` bounds the whole call (default:
        the cluster's ``call_timeout``).
        """
        self._require_started()
        _ship_by_value(fn)
        record = record or on_events is not None
        interval = publish_interval if on_events is not None else 0.0
        for attempt in range(2):
            if self.needs_reset:
                self.reset()
            epoch = time.time()  # one time axis for every rank's events
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
        plot by default: see :func:`dtlab.lab.training.train`."""
        from dtlab.lab.training import train

        return train(self, config, **kwargs)

    def health(self) -> list[dict]:
        """Each rank's view of itself: pid, process group up, broken reason."""
        self._require_started()
        return waiting.wait_for_ranks(
            self,
            [
                self.client[eid].apply_async(world.health)
                for _, eid in sorted(self.rank_to_engine.items())
            ],
            timeout=10,
            what="health check",
        )

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

    def _require_started(self) -> None:
        if not self.running:
            raise RuntimeError(
                "the cluster is not running: call cluster.start() or dtlab.lab.start()"
            )


def _ship_by_value(fn) -> None:
    """Functions travel to the engines pickled. cloudpickle sends a function of an
    importable module by *name*; that fails on an engine when the module is a
    script or a test file the engine cannot import. Such modules (anything outside
    site-packages and not dtlab itself) are sent by value instead."""
    import sys

    import cloudpickle

    name = getattr(fn, "__module__", None) or "__main__"
    module = sys.modules.get(name)
    if name == "__main__" or module is None or name.split(".")[0] == "dtlab":
        return
    path = getattr(module, "__file__", None) or ""
    if "site-packages" in path or "dist-packages" in path or not path:
        return
    if path.startswith(sys.base_prefix) and "/lib/python" in path:  # stdlib
        return
    try:
        cloudpickle.register_pickle_by_value(module)
    except ValueError:  # already registered
        pass


def start(world_size: int | None = None, **kwargs) -> LabCluster:
    """Start (or reuse) the notebook's cluster.

    Re-running a notebook's start cell must not leave orphan engines: a running
    cluster with the same settings is reused (its process group reset); any other
    cluster this kernel started is stopped first.
    """
    # a request this machine cannot serve fails here, before anything is stopped
    fresh = LabCluster(world_size, **kwargs)
    for old in list(_LIVE):
        same = (
            old.running
            and (world_size is None or old.world_size == world_size)
            and all(getattr(old, k, None) == v for k, v in kwargs.items())
        )
        if same:
            try:
                return old.reset()
            except Exception:  # noqa: BLE001 - fall through to a fresh start
                pass
        old.stop()
    cluster = fresh.start()
    try:  # make %%px cells target this cluster when running in IPython
        from IPython import get_ipython

        if get_ipython() is not None:
            # %%px cells wait for their ranks and show their output in the cell
            # (a non-blocking view would leave only "<AsyncResult: pending>")
            cluster.view.block = True
            cluster.view.activate()
    except ImportError:  # pragma: no cover
        pass
    return cluster


def stop_all() -> None:
    """Stop every cluster this process started (also registered to run at exit)."""
    for cluster in list(_LIVE):
        cluster.stop()


atexit.register(stop_all)

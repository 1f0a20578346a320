"""The live cluster: one ipyparallel engine per rank, driven from the notebook.

Taught in chapter 01; every later chapter starts with ``cluster = start(...)``.

    from dtlab.lab import start
    cluster = start(world_size=4)           # 4 CPU engines on gloo (or 1 per GPU)
    cluster.run(fn, *args)                  # fn on every rank; results in rank order
    cluster.reset()                         # fresh process group, same engines
    cluster.restart()                       # fresh engines
    cluster.stop()

Each engine is a separate Python process that joined one ``torch.distributed`` world
with an explicit rank (engine ids are not ranks). ``%%px`` cells see ``rank``,
``world_size`` and ``topo`` on every engine.

How failures surface:

- an exception on one rank comes back as a :class:`dtlab.launch.RankError` naming the
  rank and carrying its traceback; the failing rank destroyed its process group, so
  its peers did not wait out the collective timeout. The next ``run`` resets the
  group by itself (or call ``reset()``).
- a rank that never arrives at a collective makes the others fail after
  ``timeout`` seconds (the process group's timeout, 30 s by default).
- an engine that dies is reported as :class:`EngineDied` (with how it ended: a
  signal, an exit code); ``restart()`` brings up new engines.
- the notebook's Stop button (KeyboardInterrupt while ``run`` waits) interrupts the
  ranks too, and says where each one was.
- every message says what each rank was doing: ``rank 2 was in all_reduce(numel=
  1072, float32, group dp, tag 'ddp') for 0.3s``. Each engine keeps its current
  collective in a small status file (:class:`dtlab.lab.engine._Board`, fed by
  :func:`dtlab.comm.watch`) that the notebook reads even while the rank is stuck
  or after it died; :meth:`LabCluster.doing` shows it any time.
- ranks that call mismatched collectives: another op hangs until the group's
  timeout (the status of each rank shows the two ops); another *size* makes gloo
  abort the receiving engine (``EngineDied``, SIGABRT). ``LabCluster(
  check_collectives=True)`` (or ``reset(check_collectives=True)``) runs torch's
  collective checker (``TORCH_DISTRIBUTED_DEBUG=DETAIL``), which turns both into a
  clean error on every rank; it is off by default because it costs ~4 ms per
  collective on CPU ranks (measured: 0.6 ms -> 4.3 ms for a 256-float all-reduce
  on 2 engines), several times a small collective's own time.

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
import re
import secrets
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Callable

from dtlab.lab import engine as _engine
from dtlab.launch import RankError, max_cpu_world_size, rank_error

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LIVE: weakref.WeakSet = weakref.WeakSet()  # clusters started by this process


class _WorldDown(RuntimeError):
    """Ranks found their process group gone before running anything."""


class EngineDied(RuntimeError):
    """An engine process exited while the cluster was using it."""


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
    ``check_collectives``: torch's collective checker on every group (see above).
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
        # cores are checked once they report (see _place)
        here = profile_dir is None
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if backend == "auto" and here:
            backend = "nccl" if gpus else "gloo"
        if backend not in ("gloo", "nccl", "auto"):
            raise ValueError(
                f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}"
            )
        if world_size is None and not here:
            raise ValueError(
                "with a profile, give world_size: the engines' machines decide "
                "how many GPUs there are, not this one"
            )
        if world_size is None:
            world_size = gpus if backend == "nccl" else 4
        if (
            isinstance(world_size, bool)
            or not isinstance(world_size, int)
            or world_size < 1
        ):
            raise ValueError(
                f"world_size must be a positive integer, got {world_size!r}"
            )
        if backend == "nccl" and here:
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
        elif here and engines == "local" and world_size > max_cpu_world_size():
            raise ValueError(
                f"world_size={world_size} CPU engines is more than this machine can "
                f"run ({os.cpu_count()} cores): use at most {max_cpu_world_size()}"
            )
        self.world_size = world_size
        self.backend = backend
        self.timeout = float(timeout)
        self.call_timeout = float(call_timeout)
        self.engines = engines
        self.start_timeout = start_timeout
        self.heartbeat_ms = heartbeat_ms
        # torch's collective checker on every group (TORCH_DISTRIBUTED_DEBUG=DETAIL):
        # mismatched collectives become clean errors, for ~ms per collective
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
        self._cluster = None
        self.client = None
        self.view = None
        self.rank_to_engine: dict[int, int] = {}
        self.pids: dict[int, int] = {}  # each engine's pid, on its own host
        self.hosts: dict[int, str] = {}  # each rank's host name
        self.devices: dict[int, int | None] = {}  # nccl: each rank's GPU, per host
        self.single_host = True
        self.generation = 0
        self._needs_reset = False
        self._tmp = None
        self.last_events: list[dict] = []
        self.start_seconds: float | None = None

    # ---- lifecycle --------------------------------------------------------------
    def start(self) -> LabCluster:
        import ipyparallel as ipp

        t0 = time.perf_counter()
        self._tmp = tempfile.mkdtemp(prefix="dtlab-cluster-")
        settings = dict(
            n=self.world_size,
            engines=self.engines,
            controller_ip="127.0.0.1",  # loopback only
            # the heartbeat period bounds start-up and dead-engine detection
            controller_args=[f"--HeartMonitor.period={self.heartbeat_ms}"],
            delay=0.1,
            log_level=40,
        )
        if self.profile_dir is not None:
            # a profile (cluster/local, cluster/ssh, cluster/slurm) decides where the
            # controller and engines run; only the engine count comes from here. Its
            # config files are copied to a private folder: ipyparallel writes logs
            # and connection keys into the profile folder, which may be a checkout.
            private = os.path.join(self._tmp, "profile")
            os.makedirs(private)
            for name in os.listdir(self.profile_dir):
                if name.endswith("_config.py"):
                    shutil.copy(os.path.join(self.profile_dir, name), private)
            settings = dict(n=self.world_size, profile_dir=private, log_level=40)
            if self.engines != "local":
                settings["engines"] = self.engines
        self._cluster = ipp.Cluster(**settings)
        _LIVE.add(self)
        try:
            # not start_and_connect: in a notebook it draws a progress widget
            self._cluster.start_cluster_sync()
            self.client = self._cluster.connect_client_sync()
            self.client.wait_for_engines(
                self.world_size, timeout=self.start_timeout, interactive=False
            )
            ids = sorted(self.client.ids)[: self.world_size]
            self.view = self.client[ids]
            self.view.use_cloudpickle()
            # explicit rank map: sorted engine ids -> ranks 0..N-1
            self.rank_to_engine = dict(enumerate(ids))
            where = self.view.apply_async(_engine.whereami).get(
                timeout=self.start_timeout
            )
            self._place(where)
            # the first setup also imports torch on every engine: on a busy machine
            # that alone takes tens of seconds, so it gets the start-up budget
            self._init_world(wait=self.start_timeout + self.timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - t0
        return self

    def _place(self, where: list[dict]) -> None:
        """From what each engine reported (pid, host, cores, GPUs): which ranks run
        on this machine, each rank's GPU, the backend ``"auto"`` stands for, and
        whether the world spans machines (then the rendezvous needs
        ``store_dir``). Raises ``ValueError`` for what the machines cannot give.

        Engines of one host that see the same GPUs (the ssh profile, a local
        start) take them in rank order: device 0, 1, ... Engines that each see
        their own (Slurm's ``--gpus-per-task=1`` sets ``CUDA_VISIBLE_DEVICES`` per
        task) each take their device 0."""
        self.pids = {r: w["pid"] for r, w in enumerate(where)}
        self.hosts = {r: w["host"] for r, w in enumerate(where)}
        self._here = os.uname().nodename
        self.single_host = set(self.hosts.values()) == {self._here}
        if self.backend == "auto":
            self.backend = "nccl" if all(w["gpus"] for w in where) else "gloo"
        by_host: dict[str, list[int]] = {}
        by_view: dict[tuple, list[int]] = {}  # engines sharing one set of GPUs
        for r, w in enumerate(where):
            by_host.setdefault(w["host"], []).append(r)
            by_view.setdefault((w["host"], w.get("visible")), []).append(r)
        self.devices = {}
        for (host, visible), ranks in by_view.items():
            gpus = where[ranks[0]]["gpus"]
            if self.backend == "nccl" and len(ranks) > gpus:
                seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible else ""
                raise ValueError(
                    f"host {host} runs {len(ranks)} engines (ranks {ranks}) that "
                    f"share {gpus} GPUs{seen}: nccl needs one GPU per engine; ask "
                    "for fewer engines per host, or use backend='gloo'"
                )
            for i, r in enumerate(ranks):  # rank order among those engines
                self.devices[r] = i if self.backend == "nccl" else None
        for host, ranks in by_host.items():
            cpus = where[ranks[0]]["cpus"]
            if self.backend == "gloo" and len(ranks) > max_cpu_world_size(cpus):
                raise ValueError(
                    f"host {host} runs {len(ranks)} CPU engines on {cpus} cores: "
                    f"use at most {max_cpu_world_size(cpus)} per host"
                )
        if not self.single_host and self.store_dir is None:
            raise ValueError(
                f"the engines run on {sorted(by_host)}, not only on this machine "
                f"({self._here}): their rendezvous file must be on a filesystem "
                "they all share. Pass store_dir='/shared/folder' (or set "
                "DTLAB_STORE_DIR), the same path on every host"
            )
        self._token = secrets.token_hex(8)

    def _store_file(self) -> str:
        if self.single_host:
            return os.path.join(self._tmp, f"store-{self.generation}")
        return os.path.join(
            self.store_dir, f"dtlab-{self._token}", f"store-{self.generation}"
        )

    def _local_pids(self) -> dict[int, int]:
        """Rank -> pid for the engines of this machine (only those can be watched
        and signalled by pid here)."""
        here = getattr(self, "_here", None) or os.uname().nodename
        return {r: p for r, p in self.pids.items() if self.hosts.get(r) == here}

    def signal(self, ranks, signum: int) -> None:
        """Send ``signum`` to the engines of ``ranks``: by pid on this machine,
        through ipyparallel's control channel (which the engine serves even while
        its code runs) on another."""
        local = self._local_pids()
        remote = []
        for r in ranks:
            if r in local:
                try:
                    os.kill(local[r], signum)
                except ProcessLookupError:
                    pass
            elif r in self.rank_to_engine:
                remote.append(self.rank_to_engine[r])
        if remote and self._cluster is not None:
            # a client of its own: Stop calls this from the notebook's thread while
            # a run waits on self.client in another, and zmq sockets are not
            # thread-safe
            try:
                client = self._cluster.connect_client_sync()
            except Exception:  # noqa: BLE001 - the controller is gone: nothing to do
                return
            try:
                client.send_signal(int(signum), targets=remote, block=True)
            except Exception:  # noqa: BLE001 - a dead engine: the heartbeat says so
                pass
            finally:
                client.close()

    def _init_world(self, wait: float | None = None) -> None:
        """(Re)create the torch.distributed world on every engine."""
        self.generation += 1
        store_file = self._store_file()
        pending = []
        for rank, eid in self.rank_to_engine.items():
            # the pids of the engines sharing this rank's host
            peers = [
                p for r, p in self.pids.items() if self.hosts[r] == self.hosts[rank]
            ]
            pending.append(
                self.client[eid].apply_async(
                    _engine.setup,
                    rank,
                    self.world_size,
                    self.backend,
                    store_file,
                    self.timeout,
                    self.devices.get(rank),
                    self.generation,
                    peers,
                    self._board_file(rank),
                    self.check_collectives,
                    self.single_host,
                )
            )
        self._wait(
            pending,
            timeout=wait or self.timeout + 30,
            what="joining the process group",
        )
        for rank, eid in self.rank_to_engine.items():
            self.client[eid].push({"rank": rank}, block=True)
        self._needs_reset = False

    def reset(self, *, check_collectives: bool | None = None) -> LabCluster:
        """A fresh process group on the same engines (after an error or a hang that
        ended in a timeout). Engine state other than the group is kept.

        ``check_collectives=True`` turns torch's collective checker on for the new
        group (mismatched ops or shapes become clean errors on every rank instead of
        a hang or an aborted engine; each collective costs a few ms more)."""
        self._require_started()
        if check_collectives is not None:
            self.check_collectives = bool(check_collectives)
        self._check_alive()
        self._init_world()
        return self

    def restart(self) -> LabCluster:
        """Stop every engine and the controller, and start new ones."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        """Stop the engines and the controller. Safe to call twice."""
        cluster, self._cluster = self._cluster, None
        if self.view is not None:
            try:
                self.view.apply_async(_engine.teardown).get(timeout=5)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        self.client = self.view = None
        if cluster is not None:
            try:
                cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001
                pass
        for pid in self._local_pids().values():  # whatever the launcher missed
            _kill(pid)
        if not self.single_host and self.store_dir and getattr(self, "_token", None):
            shutil.rmtree(
                os.path.join(self.store_dir, f"dtlab-{self._token}"), ignore_errors=True
            )
        self.pids, self.hosts = {}, {}
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        _LIVE.discard(self)

    @property
    def running(self) -> bool:
        return self._cluster is not None and self.client is not None

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
            if self._needs_reset:
                self.reset()
            epoch = time.time()  # one time axis for every rank's events
            pending = [
                self.client[eid].apply_async(
                    _engine.call, fn, args, kwargs, record, interval, epoch
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
                out = self._wait(
                    pending,
                    timeout=timeout or self.call_timeout,
                    what=getattr(fn, "__name__", "the function"),
                    on_events=live,
                )
                break
            except _WorldDown:
                # a %%px cell failed on some rank and took the group down: nothing
                # of fn ran yet, so reset and run it once more
                self._needs_reset = True
                if attempt:
                    raise
            except BaseException:
                self._needs_reset = True
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
        return self._wait(
            [
                self.client[eid].apply_async(_engine.health)
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
        if self._tmp is None:
            return {}
        now = time.time()
        return {
            r: _engine.describe_board(_engine.read_board(self._board_file(r)), now)
            for r in sorted(self.rank_to_engine)
        }

    def _board_file(self, rank: int) -> str | None:
        if self._tmp is None or self.engines != "local" or self.profile_dir:
            return None  # engines elsewhere cannot write into this machine's files
        return os.path.join(self._tmp, f"board-{rank}")

    def _doing_lines(self, ranks=None) -> str:
        doing = self.doing()
        lines = [
            f"  rank {r} was {d}"
            for r, d in doing.items()
            if (ranks is None or r in ranks) and not d.startswith("unknown")
        ]
        return ("\n" + "\n".join(lines)) if lines else ""

    # ---- waiting, with failures turned into clear errors -----------------------
    def _wait(self, pending, *, timeout, what, on_events=None):
        import ipyparallel as ipp

        deadline = time.monotonic() + timeout
        seen: list[set] = [set() for _ in pending]
        next_check = 0.0
        try:
            while True:
                if on_events is not None:
                    self._drain(pending, seen, on_events)
                if all(ar.ready() for ar in pending):
                    break
                now = time.monotonic()
                if now >= next_check:
                    self._check_alive()
                    next_check = now + 0.25
                    # a failed rank means the rest will fail fast; keep waiting
                if now > deadline:
                    busy = [r for r, ar in enumerate(pending) if not ar.ready()]
                    doing = self._doing_lines()  # before the interrupt changes it
                    self._interrupt(busy)
                    still = self._settle(pending)
                    raise TimeoutError(
                        f"{what} did not finish within {timeout:.0f}s on ranks {busy}; "
                        f"they were interrupted.{doing}\n"
                        + self._after_interrupt(still)
                    )
                waiting = next((ar for ar in pending if not ar.ready()), None)
                if waiting is not None:
                    waiting.wait(0.02)
        except KeyboardInterrupt:
            # the notebook's Stop button: stop the ranks too, and say where they were
            busy = [r for r, ar in enumerate(pending) if not ar.ready()]
            doing = self._doing_lines()
            self._interrupt(busy)
            still = self._settle(pending)
            raise KeyboardInterrupt(
                f"{what} was interrupted; ranks {busy} were stopped.{doing}\n"
                + self._after_interrupt(still)
            ) from None
        if on_events is not None:
            self._drain(pending, seen, on_events)
        errors = []
        results = []
        for rank, ar in enumerate(pending):
            try:
                results.append(ar.get(timeout=0))
            except ipp.error.RemoteError as exc:
                errors.append((rank, exc))
            except ipp.error.EngineError as exc:
                self._check_alive(wait=2.0)  # names the signal, when it can
                self._needs_reset = True
                raise EngineDied(
                    f"rank {rank}'s engine died during {what}: {exc}; "
                    f"{self._how_it_ended(rank)}; call cluster.restart()"
                ) from None
        if errors and any(
            getattr(exc, "ename", "") == "EngineError" for _, exc in errors
        ):
            # ipyparallel noticed a dead engine before our liveness check did:
            # name the engine and how it ended (its signal) rather than the
            # stranded task; ranks whose process is still alive are reported too
            self._check_alive(wait=2.0)
            rank = next(r for r, exc in errors if exc.ename == "EngineError")
            self._needs_reset = True
            raise EngineDied(
                f"rank {rank}'s engine died during {what}: "
                f"{self._how_it_ended(rank)}; call cluster.restart()"
                f"{self._doing_lines()}"
            )
        if errors:
            if all(_engine.NO_GROUP in str(exc.evalue) for _, exc in errors):
                raise _WorldDown(self._rank_error(errors, what))
            raise self._rank_error(errors, what)
        return results

    def _settle(self, pending, seconds: float = 10.0) -> list[int]:
        """After interrupting: give the ranks a moment to unwind (one stuck in a
        collective gets out when its interrupted peers close their connections);
        return the ranks still busy."""
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                if all(ar.ready() for ar in pending):
                    break
                if any(not _alive(pid) for pid in self._local_pids().values()):
                    break
                next(ar for ar in pending if not ar.ready()).wait(0.05)
        except KeyboardInterrupt:  # pressed Stop again: stop waiting
            pass
        return [r for r, ar in enumerate(pending) if not ar.ready()]

    def _after_interrupt(self, still: list[int]) -> str:
        dead = [r for r, pid in self._local_pids().items() if not _alive(pid)]
        if dead:
            return f"the engines of ranks {dead} are gone: call cluster.restart()"
        if still:
            return (
                f"ranks {still} are still busy (code inside a collective or another "
                "C call does not stop on an interrupt; a collective ends at the "
                f"group's timeout, {self.timeout:.0f}s): wait and run again, or call "
                "cluster.restart()"
            )
        return "every rank is free again: the next run resets the process group"

    def _drain(self, pending, seen, on_events):
        """Hand newly published telemetry batches to ``on_events(rank, batch)``
        (each batch is published under its own key because the client keeps only
        the latest value per key)."""
        for rank, ar in enumerate(pending):
            data = ar.data
            if not data:
                continue
            for key in sorted(k for k in data if k not in seen[rank]):
                seen[rank].add(key)
                on_events(rank, data[key])

    @staticmethod
    def _rank_error(errors, what) -> RankError:
        failures = []
        for rank, exc in errors:
            text = _ANSI.sub("", f"{exc.evalue}")
            # dtlab.lab.engine.call prefixes its failures with the wall-clock time
            # and what the rank was doing: "@t<TAB>doing<TAB>error"
            m = re.match(r"@(\d+\.\d+)\t([^\t\n]*)\t(.*)", text, re.S)
            if m:
                t_fail, doing, body = float(m.group(1)), m.group(2), m.group(3)
            else:
                t_fail, doing, body = float("inf"), "", text
            message, _, tb = body.partition("\n")
            if not tb:
                tb = exc.traceback or ""
                tb = _ANSI.sub("", tb if isinstance(tb, str) else "\n".join(tb))
            failures.append((rank, message, tb, t_fail, doing))
        return rank_error(failures, what)

    def _check_alive(self, wait: float = 0.0) -> None:
        """Raise EngineDied if an engine process is gone; ``wait`` seconds for a
        process that ipyparallel already reported dead to finish exiting."""
        deadline = time.monotonic() + wait
        local = self._local_pids()  # another host's engines: ipyparallel's heartbeat
        dead = [r for r, pid in local.items() if not _alive(pid)]
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = [r for r, pid in local.items() if not _alive(pid)]
        if dead:
            self._needs_reset = True
            how = "".join(
                f"\n  rank {r} (pid {self.pids[r]}) {self._exit_reason(self.pids[r])}"
                for r in dead
            )
            raise EngineDied(
                f"engine of rank{'s' if len(dead) > 1 else ''} "
                f"{', '.join(map(str, dead))} (pid "
                f"{', '.join(str(self.pids[r]) for r in dead)}) is gone; "
                f"call cluster.restart() for new engines{how}{self._doing_lines()}"
            )

    def _how_it_ended(self, rank: int) -> str:
        if rank in self._local_pids():
            return self._exit_reason(self.pids[rank])
        return (
            f"it ran on {self.hosts.get(rank, 'another host')} and stopped answering "
            "ipyparallel's heartbeat (its engine log there says why)"
        )

    def _exit_reason(self, pid: int, wait: float = 1.0) -> str:
        """How an engine ended, from its launcher (local engines only)."""
        deadline = time.monotonic() + wait
        while True:
            code = None
            for engine_set in getattr(self._cluster, "engines", {}).values():
                for launcher in getattr(engine_set, "launchers", {}).values():
                    proc = getattr(launcher, "process", None)
                    if getattr(proc, "pid", None) != pid:
                        continue
                    # the launcher's thread waits on the process; psutil keeps
                    # the exit code it reaped
                    code = getattr(proc, "_exitcode", None)
                    if not isinstance(code, int):
                        data = getattr(launcher, "stop_data", None) or {}
                        code = data.get("exit_code")
            if code is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if code is None:
            return "ended"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = {
                "SIGABRT": " (gloo aborts a process whose collective got a "
                "different size from a peer: ranks called mismatched collectives; "
                "LabCluster(check_collectives=True) turns that into a clean error)",
                "SIGKILL": " (killed: out of memory, or by hand)",
            }.get(name, "")
            return f"was killed by {name}{hint}"
        return f"exited with code {code}"

    def _interrupt(self, ranks) -> None:
        """SIGINT the engines of ``ranks``: Python code on them raises
        KeyboardInterrupt, their process group is torn down, peers fail fast."""
        self.signal(ranks, signal.SIGINT)
        self._needs_reset = True

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


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pid: int) -> None:
    import psutil

    try:
        proc = psutil.Process(pid)
        proc.kill()
        proc.wait(timeout=5)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
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
    for cluster in list(_LIVE):
        cluster.stop()


atexit.register(stop_all)

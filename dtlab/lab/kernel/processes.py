"""The engines as processes: launched through ipyparallel, signalled, watched,
stopped, and asked how they ended.

Taught in chapter 01 (an engine is a process of its own).

Everything here goes through ipyparallel's public API (``ipyparallel.Cluster``,
its ``controller`` and ``engines`` launchers and their ``process``,
``Client.send_signal``) or psutil's. Engines on this machine are handled by pid;
engines on another host only through the ipyparallel controller, never by a pid
of this machine.

Each process is started under a :mod:`~dtlab.lab.kernel.lifeline`, which ends it when
the kernel that owns it is gone, and in a session of its own (ipyparallel's local
launcher does that), so :func:`kill` ends its whole tree (an engine's nanny, the
controller's schedulers) with one signal to its process group.
:meth:`~dtlab.lab.kernel.cluster.LabCluster.stop` is that kill for every local process,
then a wait until each has exited, then ipyparallel's own stop (which finds them
gone) for its bookkeeping and for engines on other hosts.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

from dtlab.lab.kernel import lifeline


def ipp_cluster(
    n: int,
    *,
    engines: str,
    heartbeat_ms: int,
    profile_dir: str | None,
    private_dir: str,
):
    """An ``ipyparallel.Cluster`` (not started) of ``n`` engines, the controller
    bound to loopback; with ``profile_dir`` (``cluster/local``, ``cluster/ssh``,
    ``cluster/slurm``) the profile decides where the controller and engines run."""
    import ipyparallel as ipp

    if profile_dir is None:
        return ipp.Cluster(
            n=n,
            engines=engines,
            controller_ip="127.0.0.1",  # loopback only
            # An engine is registered at its first answered heartbeat, so the period
            # bounds start-up; the controller drops an engine after DROP_AFTER
            # seconds of missed beats, however short the period.
            controller_args=[
                f"--HeartMonitor.period={heartbeat_ms}",
                f"--HeartMonitor.max_heartmonitor_misses={_misses(heartbeat_ms)}",
            ],
            delay=0,  # no pause between engine launches
            log_level=40,
            # dtlab.lab.kernel.teardown stops it, in well under 1 s
            shutdown_atexit=False,
        )
    # Only the engine count comes from here. The profile's config files are copied
    # to a private folder: ipyparallel writes logs and connection keys into the
    # profile folder, which may be a checkout.
    private = os.path.join(private_dir, "profile")
    os.makedirs(private)
    for name in os.listdir(profile_dir):
        if name.endswith("_config.py"):
            shutil.copy(os.path.join(profile_dir, name), private)
    settings = dict(n=n, profile_dir=private, log_level=40, shutdown_atexit=False)
    if engines != "local":
        settings["engines"] = engines
    return ipp.Cluster(**settings)


DROP_AFTER = 5.0  # seconds of missed heartbeats before the controller drops an engine


def _misses(heartbeat_ms: int) -> int:
    return max(3, round(DROP_AFTER * 1000 / heartbeat_ms))


def start_controller(ipp_cluster) -> None:
    """Start the controller, under a lifeline owned by this process (when it runs
    here: every profile of ``cluster/`` keeps it beside the kernel)."""
    from ipyparallel.cluster.launcher import LocalControllerLauncher

    controller = {}
    if issubclass(ipp_cluster.controller_launcher_class, LocalControllerLauncher):
        controller["controller_cmd"] = lifeline.command(
            sys.executable, "ipyparallel.controller", owner=os.getpid()
        )
    ipp_cluster.start_controller_sync(**controller)


def start_engines(ipp_cluster, n: int) -> None:
    """Start ``n`` engines (a new engine set) on a running controller. Engines of
    ipyparallel's local launcher run under a lifeline owned by this process and
    import torch while they register (``--preload``); other launchers' engines get
    their command from the profile (``cluster/ssh``, ``cluster/slurm``), which adds
    the lifeline there."""
    from ipyparallel.cluster.launcher import LocalEngineSetLauncher

    engines = {}
    # exactly the local launcher (ipyparallel's ssh launcher derives from it)
    if ipp_cluster.engine_launcher_class is LocalEngineSetLauncher:
        # Launched at once, beside the controller that is still starting: they
        # import ipyparallel and torch meanwhile, then read its connection file
        # (ipyparallel would wait for that file before launching them).
        ipp_cluster.send_engines_connection_env = False
        engines["engine_cmd"] = [
            *lifeline.command(
                sys.executable, "ipyparallel.engine", owner=os.getpid(), preload=True
            ),
            "--IPEngine.wait_for_url_file=300",
        ]
    ipp_cluster.start_engines_sync(n, **engines)


def local_launchers(ipp_cluster) -> list:
    """ipyparallel's launchers of local processes: the controller's and every
    local engine's (those with a ``process`` of this machine)."""
    if ipp_cluster is None:
        return []
    found = [getattr(ipp_cluster, "controller", None)]
    for engine_set in (getattr(ipp_cluster, "engines", None) or {}).values():
        found += list(getattr(engine_set, "launchers", {}).values())
    return [x for x in found if getattr(x, "process", None) is not None]


def tree(pids) -> list:
    """psutil processes of ``pids`` and everything they started."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return procs


_STOPPED_SINCE: dict[int, float] = {}  # pid -> when first seen stopped


def stopped(pid: int, for_seconds: float = 0.0) -> bool:
    """Whether the local process ``pid`` is stopped (SIGSTOP, a debugger) and has
    been so, as far as these calls saw, for ``for_seconds`` seconds."""
    import psutil

    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        status = None
    if status not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        _STOPPED_SINCE.pop(pid, None)
        return False
    since = _STOPPED_SINCE.setdefault(pid, time.monotonic())
    return time.monotonic() - since >= for_seconds


def kill(pids) -> list:
    """SIGKILL each of ``pids`` with its process group (a launched process leads
    a session of its own) and every process it started; return them (psutil
    processes) to wait for. No ipyparallel call: safe in a signal handler."""
    import psutil

    procs = tree(pids)
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return procs


def wait_gone(procs, timeout: float = 5.0) -> list:
    """Wait until every one of ``procs`` has exited (a zombie counts: its parent
    reaps it); return those still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    left = [p for p in procs if _running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.01)
        left = [p for p in left if _running(p)]
    return left


def _running(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def signal_engines(ipp_cluster, local_pids: list[int], remote_ids: list[int], signum):
    """Send ``signum`` to the local engines ``local_pids`` by pid, and to the
    engines ``remote_ids`` (ipyparallel engine ids) through the controller's
    control channel, which an engine serves even while its code runs."""
    for pid in local_pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    if not remote_ids or ipp_cluster is None:
        return
    # a client of its own: Stop calls this from the notebook's thread while a run
    # waits on the cluster's client in another, and zmq sockets are not thread-safe
    try:
        client = ipp_cluster.connect_client_sync()
    except Exception:  # noqa: BLE001 - the controller is gone: nothing to do
        return
    try:
        client.send_signal(int(signum), targets=remote_ids, block=True)
    except Exception:  # noqa: BLE001 - a dead engine: the heartbeat says so
        pass
    finally:
        client.close()


def alive(pid: int) -> bool:
    """Whether the local process ``pid`` is running (a zombie is not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def exit_code(ipp_cluster, pid: int) -> int | None:
    """The exit code of the local engine ``pid`` (negative: the signal that killed
    it), from the ipyparallel launcher that started it; ``None`` if unknown yet.

    Each local engine launcher waits on its process in a thread of its own
    (``psutil.Process.wait``), and psutil keeps the code it reaped, so ``wait(0)``
    here returns it. The launcher's own record (its ``stop_data``) is written by a
    callback on the event loop that started the cluster, which outside a notebook
    is no longer running: it is only the second source. Once that callback ran,
    the launcher has left its engine set, whose ``stop_data`` keeps the record."""
    import psutil

    engine_sets = getattr(ipp_cluster, "engines", None) or {}
    for engine_set in engine_sets.values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            process = getattr(launcher, "process", None)
            if getattr(process, "pid", None) != pid:
                continue
            try:
                code = process.wait(timeout=0)
            except (psutil.TimeoutExpired, psutil.Error, ChildProcessError):
                code = None
            if not isinstance(code, int):
                code = (launcher.stop_data or {}).get("exit_code")
            return code if isinstance(code, int) else None
        # a launcher whose stop was noticed leaves the set, its record stays
        for stopped in (engine_set.stop_data or {}).get("engines", {}).values():
            if stopped.get("pid") == pid and isinstance(stopped.get("exit_code"), int):
                return stopped["exit_code"]
    return None

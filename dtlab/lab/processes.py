"""The engines as processes: launched through ipyparallel, signalled, watched, and
asked how they ended.

Taught in chapter 01 (an engine is a process of its own).

Everything here goes through ipyparallel's public API (``ipyparallel.Cluster``,
its ``engines`` launchers and their ``process``, ``Client.send_signal``) or
psutil's. Engines on this machine are handled by pid; engines on another host only
through the ipyparallel controller, never by a pid of this machine.
"""

from __future__ import annotations

import os
import shutil


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
            # the heartbeat period bounds start-up and dead-engine detection
            controller_args=[f"--HeartMonitor.period={heartbeat_ms}"],
            delay=0.1,
            log_level=40,
        )
    # Only the engine count comes from here. The profile's config files are copied
    # to a private folder: ipyparallel writes logs and connection keys into the
    # profile folder, which may be a checkout.
    private = os.path.join(private_dir, "profile")
    os.makedirs(private)
    for name in os.listdir(profile_dir):
        if name.endswith("_config.py"):
            shutil.copy(os.path.join(profile_dir, name), private)
    settings = dict(n=n, profile_dir=private, log_level=40)
    if engines != "local":
        settings["engines"] = engines
    return ipp.Cluster(**settings)


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


def kill(pid: int) -> None:
    """SIGKILL the local process ``pid`` and reap it (whatever a launcher missed)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        proc.kill()
        proc.wait(timeout=5)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass


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

"""Every cluster ends with the kernel that started it: at exit, and on SIGTERM.

Taught in chapter 01 (a cluster dies with its kernel).

Four ways a kernel goes, and what ends its clusters in each:

- it exits (JupyterLab's shutdown or restart asks first): :func:`stop_all`, run
  at exit, stops every cluster (:meth:`dtlab.lab.kernel.cluster.LabCluster.stop`, well
  under a second: the processes are killed, not asked);
- it is sent SIGTERM (JupyterLab does, 2.5 s after asking, if the kernel has not
  gone yet): the handler installed by :func:`register` kills every local process
  of every cluster at once (one signal per process group, no ipyparallel call, so
  it is safe whatever the kernel was doing) and then lets SIGTERM do what it did
  before;
- it is killed (SIGKILL, or ``os._exit``, which skips every exit hook; Jupyter's
  kernels ``os._exit`` when their server dies): nothing runs in the kernel, so each
  process of the cluster watches it instead (:mod:`dtlab.lab.kernel.lifeline`) and ends
  itself within a fraction of a second.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import weakref

_LIVE: weakref.WeakSet = weakref.WeakSet()  # clusters started by this process
_PREVIOUS: dict = {}  # the SIGTERM handler that was there before ours


def register(cluster) -> None:
    """Count ``cluster`` among this process's clusters (and install the SIGTERM
    handler, once, if this is the main thread)."""
    _LIVE.add(cluster)
    install_sigterm_handler()


def forget(cluster) -> None:
    _LIVE.discard(cluster)


def live() -> list:
    """The clusters this process started and has not stopped."""
    return list(_LIVE)


def stop_all() -> None:
    """Stop every cluster this process started (also registered to run at exit)."""
    for cluster in list(_LIVE):
        cluster.stop()


def kill_all() -> list:
    """SIGKILL every local process of every cluster, without waiting; returns the
    processes (psutil) to wait for."""
    procs = []
    for cluster in list(_LIVE):
        try:
            procs += cluster.kill()
        except Exception:  # noqa: BLE001 - the others still have to go
            pass
    return procs


def install_sigterm_handler() -> bool:
    """Put :func:`on_sigterm` in front of the current SIGTERM handler (once).
    Returns whether it is in place: Python installs handlers from the main thread
    only, and a process that ignores SIGTERM keeps doing so."""
    if "handler" in _PREVIOUS:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return False
    signal.signal(signal.SIGTERM, on_sigterm)
    _PREVIOUS["handler"] = previous
    return True


def on_sigterm(signum, frame) -> None:
    """Kill every cluster's processes, wait (briefly) until they are gone, then do
    what SIGTERM did before: the previous handler, or the default (the process
    ends by SIGTERM)."""
    from dtlab.lab.kernel import processes

    processes.wait_gone(kill_all(), timeout=1.0)
    previous = _PREVIOUS.get("handler")
    if callable(previous) and previous is not on_sigterm:
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


atexit.register(stop_all)

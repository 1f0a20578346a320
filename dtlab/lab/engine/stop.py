"""The Stop button's receiving end: a SIGUSR1 handler that only raises a flag.

Chapter 07's Stop must end a run at a step boundary on every rank, with no
collective left half done. The notebook sends SIGUSR1 (by pid on this machine,
through ipyparallel on another); the handler below sets a flag, and the training
loop (:func:`dtlab.lab.engine.training.train_rank_stoppable`) looks at it after
each step, where the ranks agree on it with one all-reduce.
"""

from __future__ import annotations

import signal
import threading

_flags = {"requested": False, "installed": False}  # this engine's, process-wide


def _on_stop_signal(signum, frame) -> None:
    _flags["requested"] = True  # all a signal handler should do: the loop decides


def install_stop_handler() -> bool:
    """Install the SIGUSR1 handler (once per engine; it stays installed, so a signal
    that arrives just after a run ended sets a flag instead of killing the engine)
    and clear any old request. Returns whether the handler is in place: Python only
    installs handlers from the main thread."""
    if not _flags["installed"]:
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.SIGUSR1, _on_stop_signal)
        # restart interrupted system calls: a gloo socket read in progress must not
        # fail with EINTR because Stop was pressed
        signal.siginterrupt(signal.SIGUSR1, False)
        _flags["installed"] = True
    _flags["requested"] = False
    return True


def stop_requested() -> bool:
    """Whether a stop signal arrived since :func:`install_stop_handler`."""
    return _flags["requested"]


def clear_stop_request() -> None:
    _flags["requested"] = False

"""Nothing outlives its owner: the watch every process of the live cluster keeps.

Taught in chapter 01 (a cluster dies with its kernel).

The controller and every engine are started through this module::

    python -m dtlab.lab.kernel.lifeline --owner 4242 ipyparallel.engine [ARGS...]

It starts a watching thread, then runs the module (``ipyparallel.engine``) in the
same process, so signals and exit codes stay ipyparallel's own. The thread ends the
process, and every process it started (an engine's nanny, the controller's
schedulers), as soon as

- its *owner* is gone: the notebook's kernel, pid ``--owner``, the parent that
  started it. A process whose parent exits is given another parent, so
  ``os.getppid()`` changing is the sign: instant, and immune to a reused pid;
- (an engine) its *controller* stopped beating: ipyparallel's controller
  publishes a heartbeat ping every period; the thread listens to it too. No ping
  for :data:`QUIET` seconds and the controller's port refusing connections means
  the controller is gone; no ping for :data:`LOST` seconds means its host is
  unreachable. This is how an engine on another machine, which cannot see the
  kernel's pid, follows it: the controller always runs beside the kernel and
  follows the kernel by pid.

The end is a SIGKILL sent from the thread. It works while the main thread is
blocked inside a gloo collective, where neither a Python signal handler nor
ipyparallel's own heartbeat check (a callback of the engine's busy main loop) can
run; ipyparallel's check only notices a lost controller after ~50 missed beats.

``--preload``: import torch and dtlab's engine side in a second thread while
ipyparallel registers the engine, so the first call does not pay for them.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import threading
import time

POLL = 0.2  # seconds between looks at the owner
QUIET = 3.0  # seconds without a controller ping before its port is probed
LOST = 20.0  # seconds without a ping after which the controller counts as gone
PRELOAD = (
    "torch",
    "torch.distributed",
    "dtlab.lab.engine.world",
    "dtlab.lab.engine.call",
)


def command(python: str, module: str, *, owner: int | None, preload=False) -> list:
    """The command line that runs ``python -m module`` under a lifeline."""
    cmd = [python, "-m", "dtlab.lab.kernel.lifeline"]
    if owner is not None:
        cmd += ["--owner", str(owner)]
    if preload:
        cmd.append("--preload")
    return [*cmd, module]


def end_everything(reason: str) -> None:
    """SIGKILL every process this one started, then this one."""
    try:
        import psutil

        children = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - ending anyway
        children = []
    for child in children:
        try:
            child.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    print(f"dtlab lifeline: {reason}; ending pid {os.getpid()}", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class ControllerPings:
    """Listens to the controller's heartbeat pings (``IPP_CONNECTION_INFO``, as
    ipyparallel hands it to each engine); :meth:`silent_for` says how long none
    came. ``None`` if the connection info is not there (nothing to watch)."""

    def __init__(self, info: dict):
        import zmq

        interface = info["interface"]  # "tcp://10.0.0.1"
        self.host = interface.split("://", 1)[1]
        self.port = int(info["registration"])
        self.context = zmq.Context()  # our own: never share ipyparallel's
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(f"{interface}:{info['hb_ping']}")
        self.last = time.monotonic()

    @classmethod
    def from_environment(cls, wait: float = 120.0) -> ControllerPings | None:
        """From ``IPP_CONNECTION_INFO``, or else from the engine connection file
        of ``IPP_PROFILE_DIR`` and ``IPP_CLUSTER_ID`` (waiting up to ``wait``
        seconds for the controller to write it: engines start beside it)."""
        raw = os.environ.get("IPP_CONNECTION_INFO")
        if not raw:
            path = _connection_file()
            deadline = time.monotonic() + wait
            while path and not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(POLL)
            try:
                with open(path or "") as f:
                    raw = f.read()
            except OSError:
                return None
        try:
            info = json.loads(raw)
            if info.get("curve_serverkey") or "hb_ping" not in info:
                return None  # encrypted pings: ipyparallel's own check only
            return cls(info)
        except Exception:  # noqa: BLE001 - no watch rather than no engine
            return None

    def silent_for(self, wait: float) -> float:
        """Wait up to ``wait`` seconds for pings; seconds since the last one."""
        import zmq

        if self.socket.poll(int(wait * 1000), zmq.POLLIN):
            while self.socket.poll(0, zmq.POLLIN):
                self.socket.recv(zmq.NOBLOCK)
            self.last = time.monotonic()
        return time.monotonic() - self.last

    def refused(self) -> bool:
        """Whether the controller's registration port refuses a connection (its
        process is gone; a host that is down answers nothing, see :data:`LOST`)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=2.0):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False


def _connection_file() -> str | None:
    """Where ipyparallel's controller writes the engines' connection file."""
    profile = os.environ.get("IPP_PROFILE_DIR")
    if not profile:
        return None
    cluster = os.environ.get("IPP_CLUSTER_ID")
    name = (
        f"ipcontroller-{cluster}-engine.json" if cluster else "ipcontroller-engine.json"
    )
    return os.path.join(profile, "security", name)


def watch(owner: int | None, follow_controller: bool) -> None:
    """The watching thread's loop (see the module docstring)."""
    parent = os.getppid()
    pings = None
    if not (os.environ.get("IPP_CONNECTION_INFO") or _connection_file()):
        follow_controller = False  # nothing says where the controller is
    if follow_controller:
        # the owner first: while the controller starts, its kernel may go
        deadline = time.monotonic() + 120
        while pings is None and time.monotonic() < deadline:
            _check_owner(owner, parent)
            pings = ControllerPings.from_environment(wait=POLL)
    while True:
        if pings is not None:
            quiet = pings.silent_for(POLL)
            if quiet > LOST or (quiet > QUIET and pings.refused()):
                end_everything(f"the controller stopped beating {quiet:.1f}s ago")
        else:
            time.sleep(POLL)
        _check_owner(owner, parent)


def _check_owner(owner: int | None, parent: int) -> None:
    if owner is not None and (os.getppid() != parent or not _exists(owner)):
        end_everything(f"its owner, pid {owner}, is gone")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the engine imports it again, and says why
            return


def main(argv: list[str]) -> None:
    owner, preload = None, False
    while argv and argv[0].startswith("--"):
        flag = argv.pop(0)
        if flag == "--owner":
            owner = int(argv.pop(0))
        elif flag == "--preload":
            preload = True
        else:
            raise SystemExit(f"dtlab.lab.kernel.lifeline: unknown option {flag}")
    if not argv:
        raise SystemExit(
            "usage: python -m dtlab.lab.kernel.lifeline [--owner PID] MODULE ..."
        )
    module, args = argv[0], argv[1:]
    follow = module == "ipyparallel.engine"  # an engine follows its controller
    threading.Thread(
        target=watch, args=(owner, follow), name="dtlab-lifeline", daemon=True
    ).start()
    if preload:
        threading.Thread(target=_preload, name="dtlab-preload", daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""What runs inside each engine of the live cluster.

The notebook (:mod:`dtlab.lab.cluster`) calls these functions on every engine. This
module keeps each engine's state: its rank, the process-group generation, and
whether the group was torn down after an error. It imports neither ipyparallel nor
anything from the notebook side, except the publish function inside
:class:`dtlab.telemetry.PublishSink`, which only exists on an engine.
"""

from __future__ import annotations

import mmap
import os
import time
import traceback

import torch
import torch.distributed as dist

from dtlab import comm, launch, telemetry
from dtlab.topology import Layout, Topology

state: dict = {
    "rank": None,
    "world_size": None,
    "generation": 0,
    "broken": None,
    "peers": [],  # pids of the other engines of this world on this host
    "board": None,  # this rank's _Board, where the notebook reads what it is doing
}


# ---- what this rank is doing, readable while it is stuck ---------------------------
BOARD_BYTES = 512


class _Board:
    """A small memory-mapped file holding what this rank is doing right now.

    The engine cannot answer the notebook while it is blocked in a collective (and
    not at all once it died), so it writes its state where the notebook can read
    it without asking: ``state<TAB>t_wall<TAB>text``, with state ``in`` (inside
    the collective ``text`` since ``t_wall``), ``after`` (running Python after it),
    ``running`` (the user's function, before any collective), ``failed`` (what it
    was doing when the function raised) and ``idle``. A write is
    a 512-byte copy into the page cache: cheap enough for every collective, and
    still there after the process was killed."""

    def __init__(self, path: str):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, BOARD_BYTES)
            self._mm = mmap.mmap(fd, BOARD_BYTES)
        finally:
            os.close(fd)
        self.path = path
        self._entry, self._text = None, ""

    def write(self, state: str, text: str = "", t: float | None = None) -> None:
        line = f"{state}\t{time.time() if t is None else t:.3f}\t{text}\0".encode()
        n = min(len(line), BOARD_BYTES)
        self._mm[:n] = line[:n]  # the reader stops at the first NUL

    def __call__(self, entry, active: bool) -> None:  # a dtlab.comm watcher
        if entry is not self._entry:  # each op is described once, not per write
            self._entry, self._text = entry, comm.describe_op(entry)
        self.write("in" if active else "after", self._text, entry[5])

    def close(self) -> None:
        comm.unwatch(self)
        self._mm.close()


def read_board(path: str | None) -> tuple[str, float, str] | None:
    """``(state, t_wall, text)`` from a rank's board file, or None."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read(BOARD_BYTES).split(b"\0", 1)[0].decode(errors="replace")
        state, t, text = raw.split("\t", 2)
        return state, float(t), text
    except (OSError, ValueError):
        return None


def describe_board(entry, now: float | None = None) -> str:
    """A board entry in words: ``in all_reduce(numel=8, ...) for 3.1s``."""
    if entry is None:
        return "unknown (no status board)"
    state, t, text = entry
    ago = (time.time() if now is None else now) - t
    if state == "in":
        return f"in {text} for {ago:.1f}s"
    if state == "after":
        return f"running Python after {text} (finished {ago:.1f}s ago)"
    if state == "running":
        return f"running Python, no collective yet ({ago:.1f}s into the call)"
    if state == "failed":
        return f"failed {ago:.1f}s ago, {text}"
    return "idle"


def _open_board(path: str | None) -> None:
    old = state["board"]
    if old is not None and old.path == path:
        return
    if old is not None:
        old.close()
        state["board"] = None
    if path:
        board = state["board"] = _Board(path)
        board.write("idle")
        comm.watch(board)


def _board_write(status: str, text: str = "") -> None:
    if state["board"] is not None:
        state["board"].write(status, text)


def _user_ns() -> dict:
    """The namespace ``%%px`` cells run in (IPython's user namespace)."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:  # pragma: no cover - engines always have IPython
        shell = None
    return shell.user_ns if shell is not None else {}


def _drop_user_groups() -> None:
    """Forget the ``topo`` given to ``%%px`` cells (it holds process groups)."""
    ns = _user_ns()
    if "topo" in ns:
        ns["topo"] = None


def _on_cell_error(result) -> None:
    """IPython ``post_run_cell`` hook: a ``%%px`` cell that raised on this rank tears
    the process group down, so peers blocked in a collective fail fast too."""
    if result.error_in_exec is not None and dist.is_initialized():
        state["broken"] = f"a %%px cell raised {type(result.error_in_exec).__name__}"
        fail_fast()


def sever_peer_connections() -> int:
    """Shut down every TCP connection between this process and a peer engine.

    Destroying a gloo process group closes its sockets only when nothing else
    holds the group, and torch itself may keep a reference (measured: after
    ``import torch._dynamo``, which the first ``torch.optim`` optimizer does, peers
    of a failed rank waited out the whole timeout). Connections between engines
    are gloo's alone (each engine talks to the controller, not to its peers), so
    shutting them down at the socket level is what makes peers fail fast for
    certain. Returns the number of connections shut down."""
    import socket

    import psutil

    peer_addrs = set()
    for pid in state["peers"]:
        try:
            peer_addrs.update(
                c.laddr for c in psutil.Process(pid).net_connections("tcp")
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    severed = 0
    for conn in psutil.Process().net_connections("tcp"):
        if conn.raddr and conn.raddr in peer_addrs and conn.fd >= 0:
            try:
                s = socket.socket(fileno=os.dup(conn.fd))
                try:
                    s.shutdown(socket.SHUT_RDWR)  # affects every fd of the socket
                finally:
                    s.close()  # closes our duplicate only
                severed += 1
            except OSError:
                continue
    return severed


def fail_fast() -> None:
    """Tear this rank's world down so that its peers fail within milliseconds."""
    _drop_user_groups()
    launch.abort_process_group()
    sever_peer_connections()


def setup(
    rank,
    world_size,
    backend,
    store_file,
    timeout,
    device,
    generation,
    peers=(),
    board=None,
    check_collectives=False,
    single_host=True,
):
    """Join the world as ``rank`` and expose ``rank``, ``world_size``, ``topo`` to
    ``%%px`` cells. Called on every engine at start and at each reset.

    ``peers``: the pids of the other engines on this engine's host (what
    :func:`sever_peer_connections` looks at). ``single_host=False``: the world
    spans machines; ``store_file`` is then on a filesystem they share.
    ``board``: the file this rank keeps its current op in (see :class:`_Board`).
    ``check_collectives``: wrap the groups in torch's collective checker
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``): every collective first compares op,
    shapes and dtypes across ranks, so a mismatch is a clean error on every rank
    instead of a hang or an aborted process, at a cost of a few milliseconds per
    collective (measured on 2 CPU ranks)."""
    torch.set_num_threads(1)
    launch.abort_process_group()  # leave any previous world first
    _open_board(board)
    # read when a group is created: it applies to this world's groups only
    if check_collectives:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    else:
        dist.set_debug_level_from_env()  # off, unless the engines' environment says
    os.makedirs(os.path.dirname(store_file), mode=0o700, exist_ok=True)
    launch.init_process_group(
        rank,
        world_size,
        backend=backend,
        store_file=store_file,
        timeout=timeout,
        device=device,
        single_host=single_host,
    )
    state.update(
        rank=rank,
        world_size=world_size,
        generation=generation,
        broken=None,
        peers=[p for p in peers if p != os.getpid()],
    )
    topo = Topology(Layout(dp=world_size), rank)
    ns = _user_ns()
    ns.update(rank=rank, world_size=world_size, topo=topo, dist=dist, torch=torch)
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None and _on_cell_error not in shell.events.callbacks.get(
            "post_run_cell", []
        ):
            shell.events.register("post_run_cell", _on_cell_error)
    except ImportError:  # pragma: no cover
        pass
    return {"rank": rank, "pid": os.getpid(), "host": os.uname().nodename}


def whereami() -> dict:
    """Where this engine runs: its pid, its host's name, its cores and the GPUs it
    sees (``visible``: its ``CUDA_VISIBLE_DEVICES``, which Slurm sets per task). The
    notebook maps ranks to GPUs from these, before any world exists."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"pid": os.getpid(), "host": os.uname().nodename, "gpus": gpus,
            "cpus": os.cpu_count() or 1,
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip


def health() -> dict:
    return {
        "rank": state["rank"],
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "broken": state["broken"],
        "generation": state["generation"],
    }


def teardown() -> None:
    launch.abort_process_group()
    state["broken"] = "stopped"
    _open_board(None)


NO_GROUP = "[no process group]"


class Failure(Exception):
    """Carried back to the notebook when the user's function raised on this rank."""


def call(fn, args, kwargs, record: bool, publish_interval: float, epoch: float):
    """Run the user's ``fn`` on this rank.

    On error the process group is destroyed *before* the exception leaves, so peers
    stuck in a collective with this rank fail within milliseconds, and the error is
    re-raised with the rank, the wall-clock time it happened (to tell the cause
    from the consequences) and the traceback.
    """
    if state["broken"] is not None or not dist.is_initialized():
        # the notebook side recognises this prefix, resets the world and retries
        raise Failure(
            f"{NO_GROUP} rank {state['rank']}: no process group "
            f"({state['broken'] or 'not set up'}); call cluster.reset()"
        )
    try:
        # Pre-flight: is every rank still in the world? A rank whose group went down
        # (a failed %%px cell) makes this barrier fail on every rank at once, before
        # any of fn runs, so the notebook can reset and run fn again.
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - reported as NO_GROUP
        state["broken"] = "a peer's process group is gone"
        message = f"{NO_GROUP} rank {state['rank']}: {type(exc).__name__}: {exc}"
    else:
        message = None
    if message is not None:
        fail_fast()
        raise Failure(message)
    comm.forget_ops()
    _board_write("running")
    if record:
        sinks = [telemetry.MemorySink()]
        if publish_interval > 0:
            sinks.append(telemetry.PublishSink(interval=publish_interval))
        rec = telemetry.Recorder(state["rank"], sinks, epoch=epoch)
    else:
        rec = telemetry.OFF
    failure = None
    try:
        with telemetry.use(rec):
            value = fn(*args, **kwargs)
        rec.flush()
    except BaseException as exc:
        # "@time<TAB>what it was doing<TAB>error": the notebook side splits it
        doing, error = comm.current_op(), f"{type(exc).__name__}"
        failure = (
            f"@{time.time():.6f}\t{doing}\t{error}: {exc}\n{traceback.format_exc()}"
        )
        state["broken"] = f"{type(exc).__name__} on rank {state['rank']}"
    if failure is not None:
        # outside the except block, so the traceback's frames (and any group they
        # reference) are already released when the groups are torn down
        fail_fast()
        _board_write("failed", f"{doing} ({error})")
        raise Failure(failure)
    _board_write("idle")
    events = rec.events if record else None
    return value, events

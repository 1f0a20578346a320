"""Starting ranks: one process group per job, on one host or many.

Taught in chapter 01 (and chapter 02's comparison of launchers).

Three ways to get N ranks, all ending in the same :func:`init_process_group`:

- the live lab (:mod:`dtlab.lab.kernel.cluster`): long-lived ipyparallel engines;
- :func:`spawn`: fresh processes from ``multiprocessing`` (tests, benchmarks,
  ``dtlab run`` on one host) — like ``torch.multiprocessing.spawn`` but returning
  each rank's result and failing fast with the rank's traceback;
- ``torchrun`` (or any launcher that sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``):
  :func:`init_from_env`.

On one host the rendezvous is a file store, never a TCP store: torch's TCPStore
listens on every interface even when ``MASTER_ADDR`` is 127.0.0.1, and a course
should not open a port to the network. Gloo is pinned to the loopback interface.

When a rank raises, it destroys its process group before reporting: the other
ranks' pending collectives then fail within milliseconds instead of waiting out the
collective timeout (gloo's default is 30 minutes).
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 60.0  # seconds a collective may wait for a missing rank


class RankError(RuntimeError):
    """An exception raised on one rank, carried to the caller with its traceback."""

    def __init__(
        self,
        rank: int,
        message: str,
        remote_traceback: str = "",
        doing: dict[int, str] | None = None,
    ):
        self.rank = rank
        self.remote_traceback = remote_traceback
        # {rank: what it was doing when it failed}, e.g. "in all_reduce(numel=8, ...)"
        self.doing = dict(doing or {})
        text = f"rank {rank}: {message}"
        if self.doing:
            text += "\n" + "\n".join(
                f"  rank {r} was {d}" for r, d in sorted(self.doing.items())
            )
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback}"
        super().__init__(text)


def max_cpu_world_size(cpus: int | None = None) -> int:
    """How many CPU processes (ranks on gloo) a machine of ``cpus`` cores (this one
    by default) can run: ranks may outnumber cores (each runs one torch thread, and
    chapter 07 runs 8 on 2 cores), but not by far."""
    return max(8, 4 * (cpus or os.cpu_count() or 1))


def single_host_env() -> None:
    """Environment for a single-host world: gloo on the loopback interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def init_process_group(
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    store_file: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    device: int | None = None,
    single_host: bool = True,
) -> None:
    """Join a world of ``world_size`` ranks as ``rank``.

    With ``store_file`` the rendezvous is a :class:`torch.distributed.FileStore` on
    that path (one host, or a shared filesystem; the path must be fresh for each new
    world). Without it, the ``env://`` variables decide (``MASTER_ADDR`` etc., as
    torchrun sets them). ``device`` selects the CUDA device for nccl.
    ``single_host``: the ranks of a file-store world all run on this machine, so
    gloo is pinned to loopback; ``False`` when they span machines (gloo then uses
    ``GLOO_SOCKET_IFNAME``, or the interface this host's name resolves to).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs; this process sees none")
        torch.cuda.set_device(device if device is not None else rank)
    kwargs = dict(
        backend=backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    if store_file is not None:
        if single_host:
            single_host_env()
        kwargs["store"] = dist.FileStore(store_file, world_size)
    else:
        kwargs["init_method"] = "env://"
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(**kwargs)


def init_from_env(*, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT):
    """Join the world described by torchrun's environment variables."""
    missing = [
        v
        for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if v not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: run under torchrun "
            "(or use dtlab.launch.spawn)"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    init_process_group(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        backend=backend,
        timeout=timeout,
        device=int(os.environ.get("LOCAL_RANK", 0)),
    )


def abort_process_group() -> None:
    """Tear down this rank's process groups so that peers stuck in a collective with
    it fail fast. Safe to call when there is none.

    Gloo closes a group's connections only when the group object is freed
    (``abort()``/``shutdown()`` leave the sockets open, measured on torch 2.13), so
    this destroys the groups, makes every :class:`~dtlab.topology.Topology` drop its
    references, and collects garbage: the peers then see "connection closed" within
    milliseconds instead of waiting out the timeout.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    from dtlab import topology

    topology.release_groups()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort while already failing
        pass
    gc.collect()


# Errors that are the *consequence* of another rank failing: its peers see the
# connection close, or find no process group.
_SECONDARY = (
    "DistBackendError",
    "DistNetworkError",
    "Connection closed",
    "Connection reset",
    "no process group",
)


def rank_error(failures, what: str = "") -> RankError:
    """One :class:`RankError` for a set of failed ranks, naming the cause.

    ``failures``: ``(rank, message, traceback, t_fail)`` tuples, optionally with a
    fifth item, what the rank was doing (:func:`dtlab.comm.current_op`). The cause
    is a rank whose error is not a broken-connection error, earliest first; the
    other ranks are listed as having failed after it.
    """
    ranked = sorted(
        failures,
        key=lambda f: (any(s in f[1] + f[2] for s in _SECONDARY), f[3], f[0]),
    )
    doing = {f[0]: f[4] for f in failures if len(f) > 4 and f[4]}
    rank, message, tb = ranked[0][:3]
    others = sorted(f[0] for f in ranked[1:])
    if others:
        message += f"  [ranks {others} failed after it]"
    if what:
        message += f"  (while running {what})"
    return RankError(rank, message, tb.strip(), doing)


# What a fresh rank imports before it can do anything: torch alone is ~1.5 s of CPU,
# torch._dynamo (which the first optimizer imports) as much again.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "dtlab.launch",
    "dtlab.train",
]


def process_context():
    """The multiprocessing context :func:`spawn` starts ranks from.

    ``forkserver`` where the platform has it: one server process imports torch and
    dtlab once, and each rank is forked from it (two ranks start, all-reduce and
    finish in 0.15 s instead of 1.9 s as fresh interpreters, on this course's
    2-core machine). The server is
    started clean (like ``spawn``, never a fork of a threaded parent) and exits with
    its parent. ``spawn`` elsewhere (Windows). Either way ``fn`` must be importable
    by name.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    rank, world_size, fn, args, kwargs, store_file, backend, timeout, results, env
):
    # a forked rank inherits the server's environment, not the caller's current one
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    failure = None
    try:
        init_process_group(
            rank, world_size, backend=backend, store_file=store_file, timeout=timeout
        )
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        from dtlab import comm

        failure = (
            f"{type(exc).__name__}: {exc}",
            traceback.format_exc(),
            time.time(),
            comm.current_op(),
        )
    # outside the except block: the traceback no longer pins the groups' sockets
    abort_process_group()
    if failure is not None:
        results.put((rank, "error", *failure))
    else:
        # plain pickle bytes: a queue would share tensors through shared memory
        # handles that die with this process
        results.put((rank, "ok", pickle.dumps(value), "", 0.0, ""))


def spawn(
    fn,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
    join_timeout: float | None = None,
    **kwargs,
):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh processes (see
    :func:`process_context`), each with the default process group initialised;
    return the results in rank order.

    ``fn`` must be importable by name (a module-level function), and its result
    picklable. ``timeout`` bounds each collective; ``join_timeout`` (default: two
    collective timeouts plus start-up) bounds the whole run. If any rank raises, the
    others are stopped and a :class:`RankError` names the rank and carries its
    traceback. No process outlives this call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    join_timeout = join_timeout if join_timeout is not None else 2 * timeout + 60
    ctx = process_context()
    results = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="dtlab-store-")
    store_file = os.path.join(tmp, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                r,
                world_size,
                fn,
                args,
                kwargs,
                store_file,
                backend,
                timeout,
                results,
                dict(os.environ),
            ),
            daemon=True,
            name=f"dtlab-rank{r}",
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: list[tuple[int, str, str]] = []
    deadline = time.monotonic() + join_timeout
    errors_at = 0.0  # when the first error arrived
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, status, value, tb, t_fail, doing = results.get(timeout=0.1)
            except queue_mod.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0)
                    and r not in out
                    and r not in {e[0] for e in errors}
                ]
                if dead:
                    # allow a moment for a report that is still in the pipe
                    time.sleep(0.2)
                    if results.empty():
                        r = dead[0]
                        raise RankError(
                            r,
                            f"process died (exit code {procs[r].exitcode}) "
                            "without reporting",
                        ) from None
                if errors and time.monotonic() > errors_at + 5.0:
                    break  # the others had their chance to report; stop waiting
                if time.monotonic() > deadline:
                    pending = [
                        r
                        for r in range(world_size)
                        if r not in out and r not in {e[0] for e in errors}
                    ]
                    raise TimeoutError(
                        f"ranks {pending} did not finish within {join_timeout:.0f}s"
                    ) from None
                continue
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                if not errors:
                    errors_at = time.monotonic()
                errors.append((rank, value, tb, t_fail, doing))
        if errors:
            raise rank_error(errors, getattr(fn, "__name__", ""))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        shutil.rmtree(tmp, ignore_errors=True)

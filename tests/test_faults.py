"""Faults on the live cluster: each ends in a clear message, in bounded time, and a
cluster that works again without restarting the kernel.

Every fault a learner (or the machine) can cause is played on a small dedicated
cluster: an engine killed mid-step; an exception raised inside a collective during
backward (a DDP bucket hook, a ZeRO-3 reduce-scatter); the notebook's Stop button
while ``cluster.run`` waits; ranks that call mismatched collectives; a rank looping
in Python while its peer waits in a raw ``torch.distributed`` call, or after its
peer finished; a rank frozen by SIGSTOP; a return value that cannot be pickled.
Each test
checks the message names the rank *and* what it was doing, that the next run on the
same cluster succeeds, and that no engine process is left behind. The time from the
fault to the message is printed (run with ``-s``); the bounds asserted are only
there to prove nothing hangs.
"""

import _thread
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from dtlab.lab import EngineDied, LabCluster, RankError
from dtlab.lab.kernel.failures import EngineUnresponsive, RankHung

pytestmark = pytest.mark.cluster

TIMEOUT = 5.0  # the dedicated cluster's collective timeout (seconds)
# the torch function dtlab.comm.reduce_scatter calls (renamed in torch 2.13)
_RS = (
    "reduce_scatter_single"
    if hasattr(torch.distributed, "reduce_scatter_single")
    else "reduce_scatter_tensor"
)
BOUND = 30.0  # generous: a fault must surface well within this
HUNG_BOUND = TIMEOUT + 5.0  # issue 19: a hung rank is named within this
LOAD = 4.0  # what a loaded 2-core machine may add to it


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ipyparallel")
    before = _children()
    c = LabCluster(2, backend="gloo", timeout=TIMEOUT).start()
    yield c
    pids = set(c.pids.values())
    c.stop()
    time.sleep(0.5)
    assert not (pids & _children()), "engines outlived stop()"
    assert _children() <= before, "processes left behind"


def _assert_works(cluster):
    """The next run on the same cluster succeeds, with every engine it started
    still the same process (nothing was silently replaced)."""
    assert cluster.run(_rank_and_sum, timeout=60) == [(0, 1.0), (1, 1.0)]


def _assert_no_orphans(old_pids):
    time.sleep(0.3)
    left = [p for p in old_pids if psutil.pid_exists(p) and _not_zombie(p)]
    assert not left, f"old engines still running: {left}"


def _not_zombie(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---- functions run on every rank ----------------------------------------------------
def _rank_and_sum():
    import torch.distributed as dist

    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return dist.get_rank(), x.item()


def _tiny_gpt():
    from dtlab.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layers=1, n_heads=2, d_model=16)
    return GPT(cfg, seed=0), cfg


def _batch(cfg, rank):
    from dtlab.model import SyntheticTokens

    return SyntheticTokens(cfg.vocab_size, cfg.seq_len).shard(0, 4, rank, 2)


def _ddp_steps(steps):
    """DDP training steps, over and over (a step with many collectives)."""
    import torch.distributed as dist

    from dtlab.ddp import DistributedDataParallel

    model, cfg = _tiny_gpt()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # many small buckets
    x, y = _batch(cfg, dist.get_rank())
    for _ in range(steps):
        ddp.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)
        loss.backward()
    return float(loss)


def _raise_inside(torch_fn_name, bad_rank, stage):
    """Train one step with a fault injected into ``torch.distributed.<fn>`` on one
    rank: the error is raised inside dtlab.comm's call, from a gradient hook, in the
    middle of backward, while the other rank is in the same collective."""
    import torch.distributed as dist

    rank = dist.get_rank()
    real = getattr(dist, torch_fn_name)

    def broken(*args, **kwargs):
        raise RuntimeError(f"injected fault in {torch_fn_name}")

    model, cfg = _tiny_gpt()
    if stage == "ddp":
        from dtlab.ddp import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=0.001)
    else:
        from dtlab.zero import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model, stage=3)
    x, y = _batch(cfg, rank)
    _, loss = wrapped(x, y)
    if rank == bad_rank:
        setattr(dist, torch_fn_name, broken)
    try:
        loss.backward()
        wrapped.finish_gradient_synchronization()
    finally:
        setattr(dist, torch_fn_name, real)  # the engine lives on: undo the fault
    return float(loss)


def _traffic(n):
    from dtlab import comm

    for _ in range(n):
        comm.all_reduce(torch.ones(16), tag="loop")
        time.sleep(0.05)
    return n


def _one_sleeps(seconds):
    """Rank 1 sleeps in Python while rank 0 waits in an all-reduce for it."""
    import torch.distributed as dist

    from dtlab import comm

    if dist.get_rank() == 1:
        time.sleep(seconds)
    comm.all_reduce(torch.ones(4), tag="waiting-for-1")
    return True


def _mismatch(kind):
    """Ranks that disagree about the collective: another shape, or another op."""
    import torch.distributed as dist

    from dtlab import comm

    rank = dist.get_rank()
    x = torch.ones(8 if rank == 0 or kind == "op" else 16)
    if kind == "op" and rank == 1:
        comm.broadcast(x, src=0, tag="mismatch")
    else:
        comm.all_reduce(x, tag="mismatch")
    return x.sum().item()


def _time_all_reduce(n):
    import torch.distributed as dist

    x = torch.ones(256)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x)
    return (time.perf_counter() - t0) / n


# ---- the faults ---------------------------------------------------------------------
@pytest.mark.slow  # a restart: new engines import torch again
def test_engine_killed_mid_step_is_reported_and_restart_recovers(cluster):
    old = dict(cluster.pids)
    victim = old[1]
    killed_at = []

    def kill_once_training():
        # like the OOM killer: rank 1's engine dies while both are in a DDP step
        deadline = time.monotonic() + 60
        while "all_reduce" not in cluster.doing().get(1, ""):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_once_training, daemon=True)
    killer.start()
    with pytest.raises(EngineDied) as info:
        cluster.run(_ddp_steps, 100_000, timeout=120)
    killer.join()
    assert killed_at, "the ranks never reached a DDP all-reduce"
    elapsed = time.monotonic() - killed_at[0]
    message = str(info.value)
    print(f"\nengine killed -> EngineDied after {elapsed:.2f}s:\n{message}")
    assert elapsed < BOUND
    assert "rank 1" in message and f"pid {victim}" in message
    assert "SIGKILL" in message  # how it died
    assert "restart()" in message  # what to do
    # what the ranks were doing: every rank's status, the dead one's last op
    assert "rank 0 was " in message and "rank 1 was " in message
    assert "all_reduce(" in message
    with pytest.raises(EngineDied, match="rank.? 1"):
        cluster.reset()  # a new group cannot bring back a dead process
    t0 = time.monotonic()
    cluster.restart()
    print(f"restart took {time.monotonic() - t0:.1f}s")
    _assert_works(cluster)
    _assert_no_orphans(old.values())


@pytest.mark.parametrize(
    "torch_fn, bad_rank, stage, op, tag",
    [
        ("all_reduce", 1, "ddp", "all_reduce", "tag 'ddp'"),
        (_RS, 0, "zero3", "reduce_scatter", "tag 'zero3/rs/"),
    ],
    ids=["ddp-bucket-hook", "zero3-reduce-scatter"],
)
def test_exception_inside_a_collective_during_backward(
    cluster, torch_fn, bad_rank, stage, op, tag
):
    pids = dict(cluster.pids)
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(_raise_inside, torch_fn, bad_rank, stage, timeout=120)
    elapsed = time.monotonic() - t0
    err = info.value
    print(f"\n{stage}: RankError after {elapsed:.2f}s:\n{str(err).split('---')[0]}")
    assert elapsed < BOUND
    assert err.rank == bad_rank
    assert f"injected fault in {torch_fn}" in str(err)
    assert "_raise_inside" in err.remote_traceback
    # the failing rank says which collective it was in, group and tag included
    mine = err.doing[bad_rank]
    assert mine.startswith(f"in {op}(") and "group world" in mine and tag in mine
    assert f"rank {bad_rank} was in {op}(" in str(err)
    assert (1 - bad_rank) in err.doing  # and its peer's state is there too
    _assert_works(cluster)
    assert cluster.pids == pids  # same engines: only the group was renewed


class _StopButton:
    """Jupyter's Stop (SIGINT to the kernel, as ``_thread.interrupt_main``) pressed
    ``at`` seconds from now, and pressed again every second until the main thread
    has received it, as a learner does when nothing happens. In two of five full
    runs of the suite on 2 cores, a single press left ``cluster.run`` waiting as
    if none came, until the group's timeout: the SIGINT handler was
    Python's default (no test changes it: checked after every test) and nothing in
    the wait loop catches ``KeyboardInterrupt``; where that press went is not
    found. What the lab does once the main thread receives it is what this test
    is about, so it records when that happened and fails if it never does."""

    def __init__(self, at: float):
        self.received = 0.0  # seconds from now to the handler's call
        self.presses = 0
        self._t0 = time.monotonic()
        self._done = threading.Event()
        self._old = signal.signal(signal.SIGINT, self._handler)
        self._thread = threading.Thread(target=self._press, args=(at,), daemon=True)
        self._thread.start()

    def _handler(self, signum, frame):
        if not self.received:
            self.received = time.monotonic() - self._t0
        raise KeyboardInterrupt

    def _press(self, at):
        if self._done.wait(at):
            return
        while not self.received and self.presses < 10:
            self.presses += 1
            _thread.interrupt_main()
            if self._done.wait(1.0):
                return

    def release(self):
        self._done.set()
        self._thread.join()
        signal.signal(signal.SIGINT, self._old)
        if self.presses > 1:
            print(f"\nStop pressed {self.presses} times before it was received")


def test_stop_button_while_run_waits_stops_the_ranks(cluster):
    """KeyboardInterrupt in the kernel (what Jupyter's Stop sends) while
    ``cluster.run`` waits: ranks are interrupted too, the message says what they
    were doing, and the next run works."""
    pids = dict(cluster.pids)
    # rank 0 blocks in an all-reduce, rank 1 sleeps in Python: the Stop must free
    # both (interrupting rank 1 closes its connections, which frees rank 0)
    stop = _StopButton(at=1.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            cluster.run(_one_sleeps, 60, timeout=120)
    finally:
        stop.release()
    assert stop.received, "the Stop never reached the kernel's main thread"
    elapsed = time.monotonic() - t0 - stop.received
    message = str(info.value)
    print(f"\nStop -> KeyboardInterrupt after {elapsed:.2f}s:\n{message}")
    assert elapsed < BOUND
    assert "_one_sleeps was interrupted" in message
    assert "rank 0 was in all_reduce(numel=4" in message
    assert "tag 'waiting-for-1'" in message
    assert "rank 1 was running Python, no collective yet" in message
    assert "every rank is free again" in message
    _assert_works(cluster)
    assert cluster.pids == pids


def test_stop_from_a_live_callback(cluster):
    """The same Stop arriving while ``on_events`` hands telemetry to a plot."""
    seen = []

    def on_events(batch):
        seen.extend(batch)
        raise KeyboardInterrupt

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="_traffic was interrupted"):
        cluster.run(_traffic, 10_000, on_events=on_events, publish_interval=0.02)
    elapsed = time.monotonic() - t0
    print(f"\nStop in on_events -> KeyboardInterrupt after {elapsed:.2f}s")
    assert seen and time.monotonic() - t0 < BOUND
    _assert_works(cluster)


def test_a_rank_that_never_arrives_is_named_with_what_each_was_doing(cluster):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(_one_sleeps, TIMEOUT + 2, timeout=120)
    elapsed = time.monotonic() - t0
    err = info.value
    print(f"\nmissing rank -> RankError after {elapsed:.2f}s:\n{str(err)[:600]}")
    # rank 0 waited out the group's timeout in the all-reduce rank 1 never joined
    assert err.rank == 0 and TIMEOUT * 0.8 < elapsed < TIMEOUT + BOUND
    assert err.doing[0].startswith("in all_reduce(numel=4, float32, group world")
    _assert_works(cluster)


def test_mismatched_ops_hang_until_the_timeout_and_say_which_ops(cluster):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(_mismatch, "op", timeout=120)
    elapsed = time.monotonic() - t0
    err = info.value
    print(f"\nmismatched ops -> RankError after {elapsed:.2f}s:\n{str(err)[:700]}")
    assert elapsed < TIMEOUT + BOUND
    # gloo cannot tell, but the status of each rank shows the disagreement
    assert "rank 0 was in all_reduce(numel=8" in str(err)
    assert "rank 1 was in broadcast(numel=8" in str(err)
    _assert_works(cluster)


@pytest.mark.slow  # a restart: new engines import torch again
def test_mismatched_shapes_abort_an_engine_unless_collectives_are_checked(cluster):
    old = dict(cluster.pids)
    t0 = time.monotonic()
    with pytest.raises((EngineDied, RankError)) as info:
        cluster.run(_mismatch, "shape", timeout=120)
    elapsed = time.monotonic() - t0
    message = str(info.value)
    print(f"\nmismatched shapes (unchecked) after {elapsed:.2f}s:\n{message}")
    assert elapsed < BOUND
    # gloo aborts the process that receives more bytes than it expected
    assert isinstance(info.value, EngineDied) and "SIGABRT" in message
    assert "check_collectives=True" in message  # the way out, named
    assert "all_reduce(numel=" in message
    cluster.restart()
    _assert_no_orphans(old.values())
    per_op = {}
    try:
        per_op["off"] = max(cluster.run(_time_all_reduce, 50))
        # torch's checker: every collective first compares op, shape and dtype
        cluster.reset(check_collectives=True)
        per_op["on"] = max(cluster.run(_time_all_reduce, 50))
        pids = dict(cluster.pids)
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            cluster.run(_mismatch, "shape", timeout=120)
        elapsed = time.monotonic() - t0
        print(f"mismatched shapes (checked) after {elapsed:.2f}s:\n{info.value}"[:900])
        assert "Detected mismatch between collectives" in str(info.value)
        assert "TensorShape=[16]" in str(info.value)
        assert cluster.pids == pids  # nobody died
        _assert_works(cluster)
    finally:
        cluster.reset(check_collectives=False)
    print(
        f"all_reduce(256 floats) on 2 CPU ranks: {per_op['off'] * 1e3:.2f} ms "
        f"unchecked, {per_op['on'] * 1e3:.2f} ms with check_collectives"
    )
    _assert_works(cluster)


# ---- hangs end with the culprit named (issue 19) -----------------------------------
def _one_loops_in_python(peer):
    """Rank 1 never finishes (a loop with no end, in Python); rank 0 waits for it
    in a raw torch.distributed all-reduce (``peer="waits"``) or returns."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        while True:
            sum(range(100))  # the bug: nothing ends this loop
    if peer == "waits":
        dist.all_reduce(torch.ones(4))  # raw: not through dtlab.comm
    return dist.get_rank()


@pytest.mark.parametrize("peer", ["waits", "finishes"])
def test_a_rank_that_never_finishes_is_named_and_interrupted(cluster, peer):
    pids = dict(cluster.pids)
    t0 = time.monotonic()
    with pytest.raises(RankHung) as info:
        cluster.run(_one_loops_in_python, peer, timeout=600)
    elapsed = time.monotonic() - t0
    err, message = info.value, str(info.value)
    print(f"\nhung rank ({peer}) -> RankHung after {elapsed:.2f}s:\n{message[:900]}")
    assert err.rank == 1
    # within the group's timeout + 5 s, not the call's 600 s
    assert elapsed < HUNG_BOUND + LOAD, f"named after {elapsed:.1f}s"
    after = "after rank 0 failed" if peer == "waits" else "after rank 0 finished"
    assert "rank 1 still running" in message and after in message
    assert "rank 1 was running Python, no collective yet" in message
    assert "every rank is free again" in message  # how to recover
    # its traceback at the interrupt: the function and line it was stuck in
    assert "in _one_loops_in_python" in err.remote_traceback
    if peer == "waits":
        # the raw torch.distributed call is recorded like dtlab.comm's
        assert (
            "all_reduce(numel=4, float32, group world, tag 'torch.distributed')"
            in (err.doing[0])
        )
    _assert_works(cluster)
    assert cluster.pids == pids  # interrupted, not replaced


def test_a_stopped_rank_is_unresponsive_and_recovers_after_sigcont(cluster):
    pid = cluster.pids[1]
    # a short stop: resumed before the controller drops the engine
    threading.Timer(1.0, os.kill, (pid, signal.SIGSTOP)).start()
    t0 = time.monotonic()
    with pytest.raises(EngineUnresponsive) as info:
        cluster.run(_traffic, 10_000, timeout=600)
    elapsed = time.monotonic() - t0 - 1.0
    message = str(info.value)
    print(f"\nSIGSTOP -> EngineUnresponsive after {elapsed:.2f}s:\n{message}")
    assert elapsed < BOUND
    assert f"rank 1's engine (pid {pid}) is alive but not answering" in message
    assert "stopped (SIGSTOP" in message and "died" not in message
    assert f"kill -CONT {pid}" in message and "cluster.reset()" in message
    with pytest.raises(EngineUnresponsive, match="is stopped"):
        cluster.reset()  # still stopped: said again, and nothing hangs
    os.kill(pid, signal.SIGCONT)
    cluster.reset()
    _assert_works(cluster)
    assert cluster.pids[1] == pid

    # a long stop: the controller drops the engine after missed heartbeats
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while cluster.rank_to_engine[1] in cluster.client.ids:
        assert time.monotonic() < deadline, "the controller never dropped it"
        time.sleep(0.2)
    os.kill(pid, signal.SIGCONT)
    for call in (lambda: cluster.run(_rank_and_sum), cluster.health):
        with pytest.raises(EngineUnresponsive) as info:  # not IndexError
            call()
        assert "controller dropped it" in str(info.value)
        assert "cluster.reset()" in str(info.value)
    cluster.reset()  # a new engine for rank 1
    assert cluster.pids[1] != pid
    _assert_works(cluster)
    _assert_no_orphans([pid])


def _returns_a_lock():
    return {"lock": threading.Lock()}


def test_a_return_value_that_cannot_be_pickled_is_named(cluster):
    with pytest.raises(RankError) as info:
        cluster.run(_returns_a_lock)
    message = str(info.value)
    print(f"\nunpicklable return value:\n{message[:400]}")
    assert "the return value on rank" in message and "builtins.dict" in message
    assert "cannot pickle '_thread.lock' object" in message
    _assert_works(cluster)


# ---- out of memory (issue 19) ---------------------------------------------------
def _memory_cgroup_of(pid: int) -> str | None:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.strip().split(":", 2)
            if "memory" in controllers.split(","):
                return os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
    return None


def _allocate_until_killed(rank):
    import torch.distributed as dist

    held = []
    if dist.get_rank() == rank:
        while True:
            held.append(torch.ones(16 * 2**20))  # 64 MiB, every page touched
    dist.all_reduce(torch.ones(1))  # the peer waits for it
    return len(held)


@pytest.mark.slow  # a restart: new engines import torch again
def test_an_engine_killed_for_memory_says_out_of_memory(cluster):
    pid = cluster.pids[1]
    parent = _memory_cgroup_of(pid)
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable cgroup-v1 memory controller here")
    # the rank gets a memory cgroup of its own, 256 MiB more than it holds: the
    # kernel's OOM killer ends it there, and nothing else on the machine
    child = os.path.join(parent, f"dtlab-oom-{pid}")
    try:
        os.mkdir(child)
        with open(os.path.join(child, "memory.limit_in_bytes"), "w") as f:
            f.write(str(256 * 2**20))
        with open(os.path.join(child, "cgroup.procs"), "w") as f:
            f.write(str(pid))
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup here: {exc}")
    try:
        time.sleep(1.2)  # a heartbeat from inside the new cgroup
        t0 = time.monotonic()
        with pytest.raises(EngineDied) as info:
            cluster.run(_allocate_until_killed, 1, timeout=120)
        message = str(info.value)
        print(
            f"\nOOM kill -> EngineDied after {time.monotonic() - t0:.2f}s:\n{message}"
        )
        assert "rank 1" in message and f"pid {pid}" in message
        assert "out of memory (the kernel's OOM killer" in message
        assert "restart()" in message  # the restart offered
    finally:
        deadline = time.monotonic() + 10
        while os.path.isdir(child):
            try:
                os.rmdir(child)  # empty once the engine is gone
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    cluster.restart()
    _assert_works(cluster)

"""The fault-tolerant job of :mod:`dtlab.ft.quorum`, run under torchft instead
(chapter 13: dtlab's quorum beside the library it follows).

torchft (Meta; ``pip install torchft``) gives each *replica group* its own world
and joins the groups through a *lighthouse*: a server that forms a quorum of the
groups that ask for one each step, waits a join timeout for groups still
heartbeating, and drops a group whose heartbeat stopped. A ``Manager`` per replica
talks to it, averages gradients over the quorum's participants
(``ProcessGroupGloo``, rebuilt when the quorum changes) and heals a replica that is
behind from a peer (its state sent over HTTP). :func:`run_torchft` trains the
course's GPT on two replica groups of one process each, the same shards and the
same AdamW as ``tests/test_fault_tolerance.py``'s dtlab run; ``down=(first, end)``
makes replica 1 exit before step ``first`` and a new process (fresh weights, step
0) take its place, from step ``end`` on if the lighthouse has seen its heartbeat
by then (replica 0 waits for it to start, and it waits 0.5 s before saying so;
else a step later: the records say which steps each replica took part in).

Not part of the course's requirements: torchft must be importable (the functions
import it when called). Its Manager and its HTTP transport listen on every
interface (``[::]``), and its store is a TCPStore: run it on a trusted host only.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback

import torch

__all__ = ["run_torchft"]


def _replica(rid, lighthouse, steps, batch, down, fresh, events, results):
    """One replica group of one process: train until ``steps`` steps are
    committed (replica 1 stops at ``down[0]`` unless it is the ``fresh`` one)."""
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.ddp import DistributedDataParallel
        from torchft.optim import OptimizerWrapper

        from dtlab.model import GPT, GPTConfig, SyntheticTokens, shard_batch
        from dtlab.reference import make_optimizer

        cfg = GPTConfig()
        data = SyntheticTokens(cfg.vocab_size, cfg.seq_len)
        model = GPT(cfg, seed=123 if fresh else 0)  # a new process: fresh weights
        inner = make_optimizer(model.parameters())

        def load(state):
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optim"])

        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        seconds = datetime.timedelta(seconds=30)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=seconds),
            min_replica_size=1,
            load_state_dict=load,
            state_dict=lambda: {
                "model": model.state_dict(),
                "optim": inner.state_dict(),
            },
            replica_id=f"replica{rid}",
            store_addr="localhost",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            hostname="localhost",
            timeout=seconds,
            quorum_timeout=seconds,
            use_async_quorum=False,  # the quorum (and healing) ends before forward
        )
        ddp = DistributedDataParallel(manager, model)
        opt = OptimizerWrapper(manager, inner)
        if fresh:  # let the lighthouse see a heartbeat (every 0.1 s) first, or
            time.sleep(0.5)  # replica 0 may form the next quorum without it
        results.put((rid, "ready", None))
        events["go"].wait(60)
        records = []
        while manager.current_step() < steps:
            step = manager.current_step()
            if down is not None and not fresh and rid == 1 and step == down[0]:
                break  # this process is lost
            if down is not None and rid == 0 and step == down[1]:
                events["back"].wait(60)  # the new replica 1 is heartbeating
            opt.zero_grad()  # torchft: the quorum, and healing if behind
            step = manager.current_step()
            x, y = shard_batch(*data.batch(step, batch), rid, 2)
            _, loss = ddp(x, y)
            loss.backward()
            opt.step()  # commits only if every participant succeeded
            records.append((step, manager.num_participants(), loss.item()))
        final = {n: p.detach().clone() for n, p in model.named_parameters()}
        out = {"records": records, "final": final, "optim": inner.state_dict()}
        manager.shutdown(wait=False)
        results.put((rid, "done", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rid, "error", traceback.format_exc()))


def run_torchft(
    steps: int = 8,
    global_batch_size: int = 8,
    down: tuple[int, int] | None = None,
    timeout: float = 120.0,
) -> dict:
    """Train on two torchft replica groups; returns ``{"replica0": ...,
    "replica1": ..., "replica1_lost": ...}`` (the last with ``down``), each
    ``{"records": [(step, participants, loss)], "final": {name: tensor},
    "optim": state_dict}``. Raises ``RuntimeError`` with a replica's traceback."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=10_000,  # wait for a heartbeating group to join
        heartbeat_timeout_ms=1_000,  # a group silent this long is gone
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    events = {"go": ctx.Event(), "back": ctx.Event()}
    procs = []

    def start(rid, fresh=False):
        args = (rid, lighthouse.address(), steps, global_batch_size, down, fresh)
        p = ctx.Process(target=_replica, args=(*args, events, results), daemon=True)
        p.start()
        procs.append(p)

    out, ready = {}, 0
    try:
        start(0)
        start(1)
        deadline = time.monotonic() + timeout
        want = 3 if down is not None else 2
        while len(out) < want:
            try:
                rid, status, value = results.get(timeout=0.5)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"torchft: {sorted(out)} after {timeout}s"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"torchft replica {rid} failed:\n{value}")
            if status == "ready":
                ready += 1
                if ready == 2:
                    events["go"].set()
                elif ready == 3:
                    events["back"].set()
                continue
            name = f"replica{rid}"
            if down is not None and rid == 1 and ready == 2:
                out[f"{name}_lost"] = pickle.loads(value)
                start(1, fresh=True)  # a new process takes the lost one's place
            else:
                out[name] = pickle.loads(value)
        return out
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join()
        lighthouse.shutdown()

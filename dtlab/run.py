"""Headless runs: ``dtlab run CONFIG`` trains a :class:`~dtlab.train.TrainConfig`
without the notebook, and leaves behind what the lab would have shown.

Taught in chapter 02 (launchers) and used by every chapter's "now run it for real"
section: the config a learner tuned in the lab runs unchanged here, under torchrun
on one node or many, or on N local processes::

    torchrun --standalone --nproc-per-node 4 -m dtlab.cli run cfg.json --out runs/a
    dtlab run cfg.json --nproc 4 --out runs/a            # same numbers, no torchrun
    dtlab run cfg.json --nproc 4 --set strategy=zero3 --set model.n_layers=4

The config file is JSON (or TOML, Python 3.11+), the shape of
``TrainConfig.to_dict()``: top-level fields, ``model`` and ``layout`` as nested
tables. An unknown key is an error that lists the valid ones.

Into ``--out`` go ``rank{R}.jsonl`` (every telemetry event of rank R, one JSON
object a line: step records, comm events, compute spans, memory samples),
``trace.json`` (all ranks on one time axis, Chrome trace format: open it in
ui.perfetto.dev), ``config.json`` (the resolved config) and ``summary.json``
(losses, step time, bytes per step and memory, each next to :mod:`dtlab.estimate`).
Rank 0 prints one line per step and the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import pathlib
import sys
import time

from dtlab.events import Kind
from dtlab.measure import (
    format_summary,
    measured_memory,
    measured_traffic,
    predicted_memory,
    predicted_traffic,
    summarize,
)
from dtlab.model import GPTConfig
from dtlab.topology import Layout
from dtlab.train import TrainConfig, default_device

__all__ = [
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "load_config",
    "run_on_rank",
    "launch",
    "main",
    # measurement next to prediction, from dtlab.measure
    "summarize",
    "format_summary",
    "predicted_traffic",
    "predicted_memory",
    "measured_traffic",
    "measured_memory",
]

SETUP_STEP = -1  # the telemetry step of events recorded while the model is built
_NESTED = {"model": GPTConfig, "layout": Layout}


# ---- configuration files -------------------------------------------------------------
def _check_keys(d: dict, cls, where: str) -> None:
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in d:
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(
                f"unknown {where}key {key!r}{hint}; valid {where}keys: "
                f"{', '.join(valid)}"
            )


def config_from_dict(d: dict) -> TrainConfig:
    """A :class:`TrainConfig` from the dict form (``model`` and ``layout`` nested).

    Keys are checked against the dataclasses' own fields, so fields added to
    ``TrainConfig`` later are accepted without a change here; anything else is a
    ``ValueError`` that lists the valid keys.
    """
    if not isinstance(d, dict):
        raise ValueError(f"a config is a table of fields, got {type(d).__name__}")
    _check_keys(d, TrainConfig, "")
    for name, cls in _NESTED.items():
        value = d.get(name)
        if value is not None and not isinstance(value, dict | cls):
            raise ValueError(
                f"{name} must be a table of {cls.__name__} fields, got {value!r}"
            )
        if isinstance(value, dict):
            _check_keys(value, cls, f"{name} ")
    return TrainConfig.from_dict(d)


def config_to_dict(config: TrainConfig) -> dict:
    """The JSON-safe dict form of ``config`` (what :func:`config_from_dict` reads)."""
    return config.to_dict()


def _parse_value(text: str):
    """``--set`` values are JSON where they parse (``4``, ``null``, ``[0.9, 0.95]``,
    ``true``), plain strings otherwise (``zero3``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(d: dict, overrides) -> dict:
    """``key=value`` overrides (``model.n_layers=4``, ``layout.dp=2``) on a copy."""
    out = json.loads(json.dumps(d))
    for item in overrides or ():
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(
                f"--set takes KEY=VALUE (e.g. strategy=zero1), got {item!r}"
            )
        *parents, leaf = key.split(".")
        if len(parents) > 1:
            raise ValueError(f"--set {key}: nested keys go one level deep (model.X)")
        table = out
        if parents:
            if parents[0] not in _NESTED:
                raise ValueError(
                    f"--set {key}: only {', '.join(_NESTED)} have nested keys"
                )
            table = out.get(parents[0]) or {}
            out[parents[0]] = table
        table[leaf] = _parse_value(text)
    return out


def load_config(path, overrides=()) -> TrainConfig:
    """Read a JSON or TOML config file and apply ``--set`` overrides."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError("TOML configs need Python 3.11+; use JSON") from None
        with open(path, "rb") as f:
            d = tomllib.load(f)
    else:
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return config_from_dict(apply_overrides(d, overrides))


# ---- one rank ------------------------------------------------------------------------
def _all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's ``data`` (:func:`dtlab.objects.all_gather_bytes`): rank 0 needs
    all ranks' events even when no filesystem is shared between nodes."""
    from dtlab.objects import all_gather_bytes

    return all_gather_bytes(data, device=default_device(), tag="run/gather")


def _step_line(record: dict, steps: int, wire: float) -> str:
    tok_s = record.get("tokens_per_s", 0.0)
    return (
        f"step {record['step'] + 1:>4}/{steps}  loss {record['loss']:.4f}  "
        f"grad_norm {record['grad_norm']:.3f}  {record['time_s'] * 1e3:7.1f} ms  "
        f"{tok_s:9,.0f} tok/s  sent {wire / 1e6:7.3f} MB"
    )


def run_on_rank(
    config: TrainConfig,
    out,
    *,
    echo: bool = True,
    steps: int | None = None,
    step_lines: bool = True,
) -> dict | None:
    """Train ``config`` on this rank of the current process group (a collective
    call: every rank calls it), recording telemetry into ``out``.

    Returns the run's summary (:func:`summarize`) on rank 0, ``None`` elsewhere.
    Rank 0 prints the summary when ``echo``, and a line per step if also
    ``step_lines``.
    """
    import torch
    import torch.distributed as dist

    from dtlab import comm, telemetry
    from dtlab.train import Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    out = pathlib.Path(out)
    layout = config.check(world)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("rank*.jsonl"), out / "trace.json", out / "summary.json"]:
            old.unlink(missing_ok=True)  # a previous run's files would mislead
        (out / "config.json").write_text(json.dumps(config_to_dict(config), indent=1))
    # one epoch for every rank (rank 0's wall clock): the trace lines ranks up, and
    # the broadcast doubles as the barrier after rank 0's clean-up
    epoch = torch.tensor([time.time()], dtype=torch.float64, device=default_device())
    comm.broadcast(epoch, 0, tag="run/epoch")
    out.mkdir(parents=True, exist_ok=True)  # other nodes: their own folder
    (out / f"rank{rank}.jsonl").unlink(missing_ok=True)
    sink = telemetry.JsonlSink(out, rank)
    sent: dict[int, float] = {}  # wire bytes this rank sent, per step

    def count(event):
        if event["kind"] == Kind.COMM:
            sent[event["step"]] = sent.get(event["step"], 0.0) + event["wire_bytes"]

    rec = telemetry.Recorder(
        rank, [sink, telemetry.CallbackSink(count)], epoch=float(epoch[0])
    )
    steps = config.steps if steps is None else steps
    try:
        with telemetry.use(rec):
            rec.step = SETUP_STEP  # parameter broadcasts etc. are not step traffic
            trainer = Trainer(config)
            for _ in range(steps):
                record = trainer.fit(1)[-1]
                if echo and step_lines and rank == 0:
                    print(_step_line(record, steps, sent.get(record["step"], 0.0)),
                          flush=True)  # fmt: skip
    finally:
        rec.close()
    # every rank's events to rank 0 (outside the recorder: not part of the run)
    blobs = _all_gather_bytes(pathlib.Path(sink.path).read_bytes())
    if rank != 0:
        return None
    events = [json.loads(line) for b in blobs for line in b.splitlines() if line]
    telemetry.write_chrome_trace(out / "trace.json", events)
    summary = summarize(config, layout, events)
    summary["files"] = sorted(
        str(p) for p in [*out.glob("rank*.jsonl"), out / "trace.json"]
    ) + [str(out / "config.json"), str(out / "summary.json")]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if echo:
        print(format_summary(summary), flush=True)
    return summary


# ---- launching -----------------------------------------------------------------------
def _spawned(config, out, echo, steps, step_lines):
    return run_on_rank(config, out, echo=echo, steps=steps, step_lines=step_lines)


def launch(
    config: TrainConfig,
    nproc: int,
    out,
    *,
    echo: bool = True,
    steps: int | None = None,
    step_lines: bool = True,
    timeout: float = 60.0,
) -> dict:
    """Run ``config`` on ``nproc`` fresh local processes (gloo; a file-store
    rendezvous, nothing listens on the network); rank 0's summary. ``timeout``
    bounds each collective (a missing rank), not the run."""
    from dtlab.launch import spawn

    config.check(nproc)  # before any process starts
    return spawn(
        _spawned, nproc, config, str(out), echo, steps, step_lines,
        timeout=timeout, join_timeout=float("inf"),
    )[0]  # fmt: skip


def _under_torchrun() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def main(argv=None) -> int:
    """``dtlab run CONFIG [--nproc N] [--out DIR] [--set KEY=VALUE ...]``."""
    p = argparse.ArgumentParser(
        prog="dtlab run",
        description="Train a TrainConfig headless (under torchrun, or on --nproc "
        "local processes) and write telemetry and a Perfetto trace to --out.",
    )
    p.add_argument("config", help="a JSON (or TOML) TrainConfig file")
    p.add_argument(
        "--nproc", type=int, default=None,
        help="local processes to start (default: the config's layout, else 1); "
        "under torchrun the world is torchrun's",
    )  # fmt: skip
    p.add_argument("--out", default="dtlab-run", help="folder for the run's files")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config field (model.n_layers=4, layout.dp=2, grad_clip=null)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=None, help="override config.steps")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a collective may wait for a missing rank")  # fmt: skip
    a = p.parse_args(argv)
    torchrun = _under_torchrun()
    rank = int(os.environ.get("RANK", 0)) if torchrun else 0
    try:
        config = load_config(a.config, a.set)
        if a.steps is not None:
            config = config.replace(steps=a.steps)
        if torchrun:
            world = int(os.environ["WORLD_SIZE"])
            if a.nproc is not None and a.nproc != world:
                raise ValueError(
                    f"--nproc {a.nproc} but torchrun started {world} processes: "
                    "drop --nproc under torchrun"
                )
        else:
            world = a.nproc or (config.layout.world_size if config.layout else 1)
            if world < 1:
                raise ValueError(f"--nproc must be >= 1, got {world}")
        config.check(world)  # before any process group forms
    except (ValueError, NotImplementedError) as exc:
        # every rank says why: torchrun stops the others as soon as one exits, so
        # a message left to rank 0 alone is lost whenever another rank exits first
        who = f" (rank {rank})" if torchrun else ""
        print(f"dtlab run{who}: {exc}", file=sys.stderr)
        return 2
    if not torchrun:
        from dtlab.launch import RankError

        try:
            launch(config, world, a.out, step_lines=not a.quiet, timeout=a.timeout)
        except (RankError, TimeoutError) as exc:
            print(f"dtlab run: {exc}", file=sys.stderr)
            return 1
        return 0
    import torch

    from dtlab.launch import abort_process_group, init_from_env, single_host_env

    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]:
        single_host_env()  # one node: gloo on loopback (several: the user's choice)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    init_from_env(timeout=a.timeout)
    try:
        run_on_rank(config, a.out, step_lines=not a.quiet)
    finally:
        # a failing rank tears its groups down so its peers fail fast, not at timeout
        abort_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``dtlab`` command.

- ``dtlab lab``: JupyterLab on the chapter index, on 127.0.0.1, token on, no
  news pop-up; SIGTERM, SIGHUP or SIGINT stops it with its kernels (and so their
  clusters) before ``dtlab lab`` returns.
- ``dtlab info``: what this machine offers (backend, GPUs, CPU engines it can run).
- ``dtlab run CONFIG``: train a :class:`dtlab.train.TrainConfig` headless, under
  torchrun or on ``--nproc`` local processes (:mod:`dtlab.run`).
- ``dtlab plan``: the planner's fastest layouts for a model on N GPUs
  (:func:`dtlab.estimate.plan`); ``dtlab plan --dry-run``: dtlab's own code at a
  layout's scale on a fake process group, beside the estimate (:mod:`dtlab.dryrun`).
- ``dtlab bench [PART ...]``: every comparison with PyTorch's own implementations
  and with the estimates (or only the parts named), in one run, one table
  (:mod:`dtlab.bench`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time


def default_notebooks() -> pathlib.Path:
    """``./notebooks`` when run from a clone's root, else the clone this package
    was installed from (``pip install -e .``)."""
    here = pathlib.Path.cwd() / "notebooks"
    if (here / "index.ipynb").exists():
        return here
    return pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def lab_command(
    notebooks: pathlib.Path,
    *,
    port: int = 8888,
    no_browser: bool = False,
    token: str | None = None,
) -> list[str]:
    """The JupyterLab command line ``dtlab lab`` runs (separate for testing)."""
    cmd = [
        sys.executable, "-m", "jupyter", "lab",
        f"--ServerApp.root_dir={notebooks}",
        "--ServerApp.ip=127.0.0.1",  # loopback only; never 0.0.0.0
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",  # a busy port is an error, not a surprise port
        "--LabApp.default_url=/lab/tree/index.ipynb",
        # no "news" notification over every chapter, no update check: a course
        # server has nothing to announce, and may be offline
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    if token is not None:
        if not token:
            raise ValueError("an empty token would turn authentication off")
        cmd.append(f"--IdentityProvider.token={token}")
    if no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root
    return cmd


def _lab(args) -> int:
    notebooks = pathlib.Path(args.notebooks).resolve()
    if not (notebooks / "index.ipynb").exists():
        print(
            f"dtlab lab: no chapter index at {notebooks}/index.ipynb", file=sys.stderr
        )
        return 2
    if shutil.which("jupyter") is None and not _has_module("jupyterlab"):
        print("dtlab lab: JupyterLab is not installed: pip install 'dtlab[lab]'",
              file=sys.stderr)  # fmt: skip
        return 2
    cmd = lab_command(notebooks, port=args.port, no_browser=args.no_browser,
                      token=args.token)  # fmt: skip
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return run_server(cmd, env)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def run_server(cmd: list[str], env: dict, *, grace: float = 20.0) -> int:
    """Run the JupyterLab command ``cmd`` as a child and return its exit code.

    SIGTERM, SIGHUP or SIGINT to this process is passed on as SIGTERM, on which the
    Jupyter server shuts its kernels down (each stopping its clusters) and exits;
    this process waits for that, up to ``grace`` seconds, then SIGKILLs the
    server (its kernels then notice their parent gone, and the clusters their
    kernels: :mod:`dtlab.lab.kernel.lifeline`). Without this, a ``dtlab lab`` ended by a
    signal left the server running, re-parented to init, with every kernel and
    cluster it held."""
    server = subprocess.Popen(cmd, env=env)
    stopping: list[float] = []

    def forward(signum, frame):
        if not stopping:
            stopping.append(time.monotonic())
            name = signal.Signals(signum).name
            print(f"dtlab lab: {name}: stopping JupyterLab", file=sys.stderr)
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        while True:
            try:
                return server.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                if stopping and time.monotonic() > stopping[0] + grace:
                    server.kill()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _info(args) -> int:
    import torch

    from dtlab.launch import max_cpu_world_size

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}")
    print(f"GPUs: {gpus}" + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""))
    print(f"default backend: {'nccl' if gpus else 'gloo'}")
    print(f"CPU engines this machine can run: up to {max_cpu_world_size()}")
    return 0


def bench_main(argv=None) -> int:
    """``dtlab bench [PART ...] [--quick] [--steps N] [--json PATH] [--plot P.png]``:
    run the parts (all of :data:`dtlab.bench.PARTS` by default), print one table,
    write its JSON (and a picture of it)."""
    import json

    from dtlab import bench

    p = argparse.ArgumentParser(
        prog="dtlab bench",
        description="Every comparison in one run: dtlab against PyTorch's own DDP, "
        "ZeroRedundancyOptimizer, FSDP2, DTensor TP and pipelining, and "
        "measurements against dtlab.estimate; one table.",
    )
    p.add_argument(
        "parts", nargs="*", metavar="PART",
        help=f"parts to run (default: all of {', '.join(bench.PARTS)})",
    )  # fmt: skip
    p.add_argument("--only", default=None, help="the same, comma-separated")
    p.add_argument("--quick", action="store_true", help="a small, fast run")
    p.add_argument("--steps", type=int, default=None, help="timed steps per part")
    p.add_argument("--out", default=".", help="folder for bench.json (default: .)")
    p.add_argument("--json", default=None, help="JSON path (default: OUT/bench.json)")
    p.add_argument("--plot", default=None, help="draw the table into this PNG")
    a = p.parse_args(argv)
    parts = list(a.parts)
    if a.only:
        parts += [x.strip() for x in a.only.split(",") if x.strip()]
    parts = parts or list(bench.PARTS)
    unknown = [x for x in parts if x not in bench.PARTS]
    if unknown:
        print(f"dtlab bench: unknown part(s) {unknown}: choose from "
              f"{', '.join(bench.PARTS)}", file=sys.stderr)  # fmt: skip
        return 2
    if a.steps is not None and a.steps < 1:
        print(f"dtlab bench: --steps must be >= 1, got {a.steps}", file=sys.stderr)
        return 2
    if a.plot and not a.plot.endswith(".png"):
        print("dtlab bench: --plot writes a PNG: give a path ending in .png",
              file=sys.stderr)  # fmt: skip
        return 2
    collected = bench.collect(a.quick, parts, steps=a.steps)
    rep = bench.report(collected)
    print(bench.format_table(rep["rows"]))
    path = a.json or os.path.join(a.out, "bench.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=1)
    print(f"wrote {path}")
    if a.plot:
        from dtlab.lab.figures.bench import write_png

        print(f"wrote {write_png(rep['rows'], a.plot)}")
    failed = [k for k, v in collected["results"].items() if "error" in v]
    for k in failed:
        print(f"dtlab bench: part {k} failed:\n{collected['results'][k]['traceback']}",
              file=sys.stderr)  # fmt: skip
    return 1 if failed else 0


def parse_layout(text: str) -> dict[str, int]:
    """``"tp8,cp1,pp16,dp64"``, ``"tp8·pp16·dp64"`` or ``"dp=64 tp=8"`` ->
    ``{"tp": 8, "cp": 1, "pp": 16, "dp": 64}``."""
    import re

    found = re.findall(r"(dp|tp|pp|cp|ep)\s*=?\s*(\d+)", text)
    rest = re.sub(r"(dp|tp|pp|cp|ep)\s*=?\s*\d+|[\s,·x*]", "", text)
    if not found or rest:
        raise ValueError(
            f"--layout {text!r}: give degrees like tp8,pp16,dp64 (axes dp, tp, pp, "
            "cp, ep)"
        )
    out: dict[str, int] = {}
    for axis, n in found:
        if axis in out:
            raise ValueError(f"--layout {text!r} names {axis} twice")
        out[axis] = int(n)
    return out


def _dry_run_config(a):
    """``(config, world_size, stand-in or None)`` from ``dtlab plan --dry-run``'s
    options."""
    from dtlab import dryrun
    from dtlab.topology import Layout
    from dtlab.train import TrainConfig

    if a.config:
        from dtlab.run import load_config

        config = load_config(a.config, a.set)
        if a.layout:
            config = config.replace(layout=Layout(**parse_layout(a.layout)))
        if config.layout is None and a.world is None:
            raise ValueError("--config without a layout needs --world")
        return config, a.world or config.layout.world_size, None
    if a.set:
        raise ValueError("--set changes a --config file; give --config too")
    knobs = dict(strategy=a.strategy, precision=a.precision,
                 checkpointing=a.checkpointing, schedule=a.schedule)  # fmt: skip
    if a.layout is None and a.model == "405B":
        gpus = a.world or (16384 if a.context == "128k" else 8192)
        return dryrun.llama3_405b(a.context, gpus, **knobs)
    if a.layout is None:
        raise ValueError(f"--layout is needed for {a.model} (e.g. tp8,pp8,dp16)")
    layout = Layout(**parse_layout(a.layout))
    s = dryrun.stand_in(a.model, pp=layout.pp, seq_len=a.seq_len)
    m = a.microbatches or (layout.pp if layout.pp > 1 else 1)
    config = TrainConfig(
        model=s.model, layout=layout, strategy=a.strategy, precision=a.precision,
        steps=1, global_batch_size=layout.dp * m,
        microbatches=m if layout.pp > 1 else None, schedule=a.schedule,
        grad_accum_steps=1 if layout.pp > 1 else m,
        activation_checkpointing=a.checkpointing,
    )  # fmt: skip
    return config, a.world or layout.world_size, s


def plan_main(argv=None) -> int:
    """``dtlab plan MODEL-options [--dry-run ...]``: the planner's fastest layouts,
    or a dry run of one layout (one table)."""
    import json

    p = argparse.ArgumentParser(
        prog="dtlab plan",
        description="Which layouts fit (dtlab.estimate.plan), or with --dry-run "
        "dtlab's real parallelize and one step on a fake process group of the "
        "layout's world, each rank's bytes beside the estimate.",
    )
    p.add_argument("--model", default="405B", help="a published model (default 405B)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs to plan for (plan only)")
    p.add_argument("--global-batch", type=int, default=1024, help="plan only")
    p.add_argument("--dry-run", action="store_true", help="dry-run one layout")
    p.add_argument("--config", default=None, help="a TrainConfig JSON/TOML to dry-run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a --config field")  # fmt: skip
    p.add_argument("--layout", default=None, help="e.g. tp8,cp1,pp16,dp64")
    p.add_argument("--context", default="8k", choices=("8k", "128k"),
                   help="Llama 3 405B's published layout for this context "
                   "(without --layout)")  # fmt: skip
    p.add_argument("--world", type=int, default=None, help="world size (ranks)")
    p.add_argument("--rank", action="append", default=None,
                   help="rank(s) to dry-run, e.g. --rank 0 --rank 517 or 0,517 "
                   "(default: one per pipeline role)")  # fmt: skip
    p.add_argument("--strategy", default="zero2")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--checkpointing", default="none")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per rank")
    p.add_argument("--json", default=None, help="write the report's JSON here")
    a = p.parse_args(argv)
    try:
        if not a.dry_run:
            return _plan_table(a)
        from dtlab.dryrun import dry_run

        config, world, published = _dry_run_config(a)
        ranks = None
        if a.rank:
            ranks = [int(x) for item in a.rank for x in item.split(",") if x.strip()]
        report = dry_run(config, world, ranks, published=published,
                         timeout=a.timeout)  # fmt: skip
    except ValueError as exc:
        print(f"dtlab plan: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=1, default=str)
        print(f"wrote {a.json}")
    return 0


def _plan_table(a) -> int:
    from dtlab import estimate

    result = estimate.plan(a.model, n_gpus=a.gpus, global_batch=a.global_batch)
    print(f"{a.model} on {a.gpus} GPUs: {len(result.fits)} layouts fit, "
          f"{len(result.rejected)} do not")  # fmt: skip
    for row in result.fits[:5]:
        print(f"  {row.layout}  zero{row.zero_stage}  mb={row.micro_batch_size}  "
              f"{row.checkpointing:<9} step {row.step_s:.2f} s  "
              f"MFU {row.mfu:.0%}  {row.achieved_flops_per_gpu / 1e12:.0f} TFLOP/s  "
              f"{row.memory['total'] / 2**30:.1f} GiB")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `run` and the all-in-one `bench` parse their own options
    if argv[:1] == ["run"]:
        from dtlab.run import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["bench"]:
        return bench_main(argv[1:])
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="dtlab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    lab = sub.add_parser("lab", help="start JupyterLab on the chapter index")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--no-browser", action="store_true")
    lab.add_argument(
        "--token",
        default=None,
        help="fixed access token (default: Jupyter makes a random one)",
    )
    lab.add_argument(
        "--notebooks",
        default=str(default_notebooks()),
        help="folder of the chapters (default: ./notebooks)",
    )
    lab.set_defaults(func=_lab)

    info = sub.add_parser("info", help="what this machine offers")
    info.set_defaults(func=_info)

    sub.add_parser(
        "run",
        help="train a TrainConfig headless (torchrun or --nproc); see dtlab run -h",
        add_help=False,
    )
    sub.add_parser(
        "plan",
        help="layouts that fit (estimate.plan), or --dry-run one at its scale; "
        "see dtlab plan -h",
        add_help=False,
    )
    sub.add_parser(
        "bench",
        help="every comparison with PyTorch and the estimates in one table "
        "(dtlab bench [PART ...] [--quick] [--json P] [--plot P.png])",
        add_help=False,
    )

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

"""The ``dtlab`` command.

- ``dtlab lab``: JupyterLab on the chapter index, on 127.0.0.1, token on.
- ``dtlab info``: what this machine offers (backend, GPUs, CPU engines it can run).
- ``dtlab run CONFIG``: train a :class:`dtlab.train.TrainConfig` headless, under
  torchrun or on ``--nproc`` local processes (:mod:`dtlab.run`).
- ``dtlab bench``: every comparison with PyTorch's own implementations and with the
  estimates, in one run, one table (:mod:`dtlab.bench`);
  ``dtlab bench ddp|zero|tp|pp``: one technique against PyTorch's, its own table.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys


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
    return subprocess.call(cmd, env=env)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _info(args) -> int:
    import torch

    from dtlab.lab.cluster import max_cpu_world_size

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}")
    print(f"GPUs: {gpus}" + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""))
    print(f"default backend: {'nccl' if gpus else 'gloo'}")
    print(f"CPU engines this machine can run: up to {max_cpu_world_size()}")
    return 0


def _bench(args) -> int:
    if args.what == "ddp":
        from dtlab.train import bench, format_bench

        print(format_bench(bench("ddp")))
    elif args.what == "zero":
        from dtlab.zero import bench, format_bench

        print(format_bench(bench()))
    elif args.what == "tp":
        from dtlab.tensor_parallel import bench_main

        return bench_main(args.rest)
    elif args.what == "pp":
        from dtlab.pipeline import bench, format_bench

        print(format_bench(bench(p=args.p, steps=args.steps)))
    return 0


BENCH_PARTS = ("ddp", "zero", "tp", "pp")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `run` and the all-in-one `bench` parse their own options
    if argv[:1] == ["run"]:
        from dtlab.run import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in BENCH_PARTS):
        from dtlab.bench import main as bench_main

        return bench_main(argv[1:])
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
    bench = sub.add_parser(
        "bench",
        help="every comparison with PyTorch and the estimates in one table "
        "(dtlab bench [--quick] [--json P] [--plot P.png]), or one technique "
        "(dtlab bench ddp|zero|tp|pp)",
    )
    bench.add_argument("what", choices=BENCH_PARTS)
    bench.add_argument("--p", type=int, default=4, help="pp: pipeline stages")
    bench.add_argument("--steps", type=int, default=5, help="pp: steps to time")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="tp: its own options")
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    if args.command == "bench" and args.what != "tp" and args.rest:
        # only tp takes options of its own; elsewhere they are ours (or a typo)
        if {"-h", "--help"} & set(args.rest):
            bench.print_help()
            return 0
        parser.error(f"unrecognized arguments: {' '.join(args.rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

# ipyparallel profile "slurm": one engine per GPU across the nodes of a Slurm job.
#
# The controller runs on this machine (where the notebook runs: a login node or a
# node of an interactive allocation) and listens on its private interface only. The
# engines are one batch job of `world_size` tasks, each task one engine holding one
# GPU (`--gpus-per-task=1`), packed `DTLAB_GPUS_PER_NODE` tasks to a node; they
# connect back to the controller with the connection info Slurm passes on in their
# environment (`--export=ALL`).
#
# Settings come from the environment of the notebook's kernel:
#
#   DTLAB_CONTROLLER_IP  required. This machine's address on the network the compute
#                        nodes reach it by (never 0.0.0.0).
#   DTLAB_GPUS_PER_NODE  GPUs (= engines) per node (default 8).
#   DTLAB_CPUS_PER_GPU   CPU cores per engine (default 8).
#   DTLAB_SLURM_PARTITION, DTLAB_SLURM_ACCOUNT, DTLAB_SLURM_TIME (default 02:00:00):
#                        the usual sbatch options; partition and account may be empty.
#   DTLAB_REMOTE_PYTHON  the Python with dtlab installed on the nodes (default: this
#                        kernel's interpreter, the same path on a shared disk).
#   DTLAB_IFNAME         network interface for torch.distributed on the nodes.
#   DTLAB_STORE_DIR      a folder every host sees at the same path (shared disk):
#                        where the torch.distributed world meets (read by start()).
#
#   from dtlab.lab import start
#   cluster = start(world_size=16, profile_dir="cluster/slurm", backend="nccl")
#
# `cluster.stop()` cancels the job (scancel). The template is kept in this file, not
# beside it, because dtlab copies only a profile's *_config.py files.
import os
import sys

c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

_ip = os.environ.get("DTLAB_CONTROLLER_IP", "")
if not _ip or _ip in ("0.0.0.0", "*", "::"):
    raise ValueError(
        "cluster/slurm needs DTLAB_CONTROLLER_IP: this machine's private address, "
        f"which the compute nodes can reach (got {_ip!r})"
    )


def _positive(name: str, default: str) -> int:
    value = os.environ.get(name, default)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"cluster/slurm: {name} must be a positive integer, not {value!r}"
        )
    return int(value)


c.Cluster.controller_launcher_class = "local"
c.Cluster.controller_ip = _ip
c.Cluster.engine_launcher_class = "slurm"
# a queued job may wait: ipcluster's own wait for the engines (seconds); dtlab's
# start() waits `start_timeout` instead
c.Cluster.engine_timeout = 600

_partition = os.environ.get("DTLAB_SLURM_PARTITION", "")
_account = os.environ.get("DTLAB_SLURM_ACCOUNT", "")
c.SlurmEngineSetLauncher.namespace = {
    "gpus_per_node": _positive("DTLAB_GPUS_PER_NODE", "8"),
    "cpus_per_gpu": _positive("DTLAB_CPUS_PER_GPU", "8"),
    "time": os.environ.get("DTLAB_SLURM_TIME", "02:00:00"),
    "partition_line": f"#SBATCH --partition={_partition}" if _partition else "",
    "account_line": f"#SBATCH --account={_account}" if _account else "",
}
# {n} is the number of engines (dtlab's world_size); {program_and_args} is
# `python -m ipyparallel.engine ...`; {output_file} is in the profile's log folder.
c.SlurmEngineSetLauncher.batch_template = """#!/bin/bash
#SBATCH --job-name=dtlab-engines-{cluster_id}
#SBATCH --ntasks={n}
#SBATCH --ntasks-per-node={gpus_per_node}
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task={cpus_per_gpu}
#SBATCH --time={time}
#SBATCH --output={output_file}
#SBATCH --export=ALL
{partition_line}
{account_line}
# one task = one engine = one GPU; if any engine fails, the job ends
srun --kill-on-bad-exit=1 {program_and_args}
"""
# the batch script is written into the (private copy of the) profile folder, not
# into the notebook's working directory
c.SlurmEngineSetLauncher.batch_file_name = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "dtlab_engines.sbatch"
)

_python = os.environ.get("DTLAB_REMOTE_PYTHON", sys.executable)
# under dtlab's lifeline: an engine ends itself when the controller stops beating
# (the notebook's kernel is gone), even while busy in a collective
c.SlurmEngineSetLauncher.engine_cmd = [
    _python,
    "-m",
    "dtlab.lab.kernel.lifeline",
    "ipyparallel.engine",
]

_env = {"OMP_NUM_THREADS": "1"}
if os.environ.get("DTLAB_IFNAME"):
    _env["GLOO_SOCKET_IFNAME"] = _env["NCCL_SOCKET_IFNAME"] = os.environ["DTLAB_IFNAME"]
c.SlurmEngineSetLauncher.environment = _env

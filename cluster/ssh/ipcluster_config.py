# ipyparallel profile "ssh": one engine per GPU on several machines, started over ssh.
#
# The controller runs on this machine (the head node, where the notebook runs) and
# listens on its *private* interface only; every engine is started on a GPU host by
# `ssh HOST REMOTE_PYTHON -m ipyparallel.engine`, one per GPU, and connects back.
#
# Settings come from the environment of the notebook's kernel, so the file is used
# unedited (set them in a cell before `start(...)`, or export them before `make lab`):
#
#   DTLAB_SSH_HOSTS      required. The GPU hosts and how many GPUs each has:
#                        "gpu1=8,gpu2=8" (also "user@gpu1=8", "gpu1:2222=8" for an
#                        ssh port; a host without "=N" gets DTLAB_GPUS_PER_HOST).
#   DTLAB_GPUS_PER_HOST  GPUs of a host listed without "=N" (default 8).
#   DTLAB_CONTROLLER_IP  required. This machine's address on the private network the
#                        GPU hosts reach it by (never 0.0.0.0: the controller would
#                        listen on every interface).
#   DTLAB_REMOTE_PYTHON  the Python with dtlab installed on the GPU hosts (default:
#                        this kernel's interpreter, the same path on a shared disk).
#   DTLAB_IFNAME         network interface for torch.distributed on the GPU hosts
#                        (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), e.g. "ib0".
#   DTLAB_STORE_DIR      a folder every host sees at the same path (shared disk):
#                        where the torch.distributed world meets (read by start()).
#
#   from dtlab.lab import start
#   cluster = start(world_size=16, profile_dir="cluster/ssh", backend="nccl")
#
# Password-less ssh (keys or an agent) from this machine to every host is required:
# ssh runs in batch mode, so a password prompt fails at once instead of hanging.
import os
import sys

c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile


def _hosts(spec: str, default_gpus: int) -> dict[str, int]:
    """'gpu1=8,alice@gpu2:2222=4' -> {'gpu1': 8, 'alice@gpu2:2222': 4}."""
    hosts = {}
    for item in spec.replace(" ", ",").split(","):
        if not item:
            continue
        host, _, gpus = item.partition("=")
        if not host or (gpus and not (gpus.isdigit() and int(gpus) > 0)):
            raise ValueError(
                f"cluster/ssh: bad entry {item!r} in DTLAB_SSH_HOSTS; "
                "write HOST or HOST=GPUS, e.g. 'gpu1=8,gpu2=8'"
            )
        hosts[host] = int(gpus) if gpus else default_gpus
    return hosts


_spec = os.environ.get("DTLAB_SSH_HOSTS", "")
_ip = os.environ.get("DTLAB_CONTROLLER_IP", "")
if not _spec or not _ip:
    raise ValueError(
        "cluster/ssh needs DTLAB_SSH_HOSTS (e.g. 'gpu1=8,gpu2=8') and "
        "DTLAB_CONTROLLER_IP (this machine's private address) in the environment"
    )
if _ip in ("0.0.0.0", "*", "::"):
    raise ValueError(
        f"cluster/ssh: DTLAB_CONTROLLER_IP={_ip!r} would listen on every interface; "
        "give this machine's private address"
    )

c.Cluster.controller_launcher_class = "local"  # the controller stays on this machine
c.Cluster.controller_ip = _ip
c.Cluster.engine_launcher_class = "ssh"
c.Cluster.delay = 0.5

# one engine per GPU: {host: number of GPUs}
c.SSHEngineSetLauncher.engines = _hosts(
    _spec, int(os.environ.get("DTLAB_GPUS_PER_HOST", "8"))
)
c.SSHLauncher.remote_python = os.environ.get("DTLAB_REMOTE_PYTHON", sys.executable)
# each engine under dtlab's lifeline: it ends itself when the controller stops
# beating (the notebook's kernel is gone), even while busy in a collective
c.SSHEngineSetLauncher.engine_cmd = [
    c.SSHLauncher.remote_python,
    "-m",
    "dtlab.lab.kernel.lifeline",
    "ipyparallel.engine",
]
# fail fast: no password prompt, no minute-long wait for a host that is down
c.SSHLauncher.ssh_args = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
c.SSHLauncher.scp_args = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]

# The engines' environment (the profile's ipengine_config.py is not sent to the
# hosts, so engine settings travel here). One torch thread per engine, as locally;
# torch.distributed on the private network's interface when one is named.
_env = {"OMP_NUM_THREADS": "1"}
if os.environ.get("DTLAB_IFNAME"):
    _env["GLOO_SOCKET_IFNAME"] = _env["NCCL_SOCKET_IFNAME"] = os.environ["DTLAB_IFNAME"]
c.SSHEngineSetLauncher.environment = _env

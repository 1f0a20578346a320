"""The launch profiles in cluster/, checked as far as one machine allows.

No ssh host or Slurm scheduler is reachable here, so each multi-node profile is
loaded the way ipyparallel loads it, and its launchers are built and started with
only the final step (the ``ssh`` or ``sbatch`` call) replaced by a recorder: what is
checked is the command each host or batch job would receive. The torchrun launcher
is checked with ``bash -n``, its dry run, and one real two-process run on CPU.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
TORCHRUN = CLUSTER / "torchrun.sh"

SSH_ENV = {
    "DTLAB_SSH_HOSTS": "gpu-a=4, alice@gpu-b:2222=2",
    "DTLAB_CONTROLLER_IP": "10.1.0.1",
    "DTLAB_REMOTE_PYTHON": "/opt/dtlab/.venv/bin/python",
    "DTLAB_IFNAME": "ib0",
}
SLURM_ENV = {
    "DTLAB_CONTROLLER_IP": "10.1.0.1",
    "DTLAB_GPUS_PER_NODE": "8",
    "DTLAB_CPUS_PER_GPU": "6",
    "DTLAB_SLURM_PARTITION": "gpu",
    "DTLAB_SLURM_ACCOUNT": "proj42",
    "DTLAB_SLURM_TIME": "01:00:00",
    "DTLAB_REMOTE_PYTHON": "/opt/dtlab/.venv/bin/python",
    "DTLAB_IFNAME": "ib0",
}
_ALL_VARS = {*SSH_ENV, *SLURM_ENV, "DTLAB_GPUS_PER_HOST"}


def _load(profile: str, name: str, env: dict, monkeypatch):
    """A profile's config file, loaded by traitlets as ipyparallel loads it."""
    from traitlets.config.loader import PyFileConfigLoader

    for var in _ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return PyFileConfigLoader(
        f"{name}_config.py", path=str(CLUSTER / profile)
    ).load_config()


def _private_copy(profile: str, tmp_path) -> pathlib.Path:
    """What LabCluster(profile_dir=...) does: copy the *_config.py files to a
    private folder, where ipyparallel writes logs and keys."""
    private = tmp_path / "profile"
    private.mkdir()
    for path in (CLUSTER / profile).glob("*_config.py"):
        shutil.copy(path, private)
    return private


# ---- local ----------------------------------------------------------------------
def test_local_profile_is_loopback_only(monkeypatch):
    c = _load("local", "ipcluster", {}, monkeypatch)
    assert c.Cluster.controller_ip == "127.0.0.1"
    assert c.Cluster.engine_launcher_class == "local"
    ctl = _load("local", "ipcontroller", {}, monkeypatch)
    assert ctl.IPController.ip == "127.0.0.1" and ctl.HeartMonitor.period == 100
    assert ctl.HeartMonitor.max_heartmonitor_misses == 50  # dropped after 5 s


# ---- ssh ------------------------------------------------------------------------
def test_ssh_profile_settings(monkeypatch):
    c = _load("ssh", "ipcluster", SSH_ENV, monkeypatch)
    assert c.Cluster.controller_launcher_class == "local"
    assert c.Cluster.controller_ip == "10.1.0.1"  # the private interface, not 0.0.0.0
    assert c.Cluster.engine_launcher_class == "ssh"
    # one engine per GPU: {host: GPUs}; user@ and :port are ipyparallel's syntax
    assert c.SSHEngineSetLauncher.engines == {"gpu-a": 4, "alice@gpu-b:2222": 2}
    assert c.SSHLauncher.remote_python == "/opt/dtlab/.venv/bin/python"
    assert "BatchMode=yes" in c.SSHLauncher.ssh_args  # no password prompt can hang
    assert c.SSHEngineSetLauncher.environment == {
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    ctl = _load("ssh", "ipcontroller", SSH_ENV, monkeypatch)
    assert ctl.HeartMonitor.period == 1000
    # a host without "=N" gets DTLAB_GPUS_PER_HOST
    env = {**SSH_ENV, "DTLAB_SSH_HOSTS": "n1,n2=2", "DTLAB_GPUS_PER_HOST": "4"}
    c = _load("ssh", "ipcluster", env, monkeypatch)
    assert c.SSHEngineSetLauncher.engines == {"n1": 4, "n2": 2}


@pytest.mark.parametrize(
    "env, message",
    [
        ({"DTLAB_CONTROLLER_IP": "10.1.0.1"}, "DTLAB_SSH_HOSTS"),
        ({"DTLAB_SSH_HOSTS": "gpu-a=4"}, "DTLAB_CONTROLLER_IP"),
        ({**SSH_ENV, "DTLAB_CONTROLLER_IP": "0.0.0.0"}, "every interface"),
        ({**SSH_ENV, "DTLAB_SSH_HOSTS": "gpu-a=four"}, "HOST=GPUS"),
        ({**SSH_ENV, "DTLAB_SSH_HOSTS": "gpu-a=0"}, "HOST=GPUS"),
    ],
)
def test_ssh_profile_rejects_bad_settings(env, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        _load("ssh", "ipcluster", env, monkeypatch)


def _cluster(profile: str, env: dict, tmp_path, monkeypatch, n: int):
    ipp = pytest.importorskip("ipyparallel")
    for var in _ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    return ipp.Cluster(
        profile_dir=str(_private_copy(profile, tmp_path)),
        n=n,
        cluster_id="t1",
        log_level=40,
        shutdown_atexit=False,  # nothing is started for real
    )


def _engine_set(cluster):
    # as Cluster.start_engines builds it (without waiting for a controller)
    return cluster.engine_launcher_class(
        work_dir=".",
        parent=cluster,
        log=cluster.log,
        profile_dir=cluster.profile_dir,
        cluster_id=cluster.cluster_id,
        engine_set_id="1",
    )


def test_ssh_profile_controller_command(tmp_path, monkeypatch):
    from ipyparallel.cluster import launcher

    recorded = []
    monkeypatch.setattr(
        launcher.LocalControllerLauncher,
        "start",
        lambda self: recorded.append((self.args, self.get_env())),
    )
    cluster = _cluster("ssh", SSH_ENV, tmp_path, monkeypatch, n=6)
    assert cluster.controller_launcher_class is launcher.LocalControllerLauncher
    cluster.start_controller_sync()
    ((args, env),) = recorded
    assert args[1:3] == ["-m", "ipyparallel.controller"]
    assert "--ip=10.1.0.1" in args  # listens on the private interface only
    # the controller reads the profile's ipcontroller_config.py from this folder
    assert env["IPP_PROFILE_DIR"] == cluster.profile_dir


def test_ssh_profile_starts_one_engine_per_gpu_on_each_host(tmp_path, monkeypatch):
    from ipyparallel.cluster import launcher

    started = []

    def record(self, hostname=None, user=None, port=None):
        # SSHLauncher.start without the ssh calls: what each host would receive
        started.append(
            {
                "user": user,
                "host": hostname,
                "port": port,
                "command": self.program + self.program_args,
                "env": self.get_env(),
                "ssh": self.ssh_cmd + self.ssh_args,
                "sends_files": bool(self.to_send),
            }
        )

    monkeypatch.setattr(launcher.SSHEngineLauncher, "start", record)
    cluster = _cluster("ssh", SSH_ENV, tmp_path, monkeypatch, n=6)
    engines = _engine_set(cluster)
    assert isinstance(engines, launcher.SSHEngineSetLauncher)
    engines.start(6)
    assert [(e["user"], e["host"], e["port"]) for e in started] == [
        (None, "gpu-a", None)
    ] * 4 + [("alice", "gpu-b", "2222")] * 2
    for i, e in enumerate(started):
        python, dash_m, lifeline, module, *rest = e["command"]
        # under dtlab's lifeline: it follows the controller's heartbeat
        assert (python, dash_m, lifeline, module) == (
            "/opt/dtlab/.venv/bin/python",
            "-m",
            "dtlab.lab.kernel.lifeline",
            "ipyparallel.engine",
        )
        assert rest == []  # the cluster id and profile folder travel in the env
        assert e["env"]["IPP_CLUSTER_ID"] == "t1"
        assert (
            e["env"]["IPP_PROFILE_DIR"]
            == engines.launchers["gpu-a/0"].remote_profile_dir
        )
        assert e["env"]["GLOO_SOCKET_IFNAME"] == "ib0"
        assert e["env"]["NCCL_SOCKET_IFNAME"] == "ib0"
        assert e["env"]["OMP_NUM_THREADS"] == "1"
        assert e["ssh"][:1] == ["ssh"] and "BatchMode=yes" in e["ssh"]
        # the connection files go once to each host, with its first engine
        assert e["sends_files"] == (i in (0, 4))
    # world_size below the number of GPUs: `n` is an upper limit, hosts fill in order
    started.clear()
    _engine_set(cluster).start(3)
    assert [e["host"] for e in started] == ["gpu-a"] * 3


# ---- slurm ----------------------------------------------------------------------
def test_slurm_profile_settings(monkeypatch):
    c = _load("slurm", "ipcluster", SLURM_ENV, monkeypatch)
    assert c.Cluster.controller_launcher_class == "local"
    assert c.Cluster.controller_ip == "10.1.0.1"
    assert c.Cluster.engine_launcher_class == "slurm"
    ns = c.SlurmEngineSetLauncher.namespace
    assert ns["gpus_per_node"] == 8 and ns["cpus_per_gpu"] == 6
    assert "--gpus-per-task=1" in c.SlurmEngineSetLauncher.batch_template
    assert c.SlurmEngineSetLauncher.engine_cmd == [
        "/opt/dtlab/.venv/bin/python",
        "-m",
        "dtlab.lab.kernel.lifeline",
        "ipyparallel.engine",
    ]
    ctl = _load("slurm", "ipcontroller", SLURM_ENV, monkeypatch)
    assert ctl.HeartMonitor.period == 1000
    with pytest.raises(ValueError, match="DTLAB_CONTROLLER_IP"):
        _load("slurm", "ipcluster", {}, monkeypatch)
    with pytest.raises(ValueError, match="DTLAB_GPUS_PER_NODE"):
        _load(
            "slurm", "ipcluster", {**SLURM_ENV, "DTLAB_GPUS_PER_NODE": "0"}, monkeypatch
        )


def test_slurm_profile_submits_one_engine_per_gpu_across_nodes(tmp_path, monkeypatch):
    from ipyparallel.cluster import launcher

    cluster = _cluster("slurm", SLURM_ENV, tmp_path, monkeypatch, n=12)
    engines = _engine_set(cluster)
    assert isinstance(engines, launcher.SlurmEngineSetLauncher)
    calls = []

    def run(command, **kwargs):  # instead of running sbatch / scancel
        calls.append((command, kwargs.get("env")))
        return "Submitted batch job 4242\n" if command[0] == "sbatch" else ""

    monkeypatch.setattr(engines, "_run_command", run)
    assert engines.start(12) == "4242"
    (command, env), *_ = calls
    script = pathlib.Path(engines.batch_file)
    assert command == ["sbatch", str(script)]
    # the batch script lands in the private profile copy, not the working directory
    assert script.parent == pathlib.Path(cluster.profile_dir)
    text = script.read_text()
    for line in (
        "#SBATCH --ntasks=12",  # world_size engines ...
        "#SBATCH --ntasks-per-node=8",  # ... packed one per GPU on each node
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --cpus-per-task=6",
        "#SBATCH --time=01:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=dtlab-engines-t1",
    ):
        assert line in text.splitlines(), (line, text)
    srun = next(line for line in text.splitlines() if line.startswith("srun"))
    argv = shlex.split(srun)
    assert argv[:6] == [
        "srun",
        "--kill-on-bad-exit=1",
        "/opt/dtlab/.venv/bin/python",
        "-m",
        "dtlab.lab.kernel.lifeline",
        "ipyparallel.engine",
    ]
    assert env["IPP_CLUSTER_ID"] == "t1"  # with the profile folder, in the env
    subprocess.run(["bash", "-n", str(script)], check=True)
    # sbatch passes its environment on (--export=ALL): the engines' settings
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert env["OMP_NUM_THREADS"] == "1"
    # stopping the engines cancels the job
    engines.stop()
    assert calls[-1][0] == ["scancel", "4242"]


def test_slurm_profile_without_partition_or_account(tmp_path, monkeypatch):
    env = {"DTLAB_CONTROLLER_IP": "10.1.0.1"}
    cluster = _cluster("slurm", env, tmp_path, monkeypatch, n=4)
    engines = _engine_set(cluster)
    monkeypatch.setattr(engines, "_run_command", lambda c, **k: "Submitted batch job 7")
    engines.start(4)
    text = pathlib.Path(engines.batch_file).read_text()
    assert "--partition" not in text and "--account" not in text
    assert "#SBATCH --ntasks-per-node=8" in text and "#SBATCH --time=02:00:00" in text
    # this kernel's Python
    assert f"{sys.executable} -m dtlab.lab.kernel.lifeline ipyparallel.engine" in text
    subprocess.run(["bash", "-n", engines.batch_file], check=True)


# ---- torchrun -------------------------------------------------------------------
def _torchrun(*args, env=None, check=True):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env or {})
    out = subprocess.run(
        ["bash", str(TORCHRUN), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_torchrun_scripts_parse():
    for script in (TORCHRUN, CLUSTER / "slurm" / "torchrun.sbatch"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(TORCHRUN, os.X_OK)


def test_torchrun_single_node_dry_run():
    out = _torchrun("--dry-run", "--nproc", "4", "train.py", "--lr", "1e-3")
    argv = shlex.split(out.stdout)
    assert argv[0] == "GLOO_SOCKET_IFNAME=lo"  # one node: gloo on loopback
    assert argv[2:4] == ["-m", "torch.distributed.run"]
    assert argv[argv.index("--nproc-per-node") + 1] == "4"
    assert "--standalone" in argv and argv[argv.index("--nnodes") + 1] == "1"
    assert "--rdzv-endpoint" not in argv
    assert argv[-3:] == ["train.py", "--lr", "1e-3"]  # the script's own arguments


def test_torchrun_multi_node_dry_run():
    out = _torchrun(
        "--dry-run",
        "--nnodes",
        "2",
        "--rdzv",
        "10.1.0.1:29500",
        "--rdzv-id",
        "job7",
        "--ifname",
        "ib0",
        "--nproc",
        "8",
        "-m",
        "dtlab.cli",
        "run",
        "--config",
        "a b.toml",
    )
    argv = shlex.split(out.stdout)
    assert argv[:2] == ["GLOO_SOCKET_IFNAME=ib0", "NCCL_SOCKET_IFNAME=ib0"]
    assert "--standalone" not in argv
    for flag, value in [
        ("--nnodes", "2"),
        ("--nproc-per-node", "8"),
        ("--rdzv-backend", "c10d"),
        ("--rdzv-endpoint", "10.1.0.1:29500"),
        ("--rdzv-id", "job7"),
    ]:
        assert argv[argv.index(flag) + 1] == value, flag
    assert argv[-5:] == ["-m", "dtlab.cli", "run", "--config", "a b.toml"]


def test_torchrun_inside_slurm_finds_the_head_node(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    scontrol = fake / "scontrol"  # stands in for Slurm's, which expands the list
    scontrol.write_text(
        '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && echo gpu-a && echo gpu-b\n'
    )
    scontrol.chmod(0o755)
    env = {
        "PATH": f"{fake}:{os.environ['PATH']}",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
    }
    argv = shlex.split(_torchrun("--dry-run", "s.py", env=env).stdout)
    assert argv[argv.index("--nnodes") + 1] == "2"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "gpu-a:29500"
    assert argv[argv.index("--rdzv-id") + 1] == "4242"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2", "s.py"], "needs --rdzv"),
        (["--nnodes", "2", "--rdzv", "head", "s.py"], "HOST:PORT"),
        (["--nproc", "0", "s.py"], "positive integer"),
        (["--bogus", "s.py"], "unknown option"),
        ([], "give a script"),
    ],
)
def test_torchrun_rejects_bad_arguments(args, message):
    out = _torchrun("--dry-run", *args, check=False)
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.slow
def test_torchrun_runs_two_ranks_for_real(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch.distributed as dist

            from dtlab import launch

            launch.init_from_env(backend="gloo")
            x = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(x)
            print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum {x.item()}")
            dist.destroy_process_group()
            """
        )
    )
    out = _torchrun("--nproc", "2", str(script), env={"OMP_NUM_THREADS": "1"})
    # (the two processes share stdout, so their lines may interleave)
    found = sorted(re.findall(r"rank (\d)/(\d) sum ([\d.]+)", out.stdout))
    assert found == [("0", "2", "3.0"), ("1", "2", "3.0")], out.stdout + out.stderr

"""A second host on one machine: engines in a Linux network namespace with an
interface and a host name of their own (the ``cluster/netns`` profile).

Taught in chapter 01 (what changes when the ranks span machines), and what the
test of a world across hosts runs on (``tests/test_second_host.py``).

A network namespace has its own interfaces, addresses and loopback; joined to this
one by a veth pair (a virtual cable: one end here, one end there, each with its
address) it is, to the processes inside, another machine on a private network:
they reach the controller only at its address on the veth, not at 127.0.0.1, and
gloo's connections between the two sides cross the veth. With a UTS namespace of
its own the "machine" also has another host name, so dtlab treats its engines as
remote: rendezvous in the shared folder, gloo on ``DTLAB_IFNAME``, signals through
ipyparallel's controller, death seen by its heartbeat, and each engine following
the controller's heartbeat instead of the kernel's pid
(:mod:`dtlab.lab.kernel.lifeline`).

:class:`NamespaceEngineSetLauncher` is ipyparallel's local engine launcher with
one change: its first ``engines_here`` engines start here, the others as

    ip netns exec NAMESPACE unshare --uts sh -c 'hostname HOST && exec "$@"' ...

Making the namespace needs root (``ip netns add``); :func:`make` and
:func:`remove` do it.
"""

from __future__ import annotations

import os
import subprocess
import sys

from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Integer, Unicode

from dtlab.lab.kernel import lifeline


def enter(namespace: str, hostname: str) -> list[str]:
    """The command prefix that runs a command inside ``namespace`` as ``hostname``."""
    script = 'hostname "$0" && exec "$@"'
    inside = ["ip", "netns", "exec", namespace]
    return [*inside, "unshare", "--uts", "sh", "-c", script, hostname]


class NamespaceEngineLauncher(LocalEngineLauncher):
    """One engine, here or in its set's namespace (by its index in the set)."""

    def find_args(self):
        engines = self.parent
        here = engines.engines_here if engines.engines_here >= 0 else engines.n // 2
        inside = int(self.identifier) >= here
        # an engine "elsewhere" cannot see the kernel: it follows the controller
        cmd = lifeline.command(
            sys.executable,
            "ipyparallel.engine",
            owner=None if inside else os.getpid(),
            preload=True,
        )
        if inside:
            cmd = enter(engines.namespace, engines.hostname) + cmd
        return cmd + self.cluster_args + self.engine_args


class NamespaceEngineSetLauncher(LocalEngineSetLauncher):
    """``engines_here`` engines on this machine (default: half of them), the rest
    in ``namespace`` with host name ``hostname``."""

    launcher_class = NamespaceEngineLauncher
    namespace = Unicode(config=True, help="the network namespace (ip netns)")
    hostname = Unicode("dtlab-node-b", config=True, help="its engines' host name")
    engines_here = Integer(-1, config=True, help="engines here (-1: half)")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def make(namespace: str, ifname: str, here: str, there: str, prefix: int = 30):
    """Make ``namespace`` and a veth pair named ``ifname`` on both sides, with the
    addresses ``here`` (this side) and ``there`` (inside). Raises ``OSError`` (for
    instance without root) after undoing what it made."""
    _ip("netns", "add", namespace)
    try:
        _ip("link", "add", ifname, "type", "veth", "peer", "name", f"{ifname}p")
        _ip("link", "set", f"{ifname}p", "netns", namespace)
        _ip("-n", namespace, "link", "set", f"{ifname}p", "name", ifname)
        _ip("addr", "add", f"{here}/{prefix}", "dev", ifname)
        _ip("-n", namespace, "addr", "add", f"{there}/{prefix}", "dev", ifname)
        for side in ([], ["-n", namespace]):
            _ip(*side, "link", "set", ifname, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
    except OSError:
        remove(namespace, ifname)
        raise


def remove(namespace: str, ifname: str) -> None:
    """Remove ``namespace`` (its end of the pair goes with it) and this end."""
    for args in (("netns", "delete", namespace), ("link", "delete", ifname)):
        try:
            _ip(*args)
        except OSError:
            pass  # already gone

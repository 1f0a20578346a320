# ipyparallel profile "netns": two hosts on one machine. The first engines run here,
# the rest inside a Linux network namespace with its own interface, address and
# host name (dtlab.lab.kernel.netns), reached over a veth pair: a real second host
# as far as the controller, gloo and dtlab can tell. tests/test_second_host.py makes the
# namespace and uses this profile; the same settings suit a demonstration.
#
#   DTLAB_NETNS           required. The namespace (`ip netns add NAME`, as root).
#   DTLAB_NETNS_HOST      the host name of its engines (default dtlab-node-b).
#   DTLAB_NETNS_HERE      how many engines start on this machine (default half).
#   DTLAB_CONTROLLER_IP   required. This machine's address on the veth.
#   DTLAB_IFNAME          required. The veth's name, the same on both sides: gloo's
#                         interface (GLOO_SOCKET_IFNAME) on every engine.
#   DTLAB_STORE_DIR       a folder both sides see (any folder: they share the disk).
#
#   from dtlab.lab import start
#   cluster = start(world_size=4, profile_dir="cluster/netns", backend="gloo")
import os

c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

_missing = [
    v
    for v in ("DTLAB_NETNS", "DTLAB_CONTROLLER_IP", "DTLAB_IFNAME")
    if not os.environ.get(v)
]
if _missing:
    raise ValueError(f"cluster/netns needs {', '.join(_missing)} in the environment")

c.Cluster.controller_launcher_class = "local"  # the controller stays here ...
c.Cluster.controller_ip = os.environ["DTLAB_CONTROLLER_IP"]  # ... on the veth only
c.Cluster.engine_launcher_class = "dtlab.lab.kernel.netns.NamespaceEngineSetLauncher"
c.Cluster.delay = 0
c.NamespaceEngineSetLauncher.namespace = os.environ["DTLAB_NETNS"]
c.NamespaceEngineSetLauncher.hostname = os.environ.get(
    "DTLAB_NETNS_HOST", "dtlab-node-b"
)
if os.environ.get("DTLAB_NETNS_HERE"):
    c.NamespaceEngineSetLauncher.engines_here = int(os.environ["DTLAB_NETNS_HERE"])
c.NamespaceEngineSetLauncher.environment = {
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": os.environ["DTLAB_IFNAME"],
}

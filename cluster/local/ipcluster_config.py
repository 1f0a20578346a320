# ipyparallel profile "local": the default live cluster of dtlab.
# One machine; the controller and every engine on loopback; engines started as
# local processes. dtlab.lab.start() uses these same settings when no profile is
# given; pass profile_dir="cluster/local" to load this file explicitly.
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

c.Cluster.controller_ip = "127.0.0.1"  # nothing listens beyond loopback
c.Cluster.engine_launcher_class = "local"
c.Cluster.delay = 0  # no pause between engine launches
# dtlab.lab starts the engines beside the controller, not after it: they import
# torch meanwhile and then wait for its connection file (dtlab.lab.kernel.processes)
c.Cluster.send_engines_connection_env = False

# Controller settings for the "netns" profile: as the local profile's (its address
# comes from DTLAB_CONTROLLER_IP through ipcluster_config.py).
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

c.HeartMonitor.period = 100
c.HeartMonitor.max_heartmonitor_misses = 50  # an engine is dropped after 5 s

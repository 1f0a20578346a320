# Controller settings for the "slurm" profile. Its address (this machine's private
# interface) is set by ipcluster_config.py from DTLAB_CONTROLLER_IP.
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

# A dead engine is noticed after a few missed heartbeats; 1 s suits a network.
c.HeartMonitor.period = 1000

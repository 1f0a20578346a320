# Controller settings for the "ssh" profile. Its address (the head node's private
# interface) is set by ipcluster_config.py from DTLAB_CONTROLLER_IP.
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

# A dead engine is noticed after a few missed heartbeats. Over a network a 1 s period
# is gentler than the local profile's 500 ms; start-up takes a little longer.
c.HeartMonitor.period = 1000

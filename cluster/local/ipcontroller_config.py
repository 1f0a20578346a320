# Controller settings for the "local" profile.
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

c.IPController.ip = "127.0.0.1"
# The heartbeat period bounds engine registration (start-up ~2 s instead of ~6.5 s)
# and how soon a dead engine is noticed.
c.HeartMonitor.period = 500

# Controller settings for the "local" profile.
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads a profile

c.IPController.ip = "127.0.0.1"
# An engine is registered at its first answered heartbeat, so the period bounds
# start-up (measured: ~6.5 s at ipyparallel's 3 s default, ~2 s at 500 ms, 0.3-0.5 s
# less again at 100 ms). An engine is dropped after 50 missed beats: 5 s, the same
# as 10 beats of 500 ms.
c.HeartMonitor.period = 100
c.HeartMonitor.max_heartmonitor_misses = 50

# The controller of mlmkit's local clusters (loaded by ipcontroller from the private profile copy).
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads the profile

# The hub registers an engine once it has answered a heartbeat: up to two periods after the engine
# connected. ipyparallel's 3 s period made every start, and every replacement of an engine that
# died, wait 3-6 s for that; 0.25 s, with twelve times the misses allowed, keeps the 30 s an engine
# may go silent (a busy or stalled machine) before the hub counts it as dead. Each ping is one
# small message per engine, four times a second.
c.HeartMonitor.period = 250
c.HeartMonitor.max_heartmonitor_misses = 120

# The engines of mlmkit's local clusters (loaded by each engine from the private profile copy).
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads the profile

# The controller pings every second (ipcontroller_config.py) instead of every 3 s; an engine that
# hears nothing from it stops itself after this many checks (of 1.5 s each): about 3 minutes, as
# with ipyparallel's defaults (50 checks of 3.5 s).
c.IPEngine.max_heartbeat_misses = 120

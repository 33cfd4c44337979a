# The engines of mlmkit's local clusters (loaded by each engine from the private profile copy).
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads the profile

# The controller pings four times a second (ipcontroller_config.py) instead of every 3 s; an engine
# checks for the pings every 0.75 s (the period plus ipyparallel's 0.5 s) and stops itself after
# this many checks without one: about 3 minutes, as with ipyparallel's defaults (50 checks of 3.5 s).
c.IPEngine.max_heartbeat_misses = 240

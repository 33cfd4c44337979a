# mlmkit's default: controller and engines on this machine, listening on 127.0.0.1 only.
# Used by mlmkit.cluster.Cluster(profile="local"); the folder is copied to a private temporary
# profile directory, so nothing is written here.
c = get_config()  # noqa: F821 - provided by ipyparallel when it loads the profile

c.Cluster.engine_launcher_class = "local"
c.Cluster.controller_ip = "127.0.0.1"

# Engines started with mpiexec (one process per rank) on the hosts your MPI launcher knows about.
# The controller listens on all interfaces ON PURPOSE so that remote engines reach it.
c = get_config()  # noqa: F821

c.Cluster.engine_launcher_class = "mpi"
c.Cluster.controller_ip = "*"
c.MPIEngineSetLauncher.mpi_args = []   # e.g. ["--hostfile", "hosts.txt"]

# Engines started with mpiexec (one process per rank) on the hosts your MPI knows about:
# Cluster(topology=..., profile="mpi", scheduler_args=["--hostfile", "hosts.txt"]) (mpiexec options).
# Needs mpiexec and mpi4py (pip install 'mlmkit[mpi]'). The controller listens on this host's
# routable address (Cluster(controller_ip="127.0.0.1") when every engine runs on this host).
c = get_config()  # noqa: F821

c.Cluster.engine_launcher_class = "mpi"

# Engines as Slurm tasks, one GPU each: Cluster(topology=..., profile="slurm") from a notebook that
# runs on a login or interactive node of the same cluster. The controller must be reachable from the
# compute nodes, so it listens on every interface ON PURPOSE: use this only on a trusted network.
# Adapt partition, account and time limit to your site.
c = get_config()  # noqa: F821

c.Cluster.engine_launcher_class = "slurm"
c.Cluster.controller_ip = "*"
c.Cluster.controller_location = ""  # let ipyparallel publish this host's address

c.SlurmEngineSetLauncher.batch_template = """#!/bin/bash
#SBATCH --job-name=mlmkit-engines
#SBATCH --ntasks={n}
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
##SBATCH --partition=gpu
##SBATCH --account=myproject
srun {program_and_args}
"""

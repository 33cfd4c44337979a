# Engines as the tasks of one Slurm job: Cluster(topology=..., profile="slurm") from a notebook on a
# login or interactive node (or on the node itself). Nothing site-specific is fixed here: partition,
# account, time, GPUs and CPUs come from Cluster(..., scheduler_args=["--partition=gpu",
# "--gpus-per-task=1", ...]) (sbatch options). The controller listens on this host's routable address
# (Cluster(controller_ip="127.0.0.1") when the engines run on this host); the job file and its
# output live in the cluster's private folder.
c = get_config()  # noqa: F821

c.Cluster.engine_launcher_class = "slurm"

c.SlurmEngineSetLauncher.batch_template = """#!/bin/bash
#SBATCH --job-name=mlmkit-engines
#SBATCH --ntasks={n}
#SBATCH --export=ALL
#SBATCH --output={output_file}
srun {program_and_args}
"""

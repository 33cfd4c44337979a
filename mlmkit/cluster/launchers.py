"""ipyparallel launchers that keep their files in the cluster's private folder.

ipyparallel writes a batch system's job file into the current folder (its launchers get
``work_dir='.'``); these write it, and point the job's output, into the profile folder that
:class:`mlmkit.cluster.Cluster` owns (mode 0700, removed at shutdown), so a notebook's folder stays
clean and a failed start can show the job's output.
"""

from __future__ import annotations

import os

from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher

__all__ = ["PrivateMPIEngineSetLauncher", "PrivateSlurmEngineSetLauncher"]


class PrivateSlurmEngineSetLauncher(SlurmEngineSetLauncher):
    """Slurm engines whose job file and output live in the profile folder."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.work_dir = self.profile_dir
        self.batch_file = os.path.join(self.profile_dir, self.batch_file_name)


class PrivateMPIEngineSetLauncher(MPIEngineSetLauncher):
    """mpiexec engines started from the profile folder."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.work_dir = self.profile_dir

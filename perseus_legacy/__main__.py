"""`python -m perseus_legacy`: what this installation has, one section per line; never crashes."""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import platform
import sys
import traceback
from typing import Any, Callable


def _section(title: str, probe: Callable[[], Any]) -> None:
    try:
        result = probe()
    except Exception as exc:  # a failing probe is part of the report
        result = f"unavailable: {type(exc).__name__}: {exc}"
    if isinstance(result, dict):
        print(f"{title}:")
        for key, value in result.items():
            print(f"  {key}: {value}")
    else:
        print(f"{title}: {result}")
    sys.stdout.flush()


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


def _tf_ops() -> str:
    importlib.import_module("perseus_legacy.ops")._op_library()
    return "loaded into TensorFlow"


def _mpirun() -> str:
    launch = importlib.import_module("perseusrun.launch")
    return str(launch.find_mpirun(dict(os.environ)))


def _keras_integration() -> str:
    keras = importlib.import_module("perseus_legacy.keras")
    import tf_keras

    names = ", ".join(c for c in keras.callbacks.__all__ if c[0].isupper())
    return f"perseus_legacy.keras ready for tf-keras {tf_keras.__version__} (callbacks: {names})"


def _controllers() -> Any:
    info = importlib.import_module("perseus_legacy._core").build_info()
    return dict(info) if isinstance(info, dict) else info


def _tcp() -> str:
    info = importlib.import_module("perseus_legacy._core").build_info()
    built = "built" if info.get("tcp") else "not built"
    tf_config = importlib.import_module("perseus_legacy.tf_config")
    return f"{built}; init() here would use {tf_config.controller_from_env()}"


def _mpi() -> str:
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        mpi4py.rc.initialize = False  # the library version needs no MPI_Init
        mpi4py.rc.finalize = False
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]


def _nccl() -> str:
    candidates = ["libnccl.so.2"]
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(os.path.join(location, "lib", "libnccl.so.2"))
    except (ImportError, ValueError):
        pass
    errors = []
    for candidate in candidates:
        try:
            library = ctypes.CDLL(candidate)
        except OSError as exc:
            errors.append(str(exc))
            continue
        version = ctypes.c_int(0)
        if library.ncclGetVersion(ctypes.byref(version)) == 0:
            code = version.value
            return f"found {candidate} (version {code // 10000}.{code // 100 % 100}.{code % 100})"
        return f"found {candidate}"
    return "not found (" + "; ".join(errors) + ")"


def _estimator_compat() -> Any:
    estimator = importlib.import_module("perseus_legacy.estimator")
    report = getattr(estimator, "compat_report", None)
    if report is None:
        return "perseus_legacy.estimator has no compat_report()"
    return report()


def main() -> int:
    """Prints the diagnostics report; returns 0 even when parts are missing."""
    for title, probe in (
        ("perseus_legacy", _version),
        ("Python", _python),
        ("TensorFlow", _tensorflow),
        ("tf.keras", _keras),
        ("native core", _core),
        ("TensorFlow ops", _tf_ops),
        ("controllers built", _controllers),
        ("TCP controller", _tcp),
        ("MPI library", _mpi),
        ("mpirun (perseusrun uses)", _mpirun),
        ("NCCL", _nccl),
        ("estimator compat", _estimator_compat),
        ("Keras integration", _keras_integration),
    ):
        try:
            _section(title, probe)
        except Exception:  # even printing a result must not end the report
            print(f"{title}: report failed:\n{traceback.format_exc()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tf.estimator on any TensorFlow: the real tensorflow-estimator 2.15 package.

`from perseus_legacy import estimator as tf_estimator` gives the tf.estimator API (Estimator,
EstimatorSpec, ModeKeys, RunConfig, TrainSpec, EvalSpec, train_and_evaluate, exporters, canned
estimators, export, ...) on every TensorFlow version. On TensorFlow >= 2.16, importing this
package also supplies the TensorFlow internals tensorflow-estimator needs and makes it reachable
as tf.estimator again (see compat_report()).
"""

# Order matters: legacy Keras must be selected before anything imports tensorflow.
from perseus_legacy.estimator import _keras  # noqa: I001

_keras.select_legacy_keras()

import importlib  # noqa: E402
from typing import Any  # noqa: E402

from perseus_legacy.estimator import _compat  # noqa: E402
from perseus_legacy.estimator._compat import TPUUnavailableError, compat_report  # noqa: E402, F401
from perseus_legacy.estimator._keras import Keras3AlreadyBoundError  # noqa: E402, F401

if _keras.tensorflow_version() is not None:  # the native collectives work without TensorFlow
    _compat.apply()


def estimator_hooks() -> list:
    """Training hooks equal to what perseus_legacy.run_config() applies (never applied twice)."""
    from perseus_legacy.estimator import _distributed

    return _distributed.estimator_hooks()


def _api() -> Any:
    return importlib.import_module(_compat.API_V2)


def __getattr__(name: str) -> Any:
    """The tf.estimator (v2) API, imported on first use: `import perseus_legacy` stays light."""
    if name.startswith("__"):
        raise AttributeError(name)
    _keras.require_legacy_keras()
    try:
        value = getattr(_api(), name)
    except AttributeError:
        raise AttributeError(
            f"module 'perseus_legacy.estimator' has no attribute {name!r} "
            "(it re-exports the tf.estimator API)") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    own = {"compat_report", "TPUUnavailableError", "Keras3AlreadyBoundError", "estimator_hooks"}
    return sorted(own | {n for n in dir(_api()) if not n.startswith("_")})

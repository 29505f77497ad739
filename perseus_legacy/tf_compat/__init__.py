"""Every change perseus_legacy makes to TensorFlow, all made once by `import perseus_legacy`.

| patch                                   | module          | made necessary by            |
|-----------------------------------------|-----------------|------------------------------|
| legacy Keras (TF_USE_LEGACY_KERAS=1)    | keras           | TF 2.16 (tf.keras = Keras 3) |
| distribute.estimator_training stand-in  | estimator_api   | TF 2.16 (tf.estimator gone)  |
| tf_export's `estimator` API name        | estimator_api   | TF 2.16                      |
| three tensorflow.python.tpu modules     | estimator_api   | TF 2.16                      |
| tf.estimator, tf.compat.v1/v2.estimator | estimator_api   | TF 2.16                      |
| tensorflow.python.estimator.*           | estimator_api   | TF 2.16                      |
| auto_control_deps.ASYNC_STATEFUL_OPS    | control_deps    | every TF 2 (tf.function)     |

The estimator pieces are feature-detected (supplied only where TensorFlow lacks them); the
Keras choice is a version check, made before TensorFlow is imported. `compat_report()` lists
what was done; `PERSEUS_NO_TF_PATCH=1` turns every patch off (then tf.estimator does not import
on TF >= 2.16, and the collectives of one tf.function run in program order).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os

from perseus_legacy.tf_compat import control_deps, estimator_api, keras
from perseus_legacy.tf_compat.estimator_api import TPUUnavailableError  # noqa: F401
from perseus_legacy.tf_compat.keras import Keras3AlreadyBoundError  # noqa: F401

NO_TF_PATCH_ENV = "PERSEUS_NO_TF_PATCH"
LEFT_ALONE = f"left alone ({NO_TF_PATCH_ENV}=1)"
TF_NAMESPACE = "tf.estimator, tf.compat.v1.estimator, tf.compat.v2.estimator"

# The patches made after TensorFlow is imported, in order: report name -> function that makes it
# (where needed) and returns what it did.
_PATCHES = (
    ("tensorflow.python.distribute.estimator_training", estimator_api.supply_estimator_training),
    ("tf_export.ESTIMATOR_API_NAME", estimator_api.supply_estimator_api_name),
    *((f"tensorflow.python.tpu.{name}", functools.partial(estimator_api.supply_tpu_module, name))
      for name in estimator_api.TPU_MODULES),
    (TF_NAMESPACE, estimator_api.expose_tf_estimator),
    ("tensorflow.python.estimator", estimator_api.alias_python_estimator),
    ("auto_control_deps.ASYNC_STATEFUL_OPS",
     control_deps.exempt_collectives_from_program_order),
)

_pieces: dict[str, str] = {}


def patches_disabled() -> bool:
    """Whether PERSEUS_NO_TF_PATCH turns every patch off."""
    return os.environ.get(NO_TF_PATCH_ENV, "").lower() in ("1", "true", "yes", "on")


def apply() -> dict[str, str]:
    """Makes every patch, once (the Keras choice before TensorFlow is imported); returns them."""
    if _pieces:
        return dict(_pieces)
    disabled = patches_disabled()
    keras.select_legacy_keras(left_alone=LEFT_ALONE if disabled else None)
    if keras.tensorflow_version() is None:  # the native collectives work without TensorFlow
        return {}
    for name, patch in _PATCHES:
        _pieces[name] = LEFT_ALONE if disabled else patch()
    return dict(_pieces)


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def compat_report() -> dict[str, str]:
    """What perseus_legacy found and changed in this TensorFlow, one line per patch."""
    if keras.tensorflow_version() is None:
        return {"tensorflow": "not installed"}
    import tensorflow as tf

    pieces = apply()
    return {
        "tensorflow": tf.__version__,
        "tensorflow-estimator": _distribution_version("tensorflow-estimator"),
        "tf-keras": _distribution_version("tf-keras"),
        "legacy keras": keras.decision,
        **pieces,
    }

"""Which Keras perseus_legacy.keras works with: Keras 2, as tf-keras or as TensorFlow's own.

TensorFlow < 2.16: `tf.keras` is Keras 2 (tf-keras need not be installed). TensorFlow >= 2.16:
tf-keras (`import tf_keras`; `tf.keras` too when perseus_legacy was imported first). Optimizers
of either Keras 2 are accepted where both are installed.
"""

from __future__ import annotations

import importlib

import tensorflow as tf

from perseus_legacy.tf_compat.keras import tensorflow_version


def _keras_modules() -> list:
    modules = []
    if tensorflow_version() is not None and tensorflow_version() < (2, 16):
        modules.append(tf.keras)
    try:
        modules.append(importlib.import_module("tf_keras"))
    except ImportError:
        if not modules:
            raise ImportError(
                f"perseus_legacy.keras needs Keras 2: on TensorFlow {tf.__version__}, install "
                "tf-keras (`pip install tf-keras`)") from None
    return modules


MODULES = _keras_modules()
keras = MODULES[0]  # models, layers and callbacks are built from this one
OPTIMIZER_CLASSES = tuple(cls for module in MODULES
                          for cls in (module.optimizers.Optimizer,
                                      module.optimizers.legacy.Optimizer))
LEGACY_OPTIMIZER_CLASSES = tuple(module.optimizers.legacy.Optimizer for module in MODULES)

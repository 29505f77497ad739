"""Patch: legacy Keras (tf-keras) for Estimator code, chosen before TensorFlow binds tf.keras.

Made necessary by TensorFlow 2.16, which binds tf.keras to Keras 3. It is decided by the
TensorFlow *version* (read from package metadata, before TensorFlow is imported), not detected
from a feature: the feature can only be seen after the import, when it is too late. TensorFlow
>= 2.16 reads TF_USE_LEGACY_KERAS once, while `import tensorflow` runs, and binds
tf.keras to Keras 3 unless it is set. tensorflow-estimator's heads, canned estimators and
optimizers are written against Keras 2, so the variable has to be set before TensorFlow is first
imported. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys

# Marks a TF_USE_LEGACY_KERAS this process set itself (perseusrun must not pass it on to programs
# that may run another TensorFlow).
from perseus_env import LEGACY_KERAS_SET_HERE as _SET_HERE

ENV = "TF_USE_LEGACY_KERAS"
_TRUE = ("true", "True", "1")  # the spellings TensorFlow accepts
_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
                     "tensorflow-macos", "tf-nightly", "tf-nightly-cpu")

# What select_legacy_keras() decided, for compat_report(); the error the Estimator API raises.
decision = "not decided yet"
_bound_error: str | None = None


class Keras3AlreadyBoundError(ImportError):
    """TensorFlow >= 2.16 was imported before perseus_legacy and bound tf.keras to Keras 3."""


@functools.cache
def tensorflow_version() -> tuple[int, int] | None:
    """(major, minor) of the installed TensorFlow, without importing it; None if not found."""
    tf = sys.modules.get("tensorflow")
    text = getattr(tf, "__version__", None)
    if text is None:
        names = _TF_DISTRIBUTIONS + tuple(
            importlib.metadata.packages_distributions().get("tensorflow", ()))
        for name in names:
            try:
                text = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if text is None:
        return None
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _tf_bound_keras3(tf) -> bool:
    if getattr(tf, "_tf_uses_legacy_keras", None) is False:
        return True
    loader = vars(tf).get("keras")
    return getattr(loader, "_tfll_keras_version", None) == "keras_3"


def select_legacy_keras(left_alone: str | None = None) -> str:
    """Sets TF_USE_LEGACY_KERAS=1 on TF >= 2.16 when tf-keras is installed; says what it did.

    `left_alone` (the reason, when patches are off) decides nothing and records the reason.

    If TensorFlow was already imported with Keras 3, nothing can be selected any more; the
    Estimator API then raises Keras3AlreadyBoundError on first use (require_legacy_keras), while
    the rest of perseus_legacy (the collectives) keeps working.
    """
    global decision, _bound_error
    version = tensorflow_version()
    requested = os.environ.get(ENV)
    if left_alone is not None:
        decision = left_alone
    elif version is None or version < (2, 16):
        decision = "not needed: this TensorFlow's tf.keras is Keras 2"
    elif requested is not None and requested not in _TRUE:
        decision = f"left as {ENV}={requested} (Keras 3): canned estimators and heads need tf-keras"
    elif importlib.util.find_spec("tf_keras") is None:
        decision = "tf-keras is not installed: tf.keras is Keras 3 (pip install tf-keras)"
    elif "tensorflow" in sys.modules and _tf_bound_keras3(sys.modules["tensorflow"]):
        tf_version = sys.modules["tensorflow"].__version__
        decision = (f"too late: TensorFlow {tf_version} was imported first and bound tf.keras to "
                    "Keras 3; the Estimator API raises Keras3AlreadyBoundError")
        _bound_error = (
            f"perseus_legacy: TensorFlow {tf_version} was imported before perseus_legacy and "
            "bound tf.keras to Keras 3, but Estimator code needs legacy Keras (tf-keras). Either "
            "put `import perseus_legacy` before any tensorflow/keras import, or start Python "
            f"with {ENV}=1 in the environment.")
    elif requested is None:
        os.environ[ENV] = "1"
        os.environ[_SET_HERE] = "1"
        decision = f"selected: {ENV}=1 set by perseus_legacy (tf-keras)"
    else:
        decision = f"selected: {ENV}={requested} set by the user (tf-keras)"
    return decision


def require_legacy_keras() -> None:
    """Raises Keras3AlreadyBoundError if TensorFlow bound Keras 3 before legacy Keras was chosen."""
    if _bound_error is not None:
        raise Keras3AlreadyBoundError(_bound_error)


SESSION_FUNCTIONS = ("set_session", "get_session")


def supply_keras_sessions() -> str:
    """`tf.keras.backend.set_session`/`get_session` for TF1-style Keras code, where missing.

    TensorFlow 2.0 left them out of the v2 `tf.keras.backend`; only `tf.compat.v1.keras.backend`
    kept them (also tf-keras', on TF >= 2.16). Code written for TF 1.x Keras pins its GPU with
    `K.set_session(tf.compat.v1.Session(config=config))` after `from tensorflow.keras import
    backend as K`: the v2 backend gets the v1 backend's two functions, the same objects (the
    same global session). Nothing is done where tf.keras is Keras 3 (it has no sessions).
    """
    import tensorflow as tf

    version = tensorflow_version()
    if version is not None and version >= (2, 16) and os.environ.get(ENV) not in _TRUE:
        return "not applicable: tf.keras is Keras 3, which has no sessions"
    v1, v2 = tf.compat.v1.keras.backend, tf.keras.backend
    missing = [name for name in SESSION_FUNCTIONS if not hasattr(v2, name)]
    if not all(hasattr(v1, name) for name in SESSION_FUNCTIONS):
        return f"not supplied: {v1.__name__} has no set_session/get_session either"
    for name in missing:
        setattr(v2, name, getattr(v1, name))
    if not missing:
        return "not needed: tf.keras.backend has set_session/get_session"
    return f"supplied: tf.keras.backend.{'/'.join(missing)} from tf.compat.v1.keras.backend"

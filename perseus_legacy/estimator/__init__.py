"""The distributed Estimator: `run_config()`, and the tf.estimator API on every TensorFlow.

`run_config()` returns a RunConfig that trains one unchanged Estimator on every rank
(`_run_config.py` makes it, `_training.py` holds the Estimator internals it acts through).
`from perseus_legacy import estimator as tf_estimator` also gives the tf.estimator API
(Estimator, EstimatorSpec, ModeKeys, RunConfig, TrainSpec, EvalSpec, train_and_evaluate,
exporters, canned estimators, export, ...): the real tensorflow-estimator 2.15 package, which
perseus_legacy.tf_compat makes importable on TensorFlow >= 2.16.
"""

from __future__ import annotations

import importlib
from typing import Any

from perseus_legacy import tf_compat as _tf_compat
from perseus_legacy.tf_compat import (  # noqa: F401
    Keras3AlreadyBoundError,
    TPUUnavailableError,
    compat_report,
)
from perseus_legacy.tf_compat import estimator_api as _estimator_api
from perseus_legacy.tf_compat import keras as _keras


def run_config(evaluator_timeout_secs: float | None = None, **kwargs: Any) -> Any:
    """A tf.estimator.RunConfig (same keyword arguments) that trains an Estimator on every rank.

    An Estimator given it averages gradients, starts every rank from rank 0's variables and
    step, and evaluates on rank 0 in train_and_evaluate, without any hooks. Rank 0 writes
    checkpoints and summaries into `model_dir`, evaluates and logs. Every other rank gets a
    private temporary model_dir, removed at exit, and writes nothing: no checkpoints, no
    summaries, and TensorFlow's INFO logs are dropped there unless PERSEUS_LOG_ALL_RANKS=1.
    `session_config` gets session_config() (this rank's GPU); `tf_random_seed` is kept as given.
    perseus_legacy.init() runs first if it has not. The TF_CONFIG evaluator task joins no group.

    Args:
      evaluator_timeout_secs: the TF_CONFIG evaluator fails when no new checkpoint appears in
        `model_dir` for this long (default: PERSEUS_EVALUATOR_TIMEOUT_SECS, else 1800; 0: no
        limit).
      **kwargs: tf.estimator.RunConfig's keyword arguments (`model_dir`, `session_config`,
        `tf_random_seed`, `save_checkpoints_steps`, ...), changed on ranks other than 0 as
        above.

    Returns:
      A DistributedRunConfig (a tf.estimator.RunConfig) for this process.

    Raises:
      ImportError: tf.estimator cannot be imported here (Keras 3 bound first, or
        PERSEUS_NO_TF_PATCH=1 on TensorFlow >= 2.16).
      ValueError: a negative `evaluator_timeout_secs` (or PERSEUS_EVALUATOR_TIMEOUT_SECS).
    """
    _require_estimator()
    from perseus_legacy.estimator import _run_config, _training

    _tf_compat.wrap_estimator(_training.WRAPPERS)
    return _run_config.distributed_run_config(evaluator_timeout_secs, **kwargs)


def estimator_hooks() -> list:
    """The training hooks that `run_config()` already applies: `[SyncReplicasHook()]`.

    Passing them to `train()` too applies nothing twice. With any other RunConfig they make
    the training synchronous (gradient averaging, rank 0's variables broadcast at the start),
    but ranks do not agree on the start step, and every rank writes into its model_dir.
    """
    from perseus_legacy.tf1.hooks import SyncReplicasHook

    return [SyncReplicasHook()]


def _require_estimator() -> None:
    """Raises the reason why tf.estimator cannot be imported here, if there is one."""
    _keras.require_legacy_keras()
    version = _keras.tensorflow_version()
    if _tf_compat.patches_disabled() and version is not None and version >= (2, 16):
        raise ImportError(
            f"tf.estimator on TensorFlow {version[0]}.{version[1]} needs perseus_legacy's "
            f"TensorFlow patches, and {_tf_compat.NO_TF_PATCH_ENV}=1 turned them off: unset it "
            "to use the Estimator API (the collectives, hooks and Keras work either way)")


def __getattr__(name: str) -> Any:
    """The tf.estimator (v2) API, imported on first use: `import perseus_legacy` stays light."""
    if name.startswith("__"):
        raise AttributeError(name)
    _require_estimator()
    try:
        value = getattr(importlib.import_module(_estimator_api.API_V2), name)
    except AttributeError:
        raise AttributeError(
            f"module 'perseus_legacy.estimator' has no attribute {name!r} "
            "(it re-exports the tf.estimator API)") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    own = {"compat_report", "TPUUnavailableError", "Keras3AlreadyBoundError", "estimator_hooks",
           "run_config"}
    _require_estimator()
    api = importlib.import_module(_estimator_api.API_V2)
    return sorted(own | {n for n in dir(api) if not n.startswith("_")})

"""Stand-in for tensorflow.python.distribute.estimator_training, which TensorFlow 2.16 removed.

tensorflow-estimator calls into it from RunConfig, Estimator.train/evaluate and
train_and_evaluate. The distribute coordinator it drove is gone, so no run is ever
coordinator-driven: RunConfig parses TF_CONFIG itself, as it does without a strategy.
"""

from __future__ import annotations

from typing import Any


def init_run_config(config: Any, tf_config: dict) -> None:
    """RunConfig with train/eval_distribute: the cluster comes from TF_CONFIG, as without one."""
    # pylint: disable=protected-access
    if getattr(config, "_experimental_distribute", None) is not None:
        raise ValueError(
            "RunConfig(experimental_distribute=...) configured the distribute coordinator, which "
            "TensorFlow 2.16 removed; pass train_distribute= / eval_distribute= instead.")
    config._distribute_coordinator_mode = None
    config._init_distributed_setting_from_environment_var(tf_config)
    config._maybe_overwrite_session_config_for_distributed_training()


def should_run_distribute_coordinator(config: Any) -> bool:
    """Never: the coordinator does not exist on this TensorFlow."""
    return False


def _coordinator_removed(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "the distribute coordinator (estimator_training) was removed in TensorFlow 2.16; "
        "RunConfig._distribute_coordinator_mode must stay None on this TensorFlow")


train_and_evaluate = estimator_train = estimator_evaluate = _coordinator_removed

"""The RunConfig of `run_config()`, and which rank of distributed Estimator training this is.

Under TF_CONFIG the ranks' RunConfig is a local one (tf.estimator then starts no TF server and no
parameter-server training): TF_CONFIG only forms the process group (perseus_legacy.init()). The
evaluator's RunConfig is tf.estimator's own evaluator config, so its evaluation loop runs. Both
read the one Cluster that perseus_legacy.common.tf_config parsed from TF_CONFIG.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import shutil
import tempfile
from typing import Any

import tensorflow as tf

import perseus_env
from perseus_legacy.common import basics, tf_config
from perseus_legacy.tf1 import config, survivor
from perseus_legacy.tf_compat import estimator_api

LOG_ALL_RANKS_ENV = "PERSEUS_LOG_ALL_RANKS"
EVALUATOR_TIMEOUT_ENV = "PERSEUS_EVALUATOR_TIMEOUT_SECS"
DEFAULT_EVALUATOR_TIMEOUT_SECS = 1800.0

_run_config_lib = importlib.import_module(estimator_api.PACKAGE + ".run_config")


def cluster_role() -> tf_config.Cluster:
    """This process's place in distributed Estimator training (initialising perseus_legacy when
    needed): the TF_CONFIG evaluator's Cluster (no rank), else this rank of the group."""
    cluster = tf_config.current_cluster()
    if cluster is not None and not cluster.is_rank:
        return cluster
    if not basics.is_initialized():
        basics.init()
    return tf_config.Cluster(basics.rank(), cluster.addresses if cluster is not None else (),
                             size=basics.size(),
                             has_evaluator=cluster is not None and cluster.has_evaluator)


class DistributedRunConfig(_run_config_lib.RunConfig):
    """The RunConfig of `run_config()`: an Estimator given it trains on every rank together."""

    _perseus_evaluator_timeout_secs = DEFAULT_EVALUATOR_TIMEOUT_SECS

    @property
    def evaluator_timeout_secs(self) -> float:
        """Seconds the TF_CONFIG evaluator waits for a new checkpoint before failing (0: ever)."""
        return self._perseus_evaluator_timeout_secs

    def _init_distributed_setting_from_environment_var(self, tf_config_dict: dict) -> None:
        # Called by RunConfig.__init__ with TF_CONFIG. A rank gets a local config; the evaluator
        # gets tf.estimator's evaluator config, its cluster spelt with a chief (TF requires one).
        if tf_config_dict.get("cluster"):
            cluster = tf_config.current_cluster()
            tf_config_dict = {k: v for k, v in tf_config_dict.items()
                              if k not in ("cluster", "task")}
            if cluster is not None and not cluster.is_rank:
                jobs = {"chief": list(cluster.addresses[:1])}
                if cluster.size > 1:
                    jobs["worker"] = list(cluster.addresses[1:])
                tf_config_dict.update(cluster=jobs, task={"type": "evaluator", "index": 0})
        super()._init_distributed_setting_from_environment_var(tf_config_dict)


def _evaluator_timeout(given: float | None) -> float:
    if given is None:
        return perseus_env.read_seconds(EVALUATOR_TIMEOUT_ENV, DEFAULT_EVALUATOR_TIMEOUT_SECS)
    if not given >= 0:
        raise ValueError(f"run_config(evaluator_timeout_secs={given!r}): expected seconds >= 0 "
                         "(0: wait for checkpoints forever)")
    return float(given)


def _private_model_dir(rank: int) -> str:
    path = tempfile.mkdtemp(prefix=f"perseus_model_dir_rank{rank}_")
    atexit.register(shutil.rmtree, path, True)
    return path


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


_QUIET = _WarningsOnly()


def distributed_run_config(evaluator_timeout_secs: float | None,
                           **kwargs: Any) -> DistributedRunConfig:
    """perseus_legacy.run_config()'s RunConfig (see its docstring)."""
    timeout = _evaluator_timeout(evaluator_timeout_secs)
    role = cluster_role()
    if role.is_rank:
        survivor.set_job_checkpoint_dir(kwargs.get("model_dir"))
        kwargs["session_config"] = config.session_config(kwargs.get("session_config"))
    if not role.is_chief and role.is_rank:
        log_all = perseus_env.read_switch(LOG_ALL_RANKS_ENV)
        kwargs.update(model_dir=_private_model_dir(role.rank), save_checkpoints_steps=None,
                      save_checkpoints_secs=None, save_summary_steps=0)
        if not log_all:
            kwargs["log_step_count_steps"] = None
            tf.get_logger().addFilter(_QUIET)
    result = DistributedRunConfig(**kwargs)
    result._perseus_evaluator_timeout_secs = timeout
    return result

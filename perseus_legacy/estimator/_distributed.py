"""Synchronous data-parallel tf.estimator training on every rank, from the RunConfig alone.

`run_config()` returns a `DistributedRunConfig`. An Estimator given one trains like a single
process on the global batch: this module wraps five Estimator internals once (the wrappers change
nothing for any other RunConfig), because a RunConfig has no say in the hooks of a training run:

- `Estimator.train`: before anything else, the ranks check that they were all given the same
  steps and max_steps, then every rank takes the global step of rank 0's latest checkpoint, so
  all ranks skip a finished training together, or all train.
- `Estimator._train_with_estimator_spec`: puts a SyncReplicasHook (gradient averaging by graph
  rewrite, then rank 0's variables broadcast after the session restored or initialised them) at
  the front of the hooks, unless the hooks given already hold one, and the hook that passes rank
  0's pauses (evaluation) and stop requests to the other ranks. Saving listeners run on rank 0,
  the only rank that saves checkpoints.
- `Estimator._call_model_fn`: records the per-rank batch size of a training graph, for the
  examples/sec log.
- `_TrainingExecutor.run_local` (`train_and_evaluate` on a rank): rank 0 evaluates and every rank
  returns rank 0's metrics and export results; when TF_CONFIG names an evaluator task, the ranks
  only train.
- `_TrainingExecutor._Evaluator.evaluate_and_export` (the TF_CONFIG evaluator's loop): fails when
  no new checkpoint appears for `evaluator_timeout_secs`.

Which rank this process is, and whether it trains or evaluates, is decided in `cluster_role()`.
Under TF_CONFIG the ranks' RunConfig is a local one (tf.estimator then starts no TF server and
no parameter-server training): TF_CONFIG only forms the process group (perseus_legacy.init()).
The evaluator's RunConfig is tf.estimator's own evaluator config, so its evaluation loop runs.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from perseus_legacy import basics, config, tf_config
from perseus_legacy.estimator import _compat
from perseus_legacy.estimator._gate import ChiefGate
from perseus_legacy.hooks import BroadcastGlobalVariablesHook, SyncReplicasHook

LOG_ALL_RANKS_ENV = "PERSEUS_LOG_ALL_RANKS"
EVALUATOR_TIMEOUT_ENV = "PERSEUS_EVALUATOR_TIMEOUT_SECS"
DEFAULT_EVALUATOR_TIMEOUT_SECS = 1800.0
_BATCH_SIZE = "perseus_legacy_batch_size"  # graph collection: this rank's training batch size
_GATE = ChiefGate("perseus.estimator")

_estimator_lib = importlib.import_module(_compat.PACKAGE + ".estimator")
_training_lib = importlib.import_module(_compat.PACKAGE + ".training")
_run_config_lib = importlib.import_module(_compat.PACKAGE + ".run_config")


@dataclasses.dataclass(frozen=True)
class ClusterRole:
    """This process's place in distributed Estimator training."""

    rank: int | None  # None: the TF_CONFIG evaluator, no rank of the training group
    size: int
    has_evaluator: bool = False  # TF_CONFIG names an evaluator task: rank 0 does not evaluate

    @property
    def evaluator(self) -> bool:
        """Whether this process is the TF_CONFIG evaluator task."""
        return self.rank is None

    @property
    def is_chief(self) -> bool:
        """Rank 0: writes checkpoints and summaries, evaluates (without an evaluator), logs."""
        return self.rank == 0


def _tf_config_cluster() -> tuple:
    """(Cluster, whether it has an evaluator) when TF_CONFIG names a cluster, else (None, False)."""
    text = os.environ.get("TF_CONFIG", "").strip()
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict) or value.get("cluster"):
        cluster = tf_config.parse_tf_config(text)  # says what is wrong; raises for ps tasks
        return cluster, bool(value["cluster"].get("evaluator"))
    return None, False


def cluster_role() -> ClusterRole:
    """Which training rank this process is (initialising perseus_legacy when needed)."""
    cluster, has_evaluator = _tf_config_cluster()
    if cluster is not None and not cluster.is_rank:
        return ClusterRole(None, cluster.size, has_evaluator=True)
    if not basics.is_initialized():
        basics.init()
    return ClusterRole(basics.rank(), basics.size(), has_evaluator)


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
            cluster = tf_config.parse_tf_config(json.dumps(tf_config_dict))
            tf_config_dict = {k: v for k, v in tf_config_dict.items()
                              if k not in ("cluster", "task")}
            if not cluster.is_rank:
                jobs = {"chief": list(cluster.addresses[:1])}
                if cluster.size > 1:
                    jobs["worker"] = list(cluster.addresses[1:])
                tf_config_dict.update(cluster=jobs, task={"type": "evaluator", "index": 0})
        super()._init_distributed_setting_from_environment_var(tf_config_dict)


def _evaluator_timeout(given: float | None) -> float:
    if given is None:
        text = os.environ.get(EVALUATOR_TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_EVALUATOR_TIMEOUT_SECS
        try:
            given = float(text)
        except ValueError:
            given = -1.0
        where = f"{EVALUATOR_TIMEOUT_ENV}={text!r}"
    else:
        where = f"run_config(evaluator_timeout_secs={given!r})"
    if not given >= 0:
        raise ValueError(f"{where}: expected seconds >= 0 (0: wait for checkpoints forever)")
    return float(given)


def _private_model_dir(rank: int) -> str:
    path = tempfile.mkdtemp(prefix=f"perseus_model_dir_rank{rank}_")
    atexit.register(shutil.rmtree, path, True)
    return path


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


_QUIET = _WarningsOnly()


def run_config(evaluator_timeout_secs: float | None = None,
               **kwargs: Any) -> DistributedRunConfig:
    """A RunConfig (`RunConfig` keyword arguments) for training one Estimator on every rank.

    Rank 0 writes checkpoints and summaries into `model_dir`, evaluates and logs. Every other
    rank gets a private temporary model_dir, removed at exit, and writes nothing: no checkpoints,
    no summaries, and TensorFlow's INFO logs are dropped there unless PERSEUS_LOG_ALL_RANKS=1.
    `session_config` gets session_config() (this rank's GPU); `tf_random_seed` is kept as given.
    perseus_legacy.init() runs first if it has not. The TF_CONFIG evaluator task joins no group;
    it fails when no new checkpoint appears in `model_dir` for `evaluator_timeout_secs`
    (default: PERSEUS_EVALUATOR_TIMEOUT_SECS, else 1800; 0: no limit).
    """
    timeout = _evaluator_timeout(evaluator_timeout_secs)
    role = cluster_role()
    if not role.evaluator:
        kwargs["session_config"] = config.session_config(kwargs.get("session_config"))
    if not role.is_chief and not role.evaluator:
        log_all = os.environ.get(LOG_ALL_RANKS_ENV, "0") not in ("", "0")
        kwargs.update(model_dir=_private_model_dir(role.rank), save_checkpoints_steps=None,
                      save_checkpoints_secs=None, save_summary_steps=0)
        if not log_all:
            kwargs["log_step_count_steps"] = None
            tf.get_logger().addFilter(_QUIET)
    install()
    result = DistributedRunConfig(**kwargs)
    result._perseus_evaluator_timeout_secs = timeout
    return result


def estimator_hooks() -> list:
    """The training hooks that `run_config()` already applies: `[SyncReplicasHook()]`.

    Passing them to `train()` too applies nothing twice. With any other RunConfig they make
    the training synchronous (gradient averaging, rank 0's variables broadcast at the start),
    but ranks do not agree on the start step, and every rank writes into its model_dir.
    """
    return [SyncReplicasHook()]


def _is_distributed(estimator: Any) -> bool:
    return isinstance(estimator.config, DistributedRunConfig)


def _checkpoint_step(model_dir: str) -> int:
    try:
        return int(tf.train.load_variable(model_dir, tf.compat.v1.GraphKeys.GLOBAL_STEP))
    except Exception:  # no checkpoint, or none with a global step: 0, as Estimator.train() does
        return 0


class _TrainingHook(tf.compat.v1.train.SessionRunHook):
    """Every rank's side of a distributed train(): rank 0's pauses and stops, the progress log.

    With `gate_every_step`, after each step every rank takes rank 0's "stop" decision (a saving
    listener may stop rank 0), waiting while rank 0 evaluates. In end(), every rank waits for rank
    0's final checkpoint and evaluation: all ranks leave train() together.
    """

    def __init__(self, loss: tf.Tensor, log_every: int | None, gate_every_step: bool) -> None:
        super().__init__()
        self._loss = loss
        self._log_every = log_every
        self._gate_every_step = gate_every_step

    def begin(self) -> None:
        """Prepares the progress log."""
        self._fetches = None
        if self._log_every:
            batch = tf.compat.v1.get_collection(_BATCH_SIZE)
            self._fetches = {"step": tf.compat.v1.train.get_global_step(), "loss": self._loss,
                             "batch": batch[-1] if batch else tf.constant(0, tf.int64)}
            self._examples = 0
            self._last = None  # (time, global step) of the last log line

    def before_run(self, run_context: Any) -> Any:
        """Asks for the global step, loss and batch size when logging."""
        if self._fetches is None:
            return None
        return tf.compat.v1.train.SessionRunArgs(self._fetches)

    def after_run(self, run_context: Any, run_values: Any) -> None:
        """Passes rank 0's stop request on (with gate_every_step); logs progress."""
        if self._gate_every_step:
            stop, _ = _GATE.sync(int(run_context.stop_requested))
            if stop:
                run_context.request_stop()
        if self._fetches is not None:
            self._log(run_values.results)

    def _log(self, results: dict) -> None:
        now, step = time.time(), int(results["step"])
        self._examples += int(results["batch"])
        if self._last is None:
            self._last, self._examples = (now, step), 0
            return
        last_time, last_step = self._last
        if step - last_step < self._log_every or now <= last_time:
            return
        elapsed, size = now - last_time, basics.size()
        tf.compat.v1.logging.info(
            "global_step/sec: %.4g, examples/sec: %.4g (all %d ranks), loss = %.6g, step = %d",
            (step - last_step) / elapsed, self._examples * size / elapsed, size,
            float(results["loss"]), step)
        self._last, self._examples = (now, step), 0

    def end(self, session: Any) -> None:
        """Waits for rank 0 to finish its last checkpoint and evaluation."""
        _GATE.sync()


class _BusyListener(tf.compat.v1.train.CheckpointSaverListener):
    """A saving listener of rank 0 whose work after a save the other ranks wait out."""

    def __init__(self, listener: Any) -> None:
        self._listener = listener

    def begin(self) -> None:
        self._listener.begin()

    def before_save(self, session: Any, global_step_value: int) -> Any:
        return self._listener.before_save(session, global_step_value)

    def after_save(self, session: Any, global_step_value: int) -> Any:
        with _GATE.busy():
            return self._listener.after_save(session, global_step_value)

    def end(self, session: Any, global_step_value: int) -> None:
        with _GATE.busy():
            self._listener.end(session, global_step_value)


def _agree_on_steps(steps: Any, max_steps: Any) -> None:
    """Raises, on every rank, when the ranks were given different steps or max_steps."""
    mine = np.array([[-1 if steps is None else steps, -1 if max_steps is None else max_steps]],
                    np.int64)
    every = basics.core().allgather(mine, "perseus.estimator.train_steps")
    if (every == mine).all():
        return
    for column, name in ((1, "max_steps"), (0, "steps")):
        if len(set(every[:, column].tolist())) > 1:
            values = ", ".join(f"rank {r}: {'None' if v < 0 else v}"
                               for r, v in enumerate(every[:, column].tolist()))
            raise ValueError(
                f"perseus_legacy (rank {basics.rank()}): the ranks called Estimator.train() with "
                f"different {name} ({values}); every rank must train for the same steps")


def _train(original: Callable, self: Any, input_fn: Any, hooks: Any = None, steps: Any = None,
           max_steps: Any = None, saving_listeners: Any = None) -> Any:
    role = cluster_role() if _is_distributed(self) else None
    if role is not None and not role.evaluator:  # tf.estimator refuses the evaluator's train()
        _agree_on_steps(steps, max_steps)
        chief_step, _ = _GATE.sync(_checkpoint_step(self.model_dir) if role.is_chief else 0)
        if max_steps is not None and 0 < max_steps <= chief_step:
            tf.compat.v1.logging.info(
                "Skipping training: rank 0's checkpoint is at step %d, max_steps is %d.",
                chief_step, max_steps)
            return self
    return original(self, input_fn, hooks=hooks, steps=steps, max_steps=max_steps,
                    saving_listeners=saving_listeners)


def _train_with_estimator_spec(original: Callable, self: Any, estimator_spec: Any,
                               worker_hooks: list, hooks: list, global_step_tensor: Any,
                               saving_listeners: Any) -> Any:
    if not _is_distributed(self):
        return original(self, estimator_spec, worker_hooks, hooks, global_step_tensor,
                        saving_listeners)
    listeners = list(saving_listeners or ())
    chief = cluster_role().is_chief
    given = list(worker_hooks) + list(hooks)
    ours = [_TrainingHook(estimator_spec.loss, self.config.log_step_count_steps,
                          gate_every_step=bool(listeners))]
    if not any(isinstance(h, SyncReplicasHook) for h in given):
        broadcast = not any(isinstance(h, BroadcastGlobalVariablesHook) for h in given)
        ours.append(SyncReplicasHook(broadcast=broadcast))
    # First: the broadcast must precede StopAtStepHook(steps=...) reading the global step.
    worker_hooks[:0] = ours
    listeners = [_BusyListener(listener) for listener in listeners] if chief else []
    return original(self, estimator_spec, worker_hooks, hooks, global_step_tensor, listeners)


def _batch_size(features: Any) -> tf.Tensor | None:
    for leaf in tf.nest.flatten(features):
        if isinstance(leaf, tf.SparseTensor):
            return tf.cast(leaf.dense_shape[0], tf.int64)
        if isinstance(leaf, tf.Tensor) and leaf.shape.rank:
            return tf.shape(leaf, out_type=tf.int64)[0]
    return None


def _call_model_fn(original: Callable, self: Any, features: Any, labels: Any, mode: Any,
                   config: Any) -> Any:
    spec = original(self, features, labels, mode, config)
    if mode == _estimator_lib.ModeKeys.TRAIN and _is_distributed(self):
        with tf.name_scope("perseus_legacy"):
            batch = _batch_size(features)
        if batch is not None:
            tf.compat.v1.add_to_collection(_BATCH_SIZE, batch)
    return spec


def _run_local(original: Callable, self: Any) -> Any:
    if not _is_distributed(self._estimator):
        return original(self)
    if cluster_role().has_evaluator:
        # The TF_CONFIG evaluator evaluates; the ranks train, like tf.estimator's chief and
        # workers (without their TF server) and, like them, return None.
        self._estimator.train(input_fn=self._train_spec.input_fn,
                              max_steps=self._train_spec.max_steps,
                              hooks=list(self._train_spec.hooks) + list(self._train_hooks),
                              saving_listeners=self._train_spec.saving_listeners)
        return None
    result = original(self)  # the evaluation happened on rank 0, while the others waited
    chief = cluster_role().is_chief
    _, payload = _GATE.sync(payload=pickle.dumps(result) if chief else b"")
    return pickle.loads(payload)


class EvaluatorTimeoutError(RuntimeError):
    """The TF_CONFIG evaluator saw no new checkpoint for `evaluator_timeout_secs`."""


def _evaluate_and_export(original: Callable, self: Any) -> Any:
    estimator = self._estimator
    config_ = estimator.config
    if not (_is_distributed(estimator) and config_.task_type == "evaluator"):
        return original(self)
    latest, now = estimator.latest_checkpoint(), time.monotonic()
    seen = getattr(self, "_perseus_seen", None)  # (checkpoint, when it was first seen)
    if seen is None or seen[0] != latest:
        self._perseus_seen = (latest, now)
    elif config_.evaluator_timeout_secs and now - seen[1] > config_.evaluator_timeout_secs:
        what = f"after {latest}" if latest else "at all"
        raise EvaluatorTimeoutError(
            f"perseus_legacy evaluator: no new checkpoint {what} in {estimator.model_dir} for "
            f"{now - seen[1]:.0f} s (evaluator_timeout_secs={config_.evaluator_timeout_secs:g}); "
            "the chief (rank 0) writes them while it trains: is it running, with this "
            f"model_dir? Raise the limit with {EVALUATOR_TIMEOUT_ENV} or "
            "run_config(evaluator_timeout_secs=...), 0 for none.")
    return original(self)


_WRAPPED = (
    (_estimator_lib.Estimator, "train", _train),
    (_estimator_lib.Estimator, "_train_with_estimator_spec", _train_with_estimator_spec),
    (_estimator_lib.Estimator, "_call_model_fn", _call_model_fn),
    (_training_lib._TrainingExecutor, "run_local", _run_local),
    (_training_lib._TrainingExecutor._Evaluator, "evaluate_and_export", _evaluate_and_export),
)


def install() -> None:
    """Wraps the Estimator internals above, once; they act only for a DistributedRunConfig."""
    for owner, name, wrapper in _WRAPPED:
        original = getattr(owner, name)
        if getattr(original, "_perseus_original", None) is not None:
            continue
        setattr(owner, name, _wrap(original, wrapper))


def _wrap(original: Callable, wrapper: Callable) -> Callable:
    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    wrapped._perseus_original = original
    return wrapped

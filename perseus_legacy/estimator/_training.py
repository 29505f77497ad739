"""Synchronous data-parallel tf.estimator training on every rank, from the RunConfig alone.

An Estimator given a `DistributedRunConfig` trains like a single process on the global batch:
this module holds the wrappers of five Estimator internals (perseus_legacy.tf_compat wraps them
once, at the first run_config(); they change nothing for any other RunConfig), because a
RunConfig has no say in the hooks of a training run:

- `Estimator.train`: before anything else, the ranks check that they were all given the same
  steps and max_steps, then every rank takes the global step of rank 0's latest checkpoint, so
  all ranks skip a finished training together, or all train.
- `Estimator._train_with_estimator_spec`: puts a SyncReplicasHook (gradient averaging by graph
  rewrite, then rank 0's variables broadcast after the session restored or initialised them) at
  the front of the hooks, unless the hooks given already hold one, and the hook that waits for
  rank 0's last checkpoint and evaluation. A stop requested by any hook on any rank stops every
  rank after the same step (perseus_legacy.tf1.stopping, through the SyncReplicasHook), while
  rank 0 may evaluate between steps. Early stopping hooks decide on rank 0 only (from its
  evaluation directory, the real one): the other ranks get tf.estimator's non-chief hook in their
  place. Saving listeners run on rank 0, the only rank that saves checkpoints.
- `Estimator._call_model_fn`: records the per-rank batch size of a training graph, for the
  examples/sec log.
- `_TrainingExecutor.run_local` (`train_and_evaluate` on a rank): rank 0 evaluates and every rank
  returns rank 0's metrics and export results; when TF_CONFIG names an evaluator task, the ranks
  only train.
- `_TrainingExecutor._Evaluator.evaluate_and_export` (the TF_CONFIG evaluator's loop): fails when
  no new checkpoint appears for `evaluator_timeout_secs`; when the chief deletes the checkpoint
  it chose before it could read it (`keep_checkpoint_max`), says so and evaluates the latest one
  instead, and fails after MAX_DELETED_IN_A_ROW such passes in a row.
"""

from __future__ import annotations

import importlib
import inspect
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Average, Sum
from perseus_legacy.estimator import _payload
from perseus_legacy.estimator._run_config import (
    EVALUATOR_TIMEOUT_ENV,
    DistributedRunConfig,
    cluster_role,
)
from perseus_legacy.tf1.config import without_file_writers
from perseus_legacy.tf1.gate import GATE as _GATE
from perseus_legacy.tf1.hooks import BroadcastGlobalVariablesHook, SyncReplicasHook
from perseus_legacy.tf_compat import estimator_api

_BATCH_SIZE = "perseus_legacy_batch_size"  # graph collection: this rank's training batch size

_estimator_lib = importlib.import_module(estimator_api.PACKAGE + ".estimator")
_early_stopping = importlib.import_module(estimator_api.PACKAGE + ".early_stopping")


def _is_distributed(estimator: Any) -> bool:
    return isinstance(estimator.config, DistributedRunConfig)


def _checkpoint_step(model_dir: str) -> int:
    try:
        return int(tf.train.load_variable(model_dir, tf.compat.v1.GraphKeys.GLOBAL_STEP))
    except Exception:  # no checkpoint, or none with a global step: 0, as Estimator.train() does
        return 0


class _TrainingHook(tf.compat.v1.train.SessionRunHook):
    """Every rank's side of a distributed train(): the progress log, rank 0's last pause.

    In end(), once `sync_hook` has settled the ranks (a rank whose input ended joins there),
    every rank waits for rank 0's final checkpoint and evaluation: all ranks leave train()
    together.
    """

    def __init__(self, loss: tf.Tensor, log_every: int | None, sync_hook: Any) -> None:
        super().__init__()
        self._loss = loss
        self._log_every = log_every
        self._sync_hook = sync_hook

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
        """Logs progress."""
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
        self._sync_hook.end(session)  # first: a rank still in a step needs this one's join
        _GATE.sync()


class _BusyListener(tf.compat.v1.train.CheckpointSaverListener):
    """A saving listener of rank 0 whose work after a save the other ranks wait out."""

    def __init__(self, listener: Any, sync_hook: SyncReplicasHook) -> None:
        self._listener = listener
        self._sync_hook = sync_hook

    def begin(self) -> None:
        self._listener.begin()

    def before_save(self, session: Any, global_step_value: int) -> Any:
        return self._listener.before_save(session, global_step_value)

    def after_save(self, session: Any, global_step_value: int) -> Any:
        with _GATE.busy():
            return self._listener.after_save(session, global_step_value)

    def end(self, session: Any, global_step_value: int) -> None:
        # Training is over for rank 0: it joins first, as the other ranks do in their end(), so
        # that they wait at the gate, not in join(), while it is busy (a busy round that met
        # ranks still joined would count for rank 0 and for none of them).
        self._sync_hook.end(session)
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
    if role is not None and role.is_rank:  # tf.estimator refuses the evaluator's train()
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
    chief = cluster_role().is_chief
    if not chief:
        hooks = [_decided_on_rank_0(h) for h in without_file_writers(hooks)]
        worker_hooks[:] = without_file_writers(worker_hooks)
        estimator_spec = estimator_spec._replace(
            training_hooks=tuple(without_file_writers(estimator_spec.training_hooks)),
            training_chief_hooks=())
    given = list(worker_hooks) + list(hooks)
    sync_hook = next((h for h in given if isinstance(h, SyncReplicasHook)), None)
    ours = []
    if sync_hook is None:
        broadcast = not any(isinstance(h, BroadcastGlobalVariablesHook) for h in given)
        sync_hook = SyncReplicasHook(broadcast=broadcast)
        ours.append(sync_hook)
    if _loss_is_a_batch_sum(self) and sync_hook.op == Average:
        sync_hook.op = Sum  # the global batch's sum is the sum of the ranks' sums
    if chief:
        _listeners_wait_for_rank_0(given + list(estimator_spec.training_hooks) +
                                   list(estimator_spec.training_chief_hooks), sync_hook)
    ours.append(_TrainingHook(estimator_spec.loss, self.config.log_step_count_steps, sync_hook))
    # First: the broadcast must precede StopAtStepHook(steps=...) reading the global step.
    worker_hooks[:0] = ours
    listeners = ([_BusyListener(listener, sync_hook) for listener in saving_listeners or ()]
                 if chief else [])
    return original(self, estimator_spec, worker_hooks, hooks, global_step_tensor, listeners)


def _listeners_wait_for_rank_0(hooks: list, sync_hook: SyncReplicasHook) -> None:
    """The saving listeners of a CheckpointSaverHook given to rank 0: the other ranks wait while
    they work, as for train()'s saving_listeners."""
    for hook in hooks:
        if isinstance(hook, tf.compat.v1.train.CheckpointSaverHook):
            hook._listeners[:] = [
                _BusyListener(listener._listener if isinstance(listener, _BusyListener)
                              else listener, sync_hook) for listener in hook._listeners]


def _loss_is_a_batch_sum(estimator: Any) -> bool:
    """Whether a canned estimator's head sums its loss over the batch (loss_reduction=SUM, the
    default of tf.compat.v1's canned estimators): the loss of the global batch is then the sum
    of the ranks' losses, and so is its gradient. The head is the one its model_fn closes over."""
    try:
        head = inspect.getclosurevars(estimator._model_fn).nonlocals.get("head")
    except TypeError:  # not a Python function
        return False
    reduction = getattr(head, "loss_reduction", getattr(head, "_loss_reduction", None))
    # tf.compat.v1.losses' SUM (v1 heads) and Keras' SUM (the v2 heads).
    return reduction in (tf.compat.v1.losses.Reduction.SUM, "sum")


def _decided_on_rank_0(hook: Any) -> Any:
    """On ranks other than 0, an early stopping hook (its predicate reads this rank's empty
    evaluation directory) becomes the hook tf.estimator gives non-chief workers: rank 0 decides,
    and its stop reaches every rank through the stop agreement."""
    if isinstance(hook, _early_stopping._StopOnPredicateHook):
        return _early_stopping._CheckForStoppingHook()
    return hook


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
    _, payload = _GATE.sync(payload=_payload.encode(result) if chief else b"")
    return _payload.decode(payload)


class EvaluatorTimeoutError(RuntimeError):
    """The TF_CONFIG evaluator saw no new checkpoint for `evaluator_timeout_secs`."""


class CheckpointDeletedError(RuntimeError):
    """The chief deleted every checkpoint the TF_CONFIG evaluator chose before it could read it,
    MAX_DELETED_IN_A_ROW times in a row."""


MAX_DELETED_IN_A_ROW = 5


def _evaluate_and_export(original: Callable, self: Any) -> Any:
    """The evaluator's pass, again on the latest checkpoint when the chosen one was deleted."""
    estimator = self._estimator
    if not (_is_distributed(estimator) and estimator.config.task_type == "evaluator"):
        return original(self)
    chosen = estimator.latest_checkpoint()
    try:
        result = _evaluate_unless_timed_out(original, self, chosen)
    except EvaluatorTimeoutError:
        raise
    except Exception as error:
        if chosen is None or tf.io.gfile.exists(chosen + ".index"):
            raise
        deleted = getattr(self, "_perseus_deleted", 0) + 1
        self._perseus_deleted = deleted
        keep = estimator.config.keep_checkpoint_max
        if deleted >= MAX_DELETED_IN_A_ROW:
            raise CheckpointDeletedError(
                f"perseus_legacy evaluator: the chief deleted {deleted} checkpoints in a row "
                f"before this evaluator could read them, the last {chosen} "
                f"(keep_checkpoint_max={keep}): it writes checkpoints faster than they are "
                "evaluated; raise keep_checkpoint_max in run_config()") from error
        tf.compat.v1.logging.warning(
            f"perseus_legacy evaluator: {chosen} was deleted before it could be read (the chief "
            f"keeps keep_checkpoint_max={keep} checkpoints); evaluating the latest one, "
            f"{estimator.latest_checkpoint()}, instead")
        return _evaluate_and_export(original, self)
    self._perseus_deleted = 0
    return result


def _evaluate_unless_timed_out(original: Callable, self: Any, latest: str | None) -> Any:
    estimator = self._estimator
    config_ = estimator.config
    now = time.monotonic()
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


# The methods run_config() wraps, by their name in perseus_legacy.tf_compat.CHANGES (which makes
# the change): each wrapper is called as wrapper(original, *args, **kwargs).
WRAPPERS = {
    "tensorflow_estimator Estimator.train": _train,
    "tensorflow_estimator Estimator._train_with_estimator_spec": _train_with_estimator_spec,
    "tensorflow_estimator Estimator._call_model_fn": _call_model_fn,
    "tensorflow_estimator _TrainingExecutor.run_local": _run_local,
    "tensorflow_estimator _TrainingExecutor._Evaluator.evaluate_and_export":
        _evaluate_and_export,
}

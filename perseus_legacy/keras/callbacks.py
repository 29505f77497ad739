"""Keras 2 callbacks for synchronous data-parallel `Model.fit` (Horovod's keras callbacks).

Every rank must use the same callbacks, in the same order: they run collectives.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Any

import numpy as np
import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Average
from perseus_legacy.keras.keras2 import keras
from perseus_legacy.keras.optimizer import build_optimizer, optimizer_variables
from perseus_legacy.tensorflow import collectives

__all__ = ["BackupAndRestore", "BestModelCheckpoint", "BroadcastGlobalVariablesCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
           "broadcast_model", "broadcast_variables"]


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"{what} runs eagerly, as tf-keras does in TensorFlow 2; with "
            "tf.compat.v1.disable_eager_execution() Keras trains in a TF1 graph: use "
            "perseus_legacy.broadcast_global_variables(0) in that session instead")


def _optimizer_variables(optimizer: Any, model: Any) -> list:
    """The optimizer's variables, creating its slots first if no step has run yet."""
    if optimizer is None or not model.built or not model.trainable_variables:
        return []  # an unbuilt model's optimizer is built by the first step
    build_optimizer(optimizer, model.trainable_variables)
    return optimizer_variables(optimizer)


def broadcast_variables(variables: list, root_rank: int) -> None:
    """Assigns `root_rank`'s value of every variable to it, on every rank (eagerly, fused)."""
    basics.require_initialized("perseus_legacy.keras.broadcast_variables()")
    _require_eager("perseus_legacy.keras.broadcast_variables()")
    unique = list({id(v): v for v in variables}.values())
    collectives.assign_from_root(unique, basics.check_root(root_rank, "broadcast_variables"),
                                 [None] * len(unique))


def broadcast_model(model: Any, root_rank: int = 0, local_variables: Any = ()) -> None:
    """Broadcasts `root_rank`'s model and optimizer variables (slots created if needed), all but
    `local_variables`."""
    local = {v.ref() for v in local_variables}
    broadcast_variables([v for v in model.variables if v.ref() not in local]
                        + _optimizer_variables(getattr(model, "optimizer", None), model),
                        root_rank)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from `root_rank`'s model and optimizer variables.

    The broadcast runs once, just before the first training batch: after every callback's
    `on_train_begin` (so after a BackupAndRestore restore) and after weights loaded before
    `fit`, whatever the order of the callbacks. A model not yet built (no input shape) gets it
    after the first batch instead, whose step then started from different weights. The model's
    `local_variables` (and those given to register_local_var) keep each rank's own values.
    """

    def __init__(self, root_rank: int = 0, device: str = "",
                 local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars = list(local_variables or [])
        self._supports_tf_logs = True  # logs are not read: no per-batch conversion

    def register_local_var(self, var: Any) -> None:
        """Leaves `var` out of the broadcast."""
        self._local_vars.append(var)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Broadcasts before the first batch (if the model is built)."""
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Broadcasts after the first batch if the model was built by it."""
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self) -> None:
        with tf.device(self.device):
            broadcast_model(self.model, self.root_rank, self._local_vars)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces every metric in the epoch-end `logs` by its average over all ranks.

    Put it before callbacks that read metrics (ReduceLROnPlateau, EarlyStopping, TensorBoard,
    ModelCheckpoint): they then see the same values on every rank.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Averages the numeric entries of `logs` in place."""
        if not logs:
            return
        _require_eager("MetricAverageCallback")
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0
                      and np.issubdtype(np.asarray(v).dtype, np.number))
        values = [tf.constant(float(logs[k]), tf.float64) for k in keys]
        with tf.device(self.device):
            averaged = collectives.grouped_allreduce(values, op=Average,
                                                     name="MetricAverageCallback")
        for key, value in zip(keys, averaged):
            logs[key] = float(value)


def _momentum_variable(optimizer: Any) -> Any:
    """The optimizer's momentum if it is a variable the compiled step reads, else None."""
    hyper = getattr(optimizer, "_hyper", None)  # legacy optimizers keep hyperparameters here
    if isinstance(hyper, dict) and "momentum" in hyper:
        optimizer._create_hypers()
        return hyper["momentum"]
    return None


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` from `start_epoch` until
    `end_epoch` (exclusive; None: to the end), as Horovod's callback of this name.

    `multiplier` is a function of the epoch, or a number m meaning m ** (epoch - start_epoch).
    With `staircase` the rate is set at the first batch of each epoch; otherwise before every
    batch, at the fractional epoch `epoch + batch / steps_per_epoch` (`steps_per_epoch` defaults
    to fit's). With `momentum_correction`, a batch whose lr changed from lr_old uses momentum *
    lr / lr_old (then the momentum is restored); that needs momentum in a variable, as the legacy
    Keras optimizers (`optimizers.legacy.SGD`) keep it. The epoch-end logs get "lr".

    Args:
      initial_lr: the rate that `multiplier` scales.
      multiplier: a function of the (fractional) epoch, or a number m: m ** (epoch -
        start_epoch).
      start_epoch: the first epoch the schedule sets the rate in.
      end_epoch: the epoch it stops at (exclusive; None: to the end).
      staircase: set the rate once per epoch (at its first batch) instead of every batch.
      momentum_correction: scale the momentum by lr / lr_old for a batch whose rate changed.
      steps_per_epoch: batches per epoch, for the fractional epoch (default: fit's).

    Raises:
      ValueError: no initial_lr; without staircase, no steps_per_epoch known at fit().
    """

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError(f"{type(self).__name__} needs initial_lr")
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0
        self._steps = None
        self._restore_momentum = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Finds steps_per_epoch (when the rate changes every batch)."""
        self._steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not self.staircase and not self._steps:
            raise ValueError(f"{type(self).__name__} needs steps_per_epoch: pass it, or give "
                             "fit() steps_per_epoch or data of known length")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Remembers the epoch."""
        self._epoch = epoch

    def progress(self, batch: int) -> float | None:
        """The (fractional) epoch the rate of `batch` is computed at; None: leave it alone."""
        if self._epoch < self.start_epoch or (self.end_epoch is not None
                                              and self._epoch >= self.end_epoch):
            return None
        if self.staircase:
            return float(self._epoch) if batch == 0 else None
        return self._epoch + batch / self._steps

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Sets this batch's learning rate (and corrected momentum)."""
        progress = self.progress(batch)
        if progress is None:
            return
        optimizer = self.model.optimizer
        old_lr = float(keras.backend.get_value(optimizer.learning_rate))
        new_lr = self.initial_lr * self.multiplier(progress)
        keras.backend.set_value(optimizer.learning_rate, new_lr)
        momentum = _momentum_variable(optimizer) if self.momentum_correction else None
        if momentum is not None and old_lr > 0 and new_lr != old_lr:
            self._restore_momentum = float(keras.backend.get_value(momentum))
            keras.backend.set_value(momentum, self._restore_momentum * new_lr / old_lr)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Restores the momentum after a corrected batch."""
        if self._restore_momentum is not None:
            keras.backend.set_value(_momentum_variable(self.model.optimizer),
                                    self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Logs the learning rate as "lr"."""
        if logs is not None:
            logs["lr"] = float(keras.backend.get_value(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from `initial_lr / size()` to `initial_lr` over `warmup_epochs`.

    Goyal et al., "Accurate, Large Minibatch SGD": before every batch of the warmup, at epoch
    progress `p = epoch + batch / steps_per_epoch`, lr = initial_lr / size() *
    (p * (size() - 1) / warmup_epochs + 1); the first batch after the warmup gets initial_lr.
    `initial_lr` is the already scaled rate (e.g. `scale_learning_rate(0.01)`). Momentum
    correction and `steps_per_epoch` as in LearningRateScheduleCallback.

    Args:
      initial_lr: the already scaled rate reached at the end of the warmup.
      warmup_epochs: the warmup's length in epochs (> 0, may be fractional).
      momentum_correction: as in LearningRateScheduleCallback.
      steps_per_epoch: as in LearningRateScheduleCallback.
      verbose: > 0 prints a line when the warmup ends.

    Raises:
      ValueError: warmup_epochs <= 0.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be > 0, got {warmup_epochs}")
        super().__init__(initial_lr, self.warmup_multiplier, staircase=False,
                         momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def warmup_multiplier(self, progress: float) -> float:
        """The factor of initial_lr at epoch progress `progress` (1 from warmup_epochs on)."""
        size = basics.size()
        return min(1.0, (progress * (size - 1) / self.warmup_epochs + 1) / size)

    def progress(self, batch: int) -> float | None:
        """Epoch progress up to and including the end of the warmup; None after it."""
        progress = self._epoch + batch / self._steps
        return None if progress > self.warmup_epochs else progress

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Sets this batch's learning rate (and corrected momentum)."""
        super().on_train_batch_begin(batch, logs)
        if self.progress(batch) == self.warmup_epochs and self.verbose > 0:
            new_lr = float(keras.backend.get_value(self.model.optimizer.learning_rate))
            print(f"\nEpoch {self._epoch + 1}: learning rate warmup done, lr is {new_lr:g}.",
                  flush=True)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """ModelCheckpoint that keeps the best model (save_best_only) and saves on rank 0 only.

    Horovod's signature, plus `filepath` (Horovod's Spark estimator sets it; here pass it).
    Average the monitored metric first (MetricAverageCallback) so every rank agrees on "best".

    Args:
      monitor: the metric whose best value is kept.
      verbose: ModelCheckpoint's verbosity.
      save_weights_only: save the weights only, not the whole model.
      mode: "auto", "min" or "max": which value of `monitor` is best.
      save_freq: "epoch" or a number of batches.
      filepath: where rank 0 saves the model (required, checked at on_train_begin).
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto", save_freq: Any = "epoch",
                 filepath: str | None = None) -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Checks that a filepath was given."""
        if not self.filepath:
            raise ValueError("BestModelCheckpoint needs filepath= (where rank 0 saves the model)")
        super().on_train_begin(logs)

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if basics.rank() == 0:
            super()._save_model(*args, **kwargs)


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """tf-keras' BackupAndRestore where rank 0 alone writes and every rank resumes from it.

    Rank 0 backs up to `backup_dir` (at every epoch end, or every `save_freq` batches) and
    restores from it when `fit` starts; the other ranks never touch `backup_dir` (it need not be
    shared) and receive rank 0's restored model, optimizer and epoch/batch counters by
    broadcast, so every rank resumes at the same epoch with the same state.
    """

    def __init__(self, backup_dir: str, save_freq: Any = "epoch", delete_checkpoint: bool = True,
                 save_before_preemption: bool = False) -> None:
        if save_before_preemption:
            raise NotImplementedError("BackupAndRestore(save_before_preemption=True) needs a "
                                      "tf.distribute MultiWorkerMirroredStrategy; not supported")
        super().__init__(backup_dir, save_freq=save_freq, delete_checkpoint=delete_checkpoint)
        self._root_dir = backup_dir

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Rank 0 restores from the backup; every rank then takes rank 0's state."""
        # Other ranks read from a directory that never exists: they restore nothing themselves.
        self.backup_dir = self._root_dir if basics.rank() == 0 else os.path.join(
            tempfile.gettempdir(), f"perseus-no-backup-{uuid.uuid4().hex}")
        super().on_train_begin(logs)
        state = self._training_state
        broadcast_variables([state._ckpt_saved_epoch, state._ckpt_saved_batch,
                             self.model._train_counter], 0)
        broadcast_model(self.model, 0)

    def _backup(self, epoch: int, batch: int = 0) -> None:
        if basics.rank() == 0:
            super()._backup(epoch, batch)

    def on_train_end(self, logs: dict | None = None) -> None:
        """Rank 0 deletes the backup (unless delete_checkpoint=False)."""
        super().on_train_end(logs)
        self.backup_dir = self._root_dir

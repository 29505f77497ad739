"""`perseus_legacy.keras.elastic`: Horovod's Keras elastic API (KerasState and the callbacks that
keep `state.batch` and `state.epoch` and commit); regrouping as in perseus_legacy.elastic.state;
imports Keras 2.
"""

from __future__ import annotations

from typing import Any

from perseus_legacy.elastic.state import (  # noqa: F401
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    run,
)
from perseus_legacy.elastic.tensorflow_state import TensorFlowKerasState
from perseus_legacy.keras.keras2 import keras


class KerasState(TensorFlowKerasState):
    """TensorFlowKerasState of a Keras 2 `model` (and `optimizer`, default model.optimizer)."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, backend=keras.backend, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` training batches and at every epoch's end."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if int(batches_per_commit) < 1:
            raise ValueError(f"batches_per_commit must be >= 1, got {batches_per_commit}")
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._batches_left = self.batches_per_commit

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._batches_left = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches_left -= 1
        if self._batches_left == 0:
            self.state.commit()
            self._batches_left = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Sets `state.batch` to the index of each finished training batch, and to 0 at an epoch's
    end. With a known number of steps, the first epoch of a fit() started at `state.batch` > 0
    is announced shorter by that many steps (Horovod's rule)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._steps_per_epoch = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self.params.get("steps"):
            if self._steps_per_epoch is None:
                self._steps_per_epoch = self.params["steps"]
            self.params["steps"] = self._steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Sets `state.epoch` at each epoch's end to the number of epochs done, counting those of
    earlier fit() calls (the value of `state.epoch` when fit() started)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self._initial_epoch = state.epoch

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = self._initial_epoch + epoch + 1

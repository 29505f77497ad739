"""Elastic state of TensorFlow variables and of Keras models: TensorFlowState and
TensorFlowKerasState, with Horovod's arguments.

Eagerly, values are saved as numpy copies and synced with one fused broadcast. In a
tf.compat.v1 graph, the broadcast and the assignments restore() runs are built when the state
is created (before the graph is finalized) and run in the session.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.elastic.state import ObjectState
from perseus_legacy.tensorflow import collectives
from perseus_legacy.tf1 import hooks


class TensorFlowState(ObjectState):
    """`variables` (default: the graph's global variables) and the keyword arguments as values.

    Eagerly, pass `variables`. In a graph, `session` (default: the default session) runs the
    broadcast, reads and assignments; create the state before the graph is finalized.
    """

    def __init__(self, variables: list | None = None, session: Any = None,
                 **kwargs: Any) -> None:
        self._eager = tf.executing_eagerly()
        if variables is None:
            if self._eager:
                raise ValueError("TensorFlowState(): eagerly there is no global variables "
                                 "collection; pass variables=[...] (e.g. model.variables)")
            variables = tf.compat.v1.global_variables()
        self.variables = list(variables)
        self.session = session
        if not self._eager:
            self.session = session or tf.compat.v1.get_default_session()
            if self.session is None:
                raise ValueError("TensorFlowState() in a graph needs a session: pass session= "
                                 "or create the state inside `with session.as_default():`")
            self._broadcast = hooks.broadcast_variables(self.variables, root_rank=0)
            self._placeholders = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
                                  for v in self.variables]
            self._assign = tf.group(*[tf.compat.v1.assign(v, p)
                                      for v, p in zip(self.variables, self._placeholders)])
        self._values = self._read()
        super().__init__(**kwargs)

    def _read(self) -> list:
        if self._eager:
            return [v.numpy() for v in self.variables]
        return self.session.run(self.variables)

    def save(self) -> None:
        """Copies the variables' values and the attributes."""
        self._values = self._read()
        super().save()

    def restore(self) -> None:
        """Assigns the committed values to the variables and attributes."""
        if self._eager:
            for var, value in zip(self.variables, self._values):
                var.assign(value)
        else:
            self.session.run(self._assign, dict(zip(self._placeholders, self._values)))
        super().restore()

    def sync(self) -> None:
        """Every rank takes rank 0's variables (current values) and committed attributes."""
        if self._eager:
            collectives.broadcast_(self.variables, root_rank=0, name="perseus.elastic.variables")
        else:
            self.session.run(self._broadcast)
        self._values = self._read()
        super().sync()


class TensorFlowKerasState(ObjectState):
    """A built Keras 2 `model`, its `optimizer` (default: model.optimizer) and the keyword
    arguments as values.

    Values are read and written through `backend` (default: Keras 2's backend), which works
    eagerly and in a tf.compat.v1 graph. Eagerly the optimizer's slots are created with the
    state, so the first sync() covers them; in a graph, slots created after the state are
    saved from the next commit on but not broadcast.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("TensorFlowKerasState(): the model must be built first: call "
                             "model.build(input_shape) or run it on a batch")
        self.model = model
        self.optimizer = optimizer or model.optimizer
        from perseus_legacy.keras.keras2 import keras  # Keras only for Keras states
        from perseus_legacy.keras.optimizer import build_optimizer

        self.backend = backend or keras.backend
        self._broadcast = None
        if not tf.executing_eagerly():
            self._broadcast = hooks.broadcast_variables(tf.compat.v1.global_variables(), 0)
        elif self.optimizer is not None and model.trainable_variables:
            # Slots exist from the start: sync() gives every rank rank 0's before any step.
            build_optimizer(self.optimizer, model.trainable_variables)
        self._saved: list = []
        self._save_model()
        super().__init__(**kwargs)

    def _variables(self) -> list:
        from perseus_legacy.keras.optimizer import optimizer_variables

        optimizer = optimizer_variables(self.optimizer) if self.optimizer is not None else []
        return list(self.model.variables) + optimizer

    def _save_model(self) -> None:
        variables = self._variables()
        self._saved = list(zip(variables, self.backend.batch_get_value(variables)))

    def save(self) -> None:
        """Copies the model's and optimizer's values and the attributes."""
        self._save_model()
        super().save()

    def restore(self) -> None:
        """Assigns the committed values to the model, the optimizer and the attributes."""
        self.backend.batch_set_value(self._saved)
        super().restore()

    def sync(self) -> None:
        """Every rank takes rank 0's model and optimizer values and committed attributes."""
        basics.require_initialized("TensorFlowKerasState.sync()")
        if self._broadcast is None:
            collectives.broadcast_(self._variables(), root_rank=0, name="perseus.elastic.keras")
        else:
            self.backend.get_session().run(self._broadcast)
        self._save_model()
        super().sync()

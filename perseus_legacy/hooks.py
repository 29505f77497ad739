"""Session hooks and helpers that make every rank start from the same variable values."""

from __future__ import annotations

from typing import Any, Iterable

import tensorflow as tf

from perseus_legacy import basics, ops


def _broadcast_name(var: Any) -> str:
    return "broadcast_" + var.op.name.replace("/", "_")


def broadcast_variables(variables: Iterable[Any], root_rank: int) -> Any:
    """Assigns `root_rank`'s value of every variable to it on every rank.

    In a graph: returns one grouped op that does it when run (every rank must run it). Eagerly:
    does it now and returns None.
    """
    basics.require_initialized("broadcast_variables()")
    variables = list(variables)
    if tf.executing_eagerly():
        for var in variables:
            var.assign(ops.broadcast(var.read_value(), root_rank))
        return None
    assigns = [tf.compat.v1.assign(var, ops.broadcast(var, root_rank, name=_broadcast_name(var)))
               for var in variables]
    return tf.group(*assigns, name="broadcast_variables")


def broadcast_global_variables(root_rank: int) -> Any:
    """An op assigning `root_rank`'s value of every global variable (global step included)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() needs a graph (TF1 global variables collection); "
            "eagerly, call broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Broadcasts `root_rank`'s global variables to every rank once the session exists.

    The broadcast runs in `after_create_session`, that is after variables were initialised or
    restored from a checkpoint: every rank then starts from the root's values (global step
    included), whichever rank restored what. Every rank must use this hook.
    """

    def __init__(self, root_rank: int = 0, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.bcast_op = None
        self._graph = None

    def begin(self) -> None:
        """Builds the broadcast op in the graph (before it is finalized)."""
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self._graph is not graph:
            self._graph = graph
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: tf.compat.v1.Session, coord: Any) -> None:
        """Runs the broadcast."""
        session.run(self.bcast_op)

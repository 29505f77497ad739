"""Session hooks and helpers that make every rank start from the same variable values."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.common.basics import Average
from perseus_legacy.common.process_sets import process_set_id
from perseus_legacy.tensorflow import collectives
from perseus_legacy.tf1 import survivor
from perseus_legacy.tf1.graph_rewrite import distribute_graph
from perseus_legacy.tf1.stopping import StopAgreement


def _broadcast_name(var: Any) -> str:
    # var.name, not var.op.name: inside a tf.function a variable created eagerly has no op.
    return "broadcast_" + var.name.split(":")[0].replace("/", "_")


def broadcast_variables(variables: Iterable[Any], root_rank: int, inplace: bool = False,
                        process_set: Any = None) -> Any:
    """Assigns `root_rank`'s value of every variable to it on every rank (of `process_set`).

    In a graph: returns one grouped op that does it when run (every rank must run it). Eagerly:
    does it now and returns None. `inplace` (Horovod's) is accepted: assignments are in place.
    """
    basics.require_initialized("broadcast_variables()")
    set_id = process_set_id(process_set, "broadcast_variables")
    root_rank = basics.check_root(root_rank, "broadcast_variables", set_id)
    variables = list(variables)
    assigns = collectives.assign_from_root(variables, root_rank,
                                           [_broadcast_name(v) for v in variables], set_id)
    if tf.executing_eagerly():
        return None
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
    included), whichever rank restored what. Every rank (of `process_set`, default all; its
    `root_rank` is a global rank) must use this hook. From then on, a step failing because a
    rank is lost makes the lowest survivor save that step (perseus_legacy.tf1.survivor).
    Without a process set, a stop requested by any hook on any rank stops every rank after the
    same step (perseus_legacy.tf1.stopping).
    """

    def __init__(self, root_rank: int = 0, device: str = "", process_set: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.bcast_op = None
        self._graph = None
        self.stop_agreement = StopAgreement(order=1) if process_set is None else None

    def begin(self) -> None:
        """Builds the broadcast op in the graph (before it is finalized)."""
        graph = tf.compat.v1.get_default_graph()
        if self.bcast_op is None or self._graph is not graph:
            self._graph = graph
            with tf.device(self.device):
                if self.process_set is None:
                    self.bcast_op = broadcast_global_variables(self.root_rank)
                else:
                    self.bcast_op = broadcast_variables(tf.compat.v1.global_variables(),
                                                        self.root_rank,
                                                        process_set=self.process_set)
        if self.stop_agreement is not None:
            self.stop_agreement.begin()

    def after_create_session(self, session: tf.compat.v1.Session, coord: Any) -> None:
        """Runs the broadcast; then watches the session for a lost rank."""
        session.run(self.bcast_op)
        survivor.watch(session)


class SyncReplicasHook(tf.compat.v1.train.SessionRunHook):
    """Synchronous data-parallel training for a graph built with a plain optimizer.

    In `begin()` (before the graph is finalized) it calls `distribute_graph()`: the gradient of
    every optimizer update op is averaged (`op`) over all ranks. After the session exists it
    broadcasts `root_rank`'s global variables like BroadcastGlobalVariablesHook, unless
    `broadcast=False`. Every rank must use this hook on the same graph. With
    DistributedOptimizer in the graph too, gradients are still averaged once. `rewritten` is
    the number of update ops the last `begin()` rewrote.

    Ranks stop together: a stop requested by any hook on any rank stops every rank after the
    same step (perseus_legacy.tf1.stopping; the log names the hook). A rank whose session ends
    otherwise (end of its input) calls `perseus_legacy.join()`, so the steps the others are in
    still complete;
    a rank whose step ran a collective without a joined rank's data then stops too (the runtime
    reports it; no collective is added to the step). Steps that some ranks ran without the
    others are undone: every rank ends with the variables of the rank that completed the fewest
    steps, i.e. after the last step all ranks took part in (`steps` is then the same
    everywhere). A rank that fails with an exception fails the others. A step failing because
    a rank is lost makes the lowest surviving rank save the last completed step into rank 0's
    checkpoint directory (perseus_legacy.tf1.survivor), once the broadcast has run (with
    broadcast=False: a BroadcastGlobalVariablesHook's).

    Args:
      root_rank: the rank whose variables every rank starts from.
      broadcast: False: no broadcast after the session exists (the caller makes the ranks'
        variables equal some other way).
      op: how gradients are reduced: Average (default) or Sum.
      device: the device the broadcast ops are placed on.
    """

    def __init__(self, root_rank: int = 0, broadcast: bool = True, op: int = Average,
                 device: str = "") -> None:
        super().__init__()
        self.op = op
        self.rewritten = 0
        self.steps = 0
        self._broadcast = BroadcastGlobalVariablesHook(root_rank, device) if broadcast else None
        self._watch = False  # whether to stop when another rank has stopped
        self.stop_agreement = StopAgreement(order=0, peer_joined=self._stop_if_peer_joined)
        self._variables: list = []
        self._settled = False

    def begin(self) -> None:
        """Rewrites the default graph, then builds the broadcast op."""
        graph = tf.compat.v1.get_default_graph()
        self.rewritten = distribute_graph(graph, op=self.op)
        if self._broadcast is not None:
            self._broadcast.begin()
        self.steps, self._settled = 0, False
        self._variables = tf.compat.v1.global_variables()
        self._watch = basics.size() > 1
        self.stop_agreement.begin()

    def after_create_session(self, session: tf.compat.v1.Session, coord: Any) -> None:
        """Broadcasts the root rank's variables (unless broadcast=False)."""
        if self._broadcast is not None:  # it watches the session for a lost rank then
            self._broadcast.after_create_session(session, coord)
        if self._watch:
            basics.core().take_peer_joined()  # forgets what happened before this session

    def after_run(self, run_context: Any, run_values: Any) -> None:
        """Stops this rank, in step with the others, once another rank has joined."""
        self.steps += 1
        if self._stop_if_peer_joined(run_context.session):
            run_context.request_stop()

    def _stop_if_peer_joined(self, session: Any) -> bool:
        if self._watch and basics.core().take_peer_joined():
            self._settle(session)
            return True
        return self._settled

    def end(self, session: tf.compat.v1.Session) -> None:
        """Waits for every rank to stop, then makes every rank's variables equal."""
        self._settle(session)

    def _settle(self, session: Any) -> None:
        if self._settled or not self._watch:
            return
        self._settled = True
        self.stop_agreement.close()  # this rank joins: the others stop with it by the join
        basics.join()
        core = basics.core()
        steps = core.allgather(np.array([self.steps], np.int64), name="PerseusSync/steps")
        if (steps == steps[0]).all():
            return
        source = int(np.argmin(steps))  # the lowest rank among those with the fewest steps
        values = session.run(self._variables)
        for var, value in zip(self._variables, values):
            value = np.asarray(value)
            same = core.broadcast(value, source, name=f"PerseusSync/undo/{var.op.name}")
            var.load(same, session)
        self.steps = int(steps[source])

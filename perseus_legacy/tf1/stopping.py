"""Stop requests and hook failures agreed by every rank after each step of a MonitoredSession.

A SessionRunHook stops its own process only: `run_context.request_stop()` in after_run, and
MonitoredSession ends after that step; an exception raised by a hook's after_run (NanTensorHook's
NanLossDuringTrainingError) ends that process's training at once. On N ranks, one rank stopping
or failing alone would leave the others in the next step's collectives, failing with a lost peer
instead of the real cause. So after each step, once every hook's after_run has run
(perseus_legacy.tf_compat wraps `_HookedSession.run` to call `agree()` there, see
docs/session-hooks.md), every rank says in one small collective whether one of its hooks raised
or asked for a stop: a sync point of perseus_legacy.tf1.gate's GATE, the one the Estimator's
rank 0 keeps answering while it evaluates. When a hook raised on any rank, every rank raises
after that same step: that rank its own exception, the others the same class where this process
has it (built from the message), with a note naming the hook, the rank and the global step
(else a RuntimeError saying all of it). Otherwise, when any rank asked, every rank stops after
that step. Either way every rank logs which hook, on which rank, at which global step.

SyncReplicasHook and BroadcastGlobalVariablesHook (without a process set) hold a StopAgreement
as their `stop_agreement`; the tf_compat change uses the one of lowest `order` among a session's
hooks (a SyncReplicasHook's, which also stops this rank when another rank joined).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.tf1 import survivor
from perseus_legacy.tf1.gate import GATE

# What a rank says after a step (the highest wins: a raise outranks a stop).
_NOTHING, _ASKED, _RAISED = 0, 1, 2
_SEPARATOR = "\0"
_MAX_MESSAGE_CHARS = 2000


class StopAgreement:
    """One session's agreement on stopping; `order` ranks it among a session's agreements (the
    lowest is the one used: a SyncReplicasHook's, which also stops when a rank joined)."""

    def __init__(self, order: int, peer_joined: Callable[[Any], bool] | None = None) -> None:
        self.order = order
        self._peer_joined = peer_joined  # after the round: whether to stop because a rank joined
        self.active = False  # agrees only on more than one rank, and until it is closed
        self._global_step: Any = None
        self._steps = 0

    def begin(self) -> None:
        """Before the graph is finalized: arms the agreement of the session about to start."""
        self.active = basics.size() > 1
        self._global_step = tf.compat.v1.train.get_global_step()
        self._steps = 0

    def close(self) -> None:
        """This rank stops by other means (it joined): no agreement any more in this session."""
        self.active = False

    def agree(self, session: Any, asked: str | None,
              raised: tuple[str, Exception] | None = None) -> bool:
        """Whether every rank stops after this step: whether any rank's hook asked for a stop
        (`asked`: the class name of the first hook of this rank that did, or None). Raises when
        a hook raised in its after_run on any rank (`raised`: this rank's (hook class name,
        exception), or None): this rank's own exception, or the one of the lowest rank that
        had one."""
        self._steps += 1
        if raised is not None:
            hook, error = raised
            kind = type(error)
            code, payload = _RAISED, _SEPARATOR.join(
                (hook, kind.__module__, kind.__qualname__, str(error)[:_MAX_MESSAGE_CHARS]))
        else:
            code, payload = (_ASKED, asked) if asked else (_NOTHING, "")
        try:
            values, reason = GATE.agree(code, payload.encode())
        except Exception as error:  # a rank lost after its step: the step is complete
            survivor.report_lost_rank(error)
            raise
        if not values.any():
            return self._peer_joined is not None and self._peer_joined(session)
        highest = int(values.max())
        ranks = [int(r) for r in (values == highest).nonzero()[0]]
        step = self._steps
        if self._global_step is not None:
            step = int(session.run(self._global_step))
        where = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        if highest == _RAISED:
            hook, module, name, message = reason.decode().split(_SEPARATOR, 3)
            context = (f"perseus_legacy[rank {basics.rank()}]: {hook}.after_run raised {name} on "
                       f"{where} at global step {step}; every rank raises it after this step")
            print(context, flush=True)
            if raised is not None:
                raise raised[1]
            raise _the_same_error(module, name, message, context)
        print(f"perseus_legacy[rank {basics.rank()}]: {reason.decode()} on {where} requested a "
              f"stop at global step {step}; every rank stops after this step", flush=True)
        return True


def _the_same_error(module: str, name: str, message: str, context: str) -> Exception:
    """Another rank's hook exception: its class, when this process has it and it can be built
    from the message (a TensorFlow OpError: with no node and op), with `context` as a note
    (shown with the traceback; a class may ignore its message, as NanLossDuringTrainingError
    does), else a RuntimeError saying all."""
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, Exception):
        arguments = ((None, None, message) if issubclass(found, tf.errors.OpError)
                     else (message,))
        try:
            error = found(*arguments)
        except Exception:  # a constructor that needs more
            pass
        else:
            error.add_note(context)
            return error
    return RuntimeError(f"{context}: {name}: {message}")

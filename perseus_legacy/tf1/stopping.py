"""Stop requests agreed by every rank after each step of a MonitoredSession.

A SessionRunHook stops its own process only: `run_context.request_stop()` in after_run, and
MonitoredSession ends after that step. On N ranks, one rank stopping alone would leave the others
in the next step's collectives. So after each step, once every hook's after_run has run
(perseus_legacy.tf_compat wraps `_HookedSession.run` to call `agree()` there, see
docs/session-hooks.md), every rank says whether one of its hooks asked for a stop, in one small
collective: a sync point of perseus_legacy.estimator._gate's GATE, the one the Estimator's rank 0
keeps answering while it evaluates. When any rank asked, every rank stops after that same step
and logs which hook asked, on which rank, at which global step.

SyncReplicasHook and BroadcastGlobalVariablesHook (without a process set) hold a StopAgreement
as their `stop_agreement`; the tf_compat change uses the one of lowest `order` among a session's
hooks (a SyncReplicasHook's, which also stops this rank when another rank joined).
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.estimator._gate import GATE
from perseus_legacy.tf1 import survivor


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

    def agree(self, session: Any, asked: str | None) -> bool:
        """Whether every rank stops after this step: whether any rank's hook asked for a stop
        (`asked`: the class name of the first hook of this rank that did, or None)."""
        self._steps += 1
        name = (asked or "").encode()
        try:
            values, reason = GATE.agree(1 if asked else 0, name)
        except Exception as error:  # a rank lost after its step: the step is complete
            survivor.report_lost_rank(error)
            raise
        if not values.any():
            return self._peer_joined is not None and self._peer_joined(session)
        ranks = [int(r) for r in values.nonzero()[0]]
        step = self._steps
        if self._global_step is not None:
            step = int(session.run(self._global_step))
        where = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        print(f"perseus_legacy[rank {basics.rank()}]: {reason.decode()} on {where} requested a "
              f"stop at global step {step}; every rank stops after this step", flush=True)
        return True


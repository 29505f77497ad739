"""Change: a distributed MonitoredSession runs its file-writing hooks on rank 0 only.

Necessary on every TensorFlow: CheckpointSaverHook, SummarySaverHook, StepCounterHook and
ProfilerHook write into the directory they were given, on every process that runs them, and
MonitoredTrainingSession adds its own when it gets a checkpoint_dir. One process writes each
file once; N ranks given the same hooks would each write them (into one shared directory, the
same checkpoint N times over). A session is distributed when one of its hooks holds a stop
agreement (SyncReplicasHook, BroadcastGlobalVariablesHook): there, on ranks other than 0, the
wrapper of `_MonitoredSession.__init__` leaves those hooks out before any of them begins
(perseus_legacy.tf1.config.hooks_of_this_rank), as the distributed Estimator does.
"""

from __future__ import annotations

import functools
from typing import Any

TARGET = "monitored_session._MonitoredSession.__init__"
NECESSARY_SINCE = ("every TensorFlow (a file-writing hook writes on every process that runs "
                   "it)")
_DONE = "wrapped: file-writing hooks run on rank 0 only in a distributed session"


def rank_0_writes() -> str:
    """Wraps `_MonitoredSession.__init__`, once; returns what it did (compat_report())."""
    from tensorflow.python.training import monitored_session

    cls = monitored_session._MonitoredSession
    original = cls.__init__
    if getattr(original, "_perseus_original", None) is not None:
        return _DONE

    @functools.wraps(original)
    def __init__(self: Any, session_creator: Any, hooks: Any, *args: Any, **kwargs: Any) -> None:
        from perseus_legacy.tf1.config import hooks_of_this_rank

        original(self, session_creator, hooks_of_this_rank(hooks), *args, **kwargs)

    __init__._perseus_original = original
    cls.__init__ = __init__
    return _DONE

"""Change: MonitoredSession's `_HookedSession.run` agrees with the other ranks on stopping.

Necessary on every TensorFlow: a hook's `request_stop()` stops its own process, an exception
from a hook's after_run ends its own process's training, and MonitoredSession decides whether to
stop right after the step's after_run calls, with no place for a hook to act after the others.
The wrapper lets the hooks' after_run run as TensorFlow does, noting the class of the first hook
that asked for a stop, and holding back the exception of one that raised (the hooks after it
are not called, as in TensorFlow) until the ranks have agreed; then, when a hook of the session
holds a `stop_agreement` (perseus_legacy.tf1.stopping: SyncReplicasHook,
BroadcastGlobalVariablesHook), replaces the session's stop decision by that agreement's: every
rank stops, or raises, after the same step. Sessions without such a hook run unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

TARGET = "monitored_session._HookedSession.run"
NECESSARY_SINCE = ("every TensorFlow (a hook's request_stop, or its exception, ends its own "
                   "process only)")
# Not failures: MonitoredSession ends training normally on these, and a rank whose input ended
# stops through join() (they are raised at once, as without the agreement).
_ENDS_OF_INPUT = ("OutOfRangeError", "StopIteration")


class _Step:
    """What a step's hooks did on this rank: the first that asked for a stop, the first that
    raised (its class name and exception)."""

    def __init__(self) -> None:
        self.asked: str | None = None
        self.raised: tuple[str, Exception] | None = None


class _Watched:
    """A hook whose after_run is noted in the session's `_Step`."""

    def __init__(self, hook: Any, step: list) -> None:
        self._hook = hook
        self._step = step  # [the current _Step]

    def before_run(self, run_context: Any) -> Any:
        return self._hook.before_run(run_context)

    def after_run(self, run_context: Any, run_values: Any) -> None:
        step = self._step[0]
        if step.raised is not None:
            return  # TensorFlow calls no after_run after one that raised
        before = run_context.stop_requested
        try:
            self._hook.after_run(run_context, run_values)
        except Exception as error:
            if type(error).__name__ in _ENDS_OF_INPUT:
                raise
            step.raised = (type(self._hook).__name__, error)
            return
        if run_context.stop_requested and not before and step.asked is None:
            step.asked = type(self._hook).__name__


def _agreement_of(hooked: Any) -> Any:
    """The session's agreement (set up once per _HookedSession: its hooks get watched)."""
    try:
        return hooked._perseus_agreement
    except AttributeError:
        pass
    found = [a for a in (getattr(h, "stop_agreement", None) for h in hooked._hooks)
             if a is not None]
    agreement = min(found, key=lambda a: a.order) if found else None
    hooked._perseus_agreement = agreement
    if agreement is not None:
        hooked._perseus_step = [_Step()]
        hooked._hooks = [_Watched(h, hooked._perseus_step) for h in hooked._hooks]
    return agreement


def agree_on_stopping() -> str:
    """Wraps `_HookedSession.run`, once; returns what it did (compat_report())."""
    from tensorflow.python.training import monitored_session

    cls = monitored_session._HookedSession
    original = cls.run
    if getattr(original, "_perseus_original", None) is not None:
        return "wrapped: stop requests agreed by every rank after each step"

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        agreement = _agreement_of(self)
        if agreement is None:
            return original(self, *args, **kwargs)
        step = self._perseus_step[0] = _Step()
        outputs = original(self, *args, **kwargs)
        if agreement.active:  # raises when a hook raised on any rank
            self._should_stop = agreement.agree(self._sess, step.asked, step.raised)
        elif step.raised is not None:
            raise step.raised[1]
        return outputs

    run._perseus_original = original
    cls.run = run
    return "wrapped: stop requests agreed by every rank after each step"

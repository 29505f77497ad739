"""Change: MonitoredSession's `_HookedSession.run` agrees with the other ranks on stopping.

Necessary on every TensorFlow: a hook's `request_stop()` stops its own process, and
MonitoredSession decides whether to stop right after the step's after_run calls, with no place
for a hook to act after the others. The wrapper lets the hooks' after_run run as TensorFlow
does, noting the class of the first hook that asked for a stop, then, when a hook of the session
holds a `stop_agreement` (perseus_legacy.tf1.stopping: SyncReplicasHook,
BroadcastGlobalVariablesHook), replaces the session's stop decision by that agreement's: every
rank stops after the same step. Sessions without such a hook run unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

TARGET = "monitored_session._HookedSession.run"
NECESSARY_SINCE = "every TensorFlow (a hook's request_stop stops its own process only)"


class _Watched:
    """A hook whose after_run notes its class name in `asked` when it requests the stop."""

    def __init__(self, hook: Any, asked: list) -> None:
        self._hook = hook
        self._asked = asked

    def before_run(self, run_context: Any) -> Any:
        return self._hook.before_run(run_context)

    def after_run(self, run_context: Any, run_values: Any) -> None:
        before = run_context.stop_requested
        self._hook.after_run(run_context, run_values)
        if run_context.stop_requested and not before:
            self._asked.append(type(self._hook).__name__)


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
        hooked._perseus_asked = []
        hooked._hooks = [_Watched(h, hooked._perseus_asked) for h in hooked._hooks]
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
        asked = self._perseus_asked
        asked.clear()
        outputs = original(self, *args, **kwargs)
        if agreement.active:
            self._should_stop = agreement.agree(self._sess, asked[0] if asked else None)
        return outputs

    run._perseus_original = original
    cls.run = run
    return "wrapped: stop requests agreed by every rank after each step"

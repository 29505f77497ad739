"""A rank's program fails: every rank learns it at once, with its cause.

Without this, a rank whose Python program dies (an uncaught exception, a TensorFlow op error
that ends its training) leaves the others waiting on collectives it will never join: they learn
only that it shut down or closed its connections, not why. report() hands the cause to the
runtime (`_core.abort`), which tells every rank as it does for a failure of its own, so each
rank's pending and later collectives fail with `perseus_legacy: rank R failed: <Type>: <message>`.

init() installs a sys.excepthook that reports an uncaught exception (then runs the hook that
was in place); perseus_legacy.tf1.survivor reports the error with which a MonitoredSession
closes, unless every rank's session closes with an error of its own within
survivor.STEP_ERROR_AGREEMENT_SECS (5 s) of the others, each having submitted as many
collectives (a bad batch on every rank): then no rank is failed, each program gets its own
error, and one that catches it may train again. An error on some ranks only fails every rank
once that wait runs out, since the others wait in the step for the failed ones. An exception
the program catches otherwise is not reported. Survivors save no checkpoint after such a
failure (unlike after a lost peer): the failure may lie in the state a save would write.
"""

from __future__ import annotations

import re
import sys
from types import TracebackType

from perseus_legacy.common import native

# Normal ends of a loop, not failures.
_NOT_FAILURES = ("OutOfRangeError", "StopIteration", "GeneratorExit")
_MAX_MESSAGE_CHARS = 2000
# A traceback's frame lines, and where TensorFlow appends the stack that built the failing op.
_FRAME = re.compile(r'\s*File "')
_TRACE_START = "\nOriginal stack trace for"

_previous_hook = None


def describe(error: BaseException) -> str:
    """`<Type>: <message>` on one line: a TensorFlow op error's `.message`, anything else's
    str(), without the stack traces TensorFlow puts into its messages."""
    message = getattr(error, "message", None)
    if not isinstance(message, str):
        message = str(error)
    message = message.split(_TRACE_START, 1)[0]
    lines = (line.strip() for line in message.splitlines() if not _FRAME.match(line))
    message = " ".join(line for line in lines if line)[:_MAX_MESSAGE_CHARS]
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def report(error: BaseException) -> None:
    """Tells every rank that this rank failed with `error`; a no-op for the normal end of a
    loop, before init(), after shutdown() and once the runtime has stopped (after a lost peer
    or another rank's failure, which every rank knows already)."""
    if type(error).__name__ in _NOT_FAILURES or not native.is_initialized():
        return
    core = native.core()
    rank = core.rank()
    if rank < 0:
        return
    core.abort(f"rank {rank} failed: {describe(error)}")


def _excepthook(kind: type[BaseException], error: BaseException,
                traceback: TracebackType | None) -> None:
    try:
        report(error)  # first: the other ranks are waiting on this one
    finally:
        (_previous_hook or sys.__excepthook__)(kind, error, traceback)


def install() -> None:
    """Reports uncaught exceptions from now on (once per process); the hook in place still runs,
    after the report."""
    global _previous_hook
    if sys.excepthook is _excepthook:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook

"""Change: ProfilerHook opens its summary writer when it begins, not in its constructor.

Necessary on every TensorFlow: `ProfilerHook.__init__` calls `SummaryWriterCache.get(output_dir)`,
which creates output_dir and an events file at once. Of N ranks only rank 0 runs a ProfilerHook
(the distributed Estimator and MonitoredSession leave the file-writing hooks out on the others),
but every rank builds one when the model_fn or the program does: each other rank would leave an
events file behind.
The constructor stays TensorFlow's own code, run with a module namespace in which
`SummaryWriterCache.get` returns a writer not opened yet; `begin()` (a session starting with the
hook) opens the real one, from the same cache, with the graph that was the default at
construction, before the hook writes its timelines there: a hook that never runs opens
nothing, one that runs writes as before.
"""

from __future__ import annotations

import functools
import types
from typing import Any

TARGET = "basic_session_run_hooks.ProfilerHook"
NECESSARY_SINCE = ("every TensorFlow (its constructor opens a summary writer, an events file, "
                   "in output_dir)")
_DONE = "wrapped: its summary writer opens when it begins"


class _WriterOnFirstUse:
    """The summary writer of `logdir`, opened (FileWriterCache.get) by open() or first use."""

    def __init__(self, logdir: str) -> None:
        import tensorflow as tf

        self._logdir = logdir
        self._graph = tf.compat.v1.get_default_graph()
        self._writer: Any = None

    def open(self) -> Any:
        if self._writer is None:
            from tensorflow.python.summary.writer.writer_cache import FileWriterCache

            with self._graph.as_default():  # the graph the writer records, as if opened then
                self._writer = FileWriterCache.get(self._logdir)
        return self._writer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.open(), name)


class _CacheOnFirstUse:
    """Stands for SummaryWriterCache in the constructor's namespace."""

    @staticmethod
    def get(logdir: str) -> _WriterOnFirstUse:
        return _WriterOnFirstUse(logdir)


def open_writer_on_first_use() -> str:
    """Replaces ProfilerHook's constructor and wraps its begin(), once; returns what it did
    (compat_report())."""
    from tensorflow.python.training import basic_session_run_hooks

    cls = basic_session_run_hooks.ProfilerHook
    original = cls.__init__
    if getattr(original, "_perseus_original", None) is not None:
        return _DONE
    if "SummaryWriterCache" not in original.__code__.co_names:
        return "present in TensorFlow (its constructor opens no writer)"
    namespace = dict(original.__globals__, SummaryWriterCache=_CacheOnFirstUse)
    init = types.FunctionType(original.__code__, namespace, original.__name__,
                              original.__defaults__, original.__closure__)
    init.__kwdefaults__ = original.__kwdefaults__
    functools.update_wrapper(init, original)
    init._perseus_original = original
    original_begin = cls.begin

    @functools.wraps(original_begin)
    def begin(self: Any) -> None:
        original_begin(self)
        writer = getattr(self, "_file_writer", None)
        if isinstance(writer, _WriterOnFirstUse):  # output_dir exists before a timeline
            self._file_writer = writer.open()

    begin._perseus_original = original_begin
    cls.__init__ = init
    cls.begin = begin
    return _DONE

"""Preemption: a scheduler's warning signal ends training at one step that every rank agrees on.

Slurm signals a job before it ends it (`sbatch --signal=B:USR1@30`, `scancel --signal=USR1`,
SIGTERM at `scancel` or the time limit); Kubernetes sends SIGTERM before it kills a pod. With
PreemptionHook in the training session, such a signal no longer kills a rank mid-step: each
step's run carries one small allreduce (Max) of "a signal arrived here", so the ranks that got
it and those that did not yet stop after the same step. The session then ends normally: rank 0's
CheckpointSaverHook (MonitoredTrainingSession, Estimator) writes the whole checkpoint of that
step (to temporary files, renamed when complete), and a rerun resumes from it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable

import tensorflow as tf

from perseus_legacy.common import basics
from perseus_legacy.tensorflow import collectives as ops

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHook(tf.compat.v1.train.SessionRunHook):
    """Stops training on every rank after the step in which any rank received one of `signals`.

    Every rank must use it (its allreduce runs in each step). After training, `preempted` is
    the name of the signal that stopped it (None when training ended otherwise) and
    `stopped_at_step` the global step reached; a program may exit with a non-zero code then, so
    that `sbatch --requeue` or a restart policy runs it again. The signal handlers are installed
    when the session starts (on the main thread only). When training ended otherwise, the
    previous ones are restored when the session closes (after every hook's `end()`, the final
    checkpoint's included), also when a step's error ends training (TensorFlow then calls no
    hook's `end()`): a signal after training reaches the handler that was there before (by
    default SIGTERM ends the process). When a signal stopped training, they stay: schedulers
    repeat the signal (Slurm's time limit signals both the step and `srun`, which forwards it),
    and the rank, already stopping, finishes its checkpoint and exits by itself; the
    scheduler's kill after its grace period remains the bound. `restore_signal_handlers()` puts
    the previous ones back then. The handler only records the signal; `signal_received` is set
    by the first one, and a second signal arriving while the first is handled touches no lock.
    """

    def __init__(self, signals: Iterable[int] = PREEMPTION_SIGNALS) -> None:
        self._signals = tuple(signals)
        self._received: list[int] = []
        self.signal_received = threading.Event()  # set on this rank by the first signal
        self._previous: dict = {}
        self.preempted: str | None = None
        self.stopped_at_step: int | None = None

    def begin(self) -> None:
        basics.require_initialized("PreemptionHook")
        self._flag = tf.compat.v1.placeholder_with_default(tf.constant(0, tf.int32), [],
                                                           name="preemption_signal_here")
        self._anywhere = ops.allreduce(self._flag, op=basics.Max, name="preemption_signal")
        self._step = tf.compat.v1.train.get_global_step()
        if threading.current_thread() is threading.main_thread():
            for signum in self._signals:  # still installed after a preemption: keep the first
                self._previous.setdefault(signum, signal.signal(signum, self._on_signal))
        else:
            print("perseus_legacy: PreemptionHook: training runs outside the main thread, where "
                  "Python cannot catch signals; preemption signals end this rank as before",
                  file=sys.stderr, flush=True)

    def _on_signal(self, signum: int, _frame: object) -> None:
        first = not self._received
        self._received.append(signum)
        if first:  # Event.set() takes a lock a nested handler must not wait for
            self.signal_received.set()

    def after_create_session(self, session, coord) -> None:
        # A step's error closes the session without end(): restore the handlers there too.
        close = session.close

        def close_and_restore() -> None:
            try:
                close()
            finally:
                if self.preempted is None:
                    self.restore_signal_handlers()

        session.close = close_and_restore

    def restore_signal_handlers(self) -> None:
        """Puts back the handlers this hook replaced (once; on the main thread, which alone
        may set them)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def before_run(self, run_context) -> tf.compat.v1.train.SessionRunArgs:
        here = self._received[0] if self._received else 0
        return tf.compat.v1.train.SessionRunArgs({"anywhere": self._anywhere},
                                                 feed_dict={self._flag: here})

    def after_run(self, run_context, run_values) -> None:
        signum = int(run_values.results["anywhere"])
        if signum and self.preempted is None:
            self.preempted = signal.Signals(signum).name
            run_context.request_stop()

    def end(self, session) -> None:
        if self.preempted is None:
            return
        if self._step is not None:
            self.stopped_at_step = int(session.run(self._step))
        rank = basics.rank()
        saved = "rank 0 saves the checkpoint of that step" if rank == 0 else "rank 0 saves it"
        print(f"perseus_legacy[rank {rank}]: preempted by {self.preempted}: training stopped "
              f"on every rank after global step {self.stopped_at_step}; {saved}", flush=True)

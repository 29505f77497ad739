"""A training step's own error, caught by the program (tests/test_faults_abort.py).

    perseusrun --tcp -np 2 python fault_step_error.py DIR

An unchanged Estimator with run_config() and a PreemptionHook, restart_estimator's model and
data (2 ranks), runs these cases one after another in one job; each prints
`[rank R] CASE <name>: OK <detail>` or `[rank R] CASE <name>: FAILED <why>`:

- every_rank: the batch of global step BAD_STEP is bad on every rank (an InvalidArgumentError
  before any collective of that step). The program catches the error of `train()`, which
  fails no rank, and trains again: it resumes from rank 0's checkpoint of step EVERY and ends
  with numpy's variables on the same global batches.
- sigterm_after_error: SIGTERM sent to this process after that error reaches the handler that
  was in place before training (the PreemptionHook's is gone although its end() never ran).
- repeated_signal: SIGTERM on rank 1 after step SIGNAL_STEP stops both ranks after step
  SIGNAL_STEP + 1, and SIGTERM again while the session ends (a hook's `end()` after the
  PreemptionHook's) and after train() returns, as Slurm's time limit repeats it: the rank lives
  on, rank 0's checkpoint of that step is there, and the hook's handler stays until the program
  calls `restore_signal_handlers()`, which puts back the one in place before training.
- one_rank: step BAD_STEP is bad on rank 1 only, which catches the error and trains again.
  Rank 0, waiting in that step, fails naming rank 1 and its error: `OK after S s: <error>`
  (S: seconds from its last completed step); rank 1's retry fails, and it says how. Both
  programs catch what they get: the job exits 0.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as pl

import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import restart_estimator
from restart_estimator import EVERY, TOTAL_STEPS, input_fn, reference
from worker_util import one_thread_estimator, wait_until

BAD_STEP = 6
SIGNAL_STEP = 4  # the preemption stops training after step 5, no checkpoint step of EVERY
REPORT_WAIT_SECS = 60


def model_fn_with_bad_step(bad_ranks: tuple):
    """restart_estimator's model, whose input fails (InvalidArgumentError) at BAD_STEP on
    `bad_ranks`."""

    def model_fn(features, labels, mode):
        x = features["x"]
        if pl.rank() in bad_ranks:
            step = tf.compat.v1.train.get_global_step()
            check = tf.debugging.Assert(tf.not_equal(step, BAD_STEP), [step], name="bad_batch")
            with tf.control_dependencies([check]):
                x = tf.identity(x)
        return restart_estimator.model_fn({"x": x}, labels, mode)

    return model_fn


class LastStep(tf.compat.v1.train.SessionRunHook):
    """When this rank's last step completed (monotonic seconds)."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    def after_run(self, run_context, run_values) -> None:
        self.at = time.monotonic()


class FinalValues(tf.compat.v1.train.SessionRunHook):
    """The variables at the end of training, by name (every rank: rank 0 alone writes model_dir)."""

    def begin(self) -> None:
        self._variables = tf.compat.v1.global_variables()
        self.values: dict = {}

    def end(self, session) -> None:
        values = session.run(self._variables)
        self.values = {v.op.name: value for v, value in zip(self._variables, values)}


def estimator(model_dir: str, bad_ranks: tuple) -> tf.estimator.Estimator:
    return one_thread_estimator(model_fn_with_bad_step(bad_ranks), model_dir, EVERY)


def say(rank: int, case: str, verdict: str) -> None:
    print(f"[rank {rank}] CASE {case}: {verdict}", flush=True)


def every_rank(out: str, rank: int) -> None:
    seen: list = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        est = estimator(os.path.join(out, "every_rank"), bad_ranks=(0, 1))
        try:
            est.train(input_fn(rank), max_steps=TOTAL_STEPS, hooks=[pl.PreemptionHook()])
            return say(rank, "every_rank", "FAILED: the bad step raised nothing")
        except tf.errors.InvalidArgumentError as error:
            print(f"[rank {rank}] CAUGHT {type(error).__name__} at step {BAD_STEP}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: bool(seen), 10)
        say(rank, "sigterm_after_error", "OK" if seen else
            f"FAILED: SIGTERM did not reach the handler in place before training "
            f"({signal.getsignal(signal.SIGTERM)} holds it)")
    finally:
        signal.signal(signal.SIGTERM, previous)
    est, final = estimator(os.path.join(out, "every_rank"), bad_ranks=()), FinalValues()
    try:
        est.train(input_fn(rank), max_steps=TOTAL_STEPS, hooks=[final])
    except Exception as error:  # the retry itself must work
        return say(rank, "every_rank", f"FAILED: the retry raised {type(error).__name__}: {error}")
    expected = reference([2] * TOTAL_STEPS)[-1]
    problems = []
    for name, want in expected.items():
        got = final.values.get(name)
        if got is None or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            problems.append(f"{name} = {got}, numpy {want}")
    say(rank, "every_rank", f"FAILED: {'; '.join(problems)}" if problems else
        f"OK: trained again to step {TOTAL_STEPS}, numpy's variables")


class SignalAt(tf.compat.v1.train.SessionRunHook):
    """Sends SIGTERM to this process after global step `step` (on `ranks`) and in its `end()`."""

    def __init__(self, step: int, ranks: tuple) -> None:
        self._at, self._ranks = step, ranks

    def begin(self) -> None:
        self._step = tf.compat.v1.train.get_global_step()

    def after_run(self, run_context, run_values) -> None:
        if pl.rank() in self._ranks and run_context.session.run(self._step) == self._at:
            os.kill(os.getpid(), signal.SIGTERM)

    def end(self, session) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def repeated_signal(out: str, rank: int) -> None:
    model_dir = os.path.join(out, "repeated_signal")
    before = signal.getsignal(signal.SIGTERM)
    preemption = pl.PreemptionHook()
    estimator(model_dir, bad_ranks=()).train(
        input_fn(rank), max_steps=TOTAL_STEPS,
        hooks=[preemption, SignalAt(SIGNAL_STEP, ranks=(1,))])
    os.kill(os.getpid(), signal.SIGTERM)  # reaches the hook's handler (or ends this rank)
    stop = SIGNAL_STEP + 1
    saved = tf.train.latest_checkpoint(model_dir)
    problems = []
    if (preemption.preempted, preemption.stopped_at_step) != ("SIGTERM", stop):
        problems.append(f"stopped by {preemption.preempted} at {preemption.stopped_at_step}")
    if rank == 0 and not (saved or "").endswith(f"-{stop}"):
        problems.append(f"rank 0's last checkpoint is {saved}")
    if signal.getsignal(signal.SIGTERM) == before:
        problems.append("the handler in place before training is back")
    preemption.restore_signal_handlers()
    if signal.getsignal(signal.SIGTERM) != before:
        problems.append(f"restore_signal_handlers() left {signal.getsignal(signal.SIGTERM)}")
    say(rank, "repeated_signal", f"FAILED: {'; '.join(problems)}" if problems else
        f"OK: alive after 3 SIGTERMs, stopped at step {stop}")


def one_rank(out: str, rank: int) -> None:
    est = estimator(os.path.join(out, "one_rank"), bad_ranks=(1,))
    last = LastStep()
    try:
        est.train(input_fn(rank), max_steps=TOTAL_STEPS, hooks=[last])
        return say(rank, "one_rank", "FAILED: training ended normally")
    except Exception as error:
        secs = time.monotonic() - last.at
        message = " ".join(str(getattr(error, "message", error)).split())[:400]
    if rank == 0:
        return say(rank, "one_rank", f"OK after {secs:.1f} s: {message}")
    try:  # the program catches its error and trains again
        est.train(input_fn(rank), max_steps=TOTAL_STEPS)
        say(rank, "one_rank", "FAILED: the retry on rank 1 alone succeeded")
    except Exception as again:
        say(rank, "one_rank", f"OK: the retry failed: {type(again).__name__}")


def main() -> None:
    out = sys.argv[1]
    pl.init()
    rank = pl.rank()
    every_rank(out, rank)
    repeated_signal(out, rank)
    one_rank(out, rank)
    # Rank 0's failure ends the job: first let each rank say what it saw (bounded).
    open(os.path.join(out, f"done.{rank}"), "w").close()
    wait_until(lambda: all(os.path.exists(os.path.join(out, f"done.{r}")) for r in range(2)),
               REPORT_WAIT_SECS)


if __name__ == "__main__":
    main()

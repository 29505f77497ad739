"""An Estimator job that a preemption signal stops mid-training (tests/test_slurm.py).

Usage: slurm_preempt.py MODEL_DIR     (every task of a Slurm step)

The model, data and checkpoints every EVERY steps are fault_checkpoint.py's, with
perseus_legacy.PreemptionHook added. After global step WAIT_STEP every rank prints `[rank R]
waiting for the preemption signal` and waits for it (the test then runs `scancel --signal`), so
the signal lands mid-training on every rank. The job must stop after step WAIT_STEP + 1 on every
rank, with rank 0's checkpoint of that step; each rank prints `[rank R] PREEMPTED ...` and
exits 0. fault_checkpoint.py's `resume` phase is the rerun.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import sys

import tensorflow as tf
from fault_checkpoint import TOTAL_STEPS, input_fn, make_estimator

WAIT_STEP = 4  # not a checkpoint step: the step after it is saved only by the preemption
WAIT_SECONDS = 120


class WaitForSignal(tf.compat.v1.train.SessionRunHook):
    """After WAIT_STEP, holds this rank until the preemption hook has seen a signal."""

    def __init__(self, rank: int, preemption: pl.PreemptionHook) -> None:
        self._rank = rank
        self._preemption = preemption

    def begin(self) -> None:
        self._step = tf.compat.v1.train.get_global_step()

    def after_run(self, run_context, run_values) -> None:
        if run_context.session.run(self._step) != WAIT_STEP:
            return
        print(f"[rank {self._rank}] waiting for the preemption signal", flush=True)
        if not self._preemption.signal_received.wait(WAIT_SECONDS):
            print(f"[rank {self._rank}] UNEXPECTED: no signal within {WAIT_SECONDS} s", flush=True)
            sys.exit(2)


def main() -> None:
    model_dir = sys.argv[1]
    estimator = make_estimator(model_dir, "preempt")
    rank, size = pl.rank(), pl.size()
    preemption = pl.PreemptionHook()
    estimator.train(input_fn(rank, size), max_steps=TOTAL_STEPS,
                    hooks=[preemption, WaitForSignal(rank, preemption)])
    if preemption.preempted is None:
        print(f"[rank {rank}] UNEXPECTED: trained to step {TOTAL_STEPS} unpreempted", flush=True)
        sys.exit(2)
    print(f"[rank {rank}] PREEMPTED by {preemption.preempted} at step "
          f"{preemption.stopped_at_step}", flush=True)


if __name__ == "__main__":
    main()

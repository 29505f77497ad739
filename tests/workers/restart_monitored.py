"""MonitoredTrainingSession + SyncReplicasHook, unchanged, hit by a lost rank (test_restarts.py).

Usage: restart_monitored.py MODEL_DIR [kill|forge]

The documented pattern: `checkpoint_dir=pl.checkpoint_dir(MODEL_DIR)` (rank 0 saves every EVERY
steps) and `pl.SyncReplicasHook()`. The last rank kills itself (SIGKILL) once global step
FAULT_STEP is done; the survivors fail at their next step, rank 0 saving step FAULT_STEP into
MODEL_DIR first (perseus_legacy.tf1.survivor). With `forge`, it writes a forged abort notice
into its control connection to rank 0 instead (tcp_forge.py), as a party on the path could:
nobody is lost, the job fails. The model and data are restart_estimator's: the
step picks its global batch, the pool's first size() * PER_RANK rows.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as pl

import os
import signal
import sys

import tensorflow as tf

from tcp_forge import write_forged_frame
from restart_estimator import (
    EVERY,
    FAULT_STEP,
    LEARNING_RATE,
    MOMENTUM,
    PER_RANK,
    TOTAL_STEPS,
    initial_values,
    pools,
)


class FaultAfterStep(tf.compat.v1.train.SessionRunHook):
    """Kills this rank (SIGKILL), or forges a frame to rank 0, once global step FAULT_STEP is
    done."""

    def __init__(self, step: tf.Variable, fault: str | None) -> None:
        self._step, self._fault = step, fault

    def after_run(self, run_context, run_values) -> None:
        if self._fault and run_context.session.run(self._step) == FAULT_STEP:
            if self._fault == "forge":
                print(f"[rank {pl.rank()}] FORGED a frame after step {FAULT_STEP}", flush=True)
                write_forged_frame("abort", os.environ["PERSEUS_TCP_ADDRESSES"].split(",")[0])
                self._fault = None
                return
            print(f"[rank {pl.rank()}] KILLED after step {FAULT_STEP}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    model_dir, fault = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "kill")
    tf.compat.v1.disable_eager_execution()
    pl.init()
    rank, size = pl.rank(), pl.size()
    x, y = pools()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    step = tf.compat.v1.train.get_or_create_global_step()
    features, labels = tf.gather(x[:, rows], step), tf.gather(y[:, rows], step)
    init = initial_values(rank)
    w = tf.compat.v1.get_variable("w", initializer=tf.constant(init["w"]))
    b = tf.compat.v1.get_variable("b", initializer=tf.constant(init["b"]))
    loss = tf.compat.v1.losses.mean_squared_error(labels, tf.matmul(features, w) + b)
    train_op = tf.compat.v1.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM).minimize(
        loss, global_step=step)
    hooks = [pl.SyncReplicasHook(), tf.compat.v1.train.StopAtStepHook(last_step=TOTAL_STEPS),
             FaultAfterStep(step, fault if rank == size - 1 else None)]
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=pl.checkpoint_dir(model_dir), save_checkpoint_steps=EVERY,
            save_summaries_steps=None, save_summaries_secs=None, log_step_count_steps=None,
            hooks=hooks, config=config) as session:
        while not session.should_stop():
            session.run(train_op)
    print(f"[rank {rank}] UNEXPECTED: trained to the end", flush=True)
    sys.exit(2)


if __name__ == "__main__":
    main()

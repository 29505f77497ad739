"""Runs on every rank: a job killed after a checkpoint restarts from it.

argv[1]: a directory shared by all ranks (rank 0's checkpoints); argv[2]: the phase.
  kill   - trains with SyncReplicasHook, rank 0 checkpointing every EVERY steps; the last rank
           kills itself (SIGKILL) once global step KILL_AT is reached. The job must fail.
  resume - a new job, every rank starting from other random values: training resumes at
           rank 0's last checkpoint (step SAVED) on every rank, identical variables, and ends at
           TOTAL steps equal to single-process training for TOTAL steps.
The data of step s is global batch s (train_models.py), so the two jobs together train exactly
like one uninterrupted run.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import os
import signal
import sys

import numpy as np
import tensorflow as tf
from train_models import (ATOL, CONFIG, OPTIMIZERS, RTOL, VAR_NAMES, build_model,
                          initial_values, local_batch, reference)
from worker_util import assert_close, fail

EVERY, KILL_AT, TOTAL = 3, 7, 10
SAVED = KILL_AT - KILL_AT % EVERY  # the last checkpoint before the kill


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    root, phase = os.path.join(sys.argv[1], "ckpt"), sys.argv[2]
    seed = rank + (100 if phase == "resume" else 0)  # a restarted rank starts elsewhere
    with tf.Graph().as_default():
        ids, targets, loss, global_step, variables = build_model(initial_values(seed))
        train = OPTIMIZERS["adam"]().minimize(loss, global_step=global_step)
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=pl.checkpoint_dir(root), hooks=[pl.SyncReplicasHook()],
                config=CONFIG, save_checkpoint_steps=EVERY, save_summaries_steps=None,
                log_step_count_steps=None) as sess:
            raw = sess._tf_sess()
            step = int(raw.run(global_step))
            if phase == "resume":
                assert_close(rank, "global step after the restart", np.int64(step),
                             np.int64(SAVED))
                saved = tf.train.load_checkpoint(os.path.join(root, f"model.ckpt-{SAVED}"))
                for var, name in zip(raw.run(variables), VAR_NAMES):
                    assert_close(rank, f"{name} after the restart", var,
                                 saved.get_tensor(name), rtol=0.0)
            while step < TOTAL:
                if phase == "kill" and step == KILL_AT and rank == size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                batch_ids, batch_targets = local_batch(step, rank, size)
                sess.run(train, {ids: batch_ids, targets: batch_targets})
                step += 1
            final = raw.run(variables + [global_step])
    if phase == "kill":
        fail(rank, f"trained to step {TOTAL}: the last rank was not killed")
    assert_close(rank, "final global step", final[-1], np.int64(TOTAL))
    for name, got, want in zip(VAR_NAMES, final, reference("adam", TOTAL)):
        assert_close(rank, f"resumed training: {name}", got, want, rtol=RTOL, atol=ATOL)
    print(f"[rank {rank}] OK: resumed at step {SAVED}, ended at {TOTAL}", flush=True)


if __name__ == "__main__":
    main()

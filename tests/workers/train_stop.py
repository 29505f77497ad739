"""Runs on every rank: ranks that stop at different times under SyncReplicasHook all end at the
same step, with the variables of single-process training on the steps every rank took part in.

argv[1]: a directory shared by all ranks (rank 0's checkpoints); argv[2]: the scenario.
  short-first - rank 0 has SHORT batches of data, the others LONG
  short-last  - the last rank has SHORT batches, the others (rank 0 included) LONG
  stop-hook   - every rank has LONG batches; the last rank alone has StopAtStepHook(SHORT)
Model, data and reference are those of train_models.py, with Adam, whose slots must be undone
too. Each rank reads its input from a tf.data pipeline, so the end of data is an
OutOfRangeError inside a step.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import os
import sys

import numpy as np
import tensorflow as tf
from train_models import (ATOL, CONFIG, OPTIMIZERS, RTOL, VAR_NAMES, build_model,
                          initial_values, local_batch, reference)
from worker_util import assert_close, barrier, fail

SHORT, LONG = 4, 6


class ReadAtEnd(tf.compat.v1.train.SessionRunHook):
    """Reads tensors in end(), after the hooks before it (a rank whose input ended leaves the
    `with` block through the OutOfRangeError MonitoredSession swallows)."""

    def __init__(self, tensors: list) -> None:
        self.tensors, self.values = tensors, None

    def end(self, session) -> None:
        self.values = session.run(self.tensors)


def batches(scenario: str, rank: int, size: int) -> int:
    short_rank = {"short-first": 0, "short-last": size - 1}.get(scenario)
    return SHORT if rank == short_rank else LONG


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    root, scenario = os.path.join(sys.argv[1], "ckpt"), sys.argv[2]
    count = batches(scenario, rank, size)
    data = [local_batch(step, rank, size) for step in range(count)]
    with tf.Graph().as_default():
        dataset = tf.compat.v1.data.Dataset.from_tensor_slices(
            (np.stack([d[0] for d in data]), np.stack([d[1] for d in data])))
        inputs = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        _, _, loss, global_step, variables = build_model(initial_values(rank), 7 * rank, inputs)
        train = OPTIMIZERS["adam"]().minimize(loss, global_step=global_step)
        hook = pl.SyncReplicasHook()
        final = ReadAtEnd(variables + [global_step])
        hooks = [hook, final]
        if scenario == "stop-hook" and rank == size - 1:
            hooks.append(tf.compat.v1.train.StopAtStepHook(last_step=SHORT))
        runs = 0
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=pl.checkpoint_dir(root), hooks=hooks, config=CONFIG,
                save_checkpoint_steps=1, save_summaries_steps=None,
                log_step_count_steps=None) as sess:
            while not sess.should_stop():
                sess.run(train)
                runs += 1
    final = final.values
    what = f"{scenario}, {count} batches here"
    if runs > LONG:
        fail(rank, f"{what}: {runs} steps ran, more than any rank's data")
    assert_close(rank, f"{what}: final global step", final[-1], np.int64(SHORT))
    if hook.steps != SHORT:
        fail(rank, f"{what}: the hook counts {hook.steps} steps, expected {SHORT}")
    expected = reference("adam", SHORT)
    for name, got, want in zip(VAR_NAMES, final, expected):
        assert_close(rank, f"{what}: {name}", got, want, rtol=RTOL, atol=ATOL)
    barrier("stopped")  # rank 0's session is closed: its last checkpoint is written
    latest = tf.train.latest_checkpoint(root)
    if latest is None or not latest.endswith(f"-{SHORT}"):
        fail(rank, f"{what}: rank 0's latest checkpoint is {latest}, expected step {SHORT}")
    reader = tf.train.load_checkpoint(latest)
    for name, want in zip(VAR_NAMES, expected):
        assert_close(rank, f"{what}: checkpoint {name}", reader.get_tensor(name), want,
                     rtol=RTOL, atol=ATOL)
    barrier("checked")
    print(f"[rank {rank}] OK: {scenario}: ran {runs} steps, all ranks end at step {SHORT}",
          flush=True)


if __name__ == "__main__":
    main()

"""An Estimator whose model_fn logs its loss with tf.summary, trained with run_config() on every
rank (perseusrun): the summaries of Estimator code as TensorBoard shows them.

Usage: est_summary.py OUT_DIR

The model_fn calls both summary APIs of Estimator code: tf.compat.v1.summary.scalar (written by
the Estimator's SummarySaverHook every step here) and tf.summary.scalar (TensorFlow >= 2.21 no
longer installs TensorBoard, which implements it: without it the call raises). Each rank passes
OUT_DIR/fs_of_rank<r>/model as model_dir (its own view of a shared directory) and writes
OUT_DIR/rank<r>.json: the model_dir its Estimator used and the files there and in its view,
listed before the process exits (a private model_dir is removed at exit). The pytest side
(tests/estimator/test_estimator_summaries.py) reads rank 0's event file and checks the losses
with numpy.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import json
import os
import sys

import numpy as np
import tensorflow as tf
from worker_util import files_under

STEPS = 5
GLOBAL_BATCH = 8
FEATURES = 3
LEARNING_RATE = 0.1
TAG = "perseus_test/loss"  # the model_fn's own scalar


def global_batches() -> tuple:
    """(x, y) of every step: x [STEPS, GLOBAL_BATCH, FEATURES], y [STEPS, GLOBAL_BATCH, 1]."""
    rng = np.random.RandomState(5)
    x = rng.normal(size=(STEPS, GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = (x @ np.float32([[1.0], [-2.0], [0.5]]) + 0.3).astype(np.float32)
    return x, y


def initial_weights() -> np.ndarray:
    return np.float32([[0.2], [0.1], [-0.3]])


def local_rows(rank: int, size: int) -> slice:
    local = GLOBAL_BATCH // size
    return slice(rank * local, (rank + 1) * local)


def input_fn(rank: int, size: int):
    x, y = global_batches()
    rows = local_rows(rank, size)
    return lambda: tf.data.Dataset.from_tensor_slices((x[:, rows], y[:, rows]))


def model_fn(features, labels, mode):
    w = tf.compat.v1.get_variable("w", initializer=tf.constant(initial_weights()))
    loss = tf.reduce_mean(tf.square(tf.matmul(features, w) - labels))
    tf.compat.v1.summary.scalar(TAG, loss)
    tf.summary.scalar(TAG + "_v2", loss)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE).minimize(
        loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def main() -> None:
    out = sys.argv[1]
    pl.init()
    view = os.path.join(out, f"fs_of_rank{pl.rank()}")
    threads = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                       inter_op_parallelism_threads=1)
    config = pl.run_config(model_dir=os.path.join(view, "model"), tf_random_seed=1,
                           save_summary_steps=1, log_step_count_steps=1, session_config=threads)
    estimator = tf.estimator.Estimator(model_fn, config=config)
    estimator.train(input_fn(pl.rank(), pl.size()), max_steps=STEPS)
    record = {"rank": pl.rank(), "model_dir": estimator.model_dir,
              "model_dir_files": files_under(estimator.model_dir),
              "view_files": files_under(view)}
    with open(os.path.join(out, f"rank{pl.rank()}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"[rank {pl.rank()}] done", flush=True)


if __name__ == "__main__":
    main()

"""Training graphs that update variables without an optimizer, on every rank under perseusrun:
what the check before the first step (perseus_legacy.tf1.per_rank) refuses and lets through.

Usage: per_rank_updates.py CASE...   (every rank; prints "[rank R] CASE: OK" per passed case)

Every case trains a tf.estimator model with perseus_legacy.run_config() on this rank's shard of
one global data set, and checks against numpy on the whole data set (one process on the
global batch):

  kmeans_refused           KMeans(use_mini_batch=False): PerRankUpdateError naming KMeans and
                           its `clusters` variable, before any step (no checkpoint past step 0)
  sdca_refused             LinearRegressor(optimizer=LinearSDCA): refused, naming SDCA
  assign_add_refused       a model_fn with assign_add(count, reduce_sum(features)): refused,
                           naming the op and the variable
  assign_add_declared      the same with per_rank_update(count): trains; count is this rank's
                           sum, the optimizer-trained weights those of numpy SGD on the global
                           batch
  allreduce_value          count.assign_add(allreduce(sum, op=Sum)): accepted; count is the
                           global sum, the weights those of numpy SGD
  batch_norm               a batch-normalized model: trains; its weights equal on every rank,
                           its moving mean its own (per rank, as documented)
"""

from __future__ import annotations  # noqa: I001 (perseus_legacy first)

import perseus_legacy as pl

import sys
import tempfile
import time

import numpy as np
import tensorflow as tf
from worker_util import agree, assert_close, expect_error, fail

ROWS, FEATURES, BATCH, STEPS, LR = 48, 3, 4, 3, 0.1  # BATCH rows per rank and step


def global_data() -> tuple:
    rng = np.random.RandomState(3)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.3).astype(np.float32)
    return x, y


def input_fn(features_only: bool = False):
    def make() -> tf.data.Dataset:
        x, y = global_data()
        dataset = tf.data.Dataset.from_tensor_slices({"x": x, "y": y})
        dataset = pl.data.shard(dataset)
        if features_only:
            return dataset.map(lambda row: row["x"]).batch(BATCH)
        return dataset.map(lambda row: ({"x": row["x"]}, row["y"])).batch(BATCH)
    return make


def rows_of_step(step: int, rank: int | None) -> np.ndarray:
    """Indices of the global rows one rank (None: all ranks) trains on at `step`."""
    size = pl.size()
    ranks = range(size) if rank is None else [rank]
    return np.array([r + size * (step * BATCH + j) for r in ranks for j in range(BATCH)])


def numpy_sgd() -> np.ndarray:
    """The weights of STEPS steps of SGD on the global batch, from zeros (mean squared error)."""
    x, y = global_data()
    w = np.zeros((FEATURES, 1), np.float64)
    for step in range(STEPS):
        rows = rows_of_step(step, None)
        xs, ys = x[rows].astype(np.float64), y[rows].astype(np.float64)
        w -= LR * 2 * xs.T @ (xs @ w - ys) / len(rows)
    return w


class FinalValues(tf.compat.v1.train.SessionRunHook):
    """The values of the named global variables when the session ends."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.values: dict = {}

    def end(self, session: tf.compat.v1.Session) -> None:
        by_name = {v.op.name: v for v in tf.compat.v1.global_variables()}
        self.values = dict(zip(self.names, session.run([by_name[n] for n in self.names])))


def linear_model_fn(count_update: str):
    """A linear regression trained by SGD, plus `count`, updated as `count_update` says."""

    def model_fn(features, labels, mode):
        w = tf.compat.v1.get_variable("w", [FEATURES, 1], initializer=tf.zeros_initializer())
        count = tf.compat.v1.get_variable("count", [], initializer=tf.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(features["x"], w) - labels))
        train = tf.compat.v1.train.GradientDescentOptimizer(LR).minimize(
            loss, tf.compat.v1.train.get_global_step())
        total = tf.reduce_sum(features["x"])
        if count_update == "allreduce":
            total = pl.allreduce(total, op=pl.Sum, name="count_total")
        with tf.name_scope("count_batch"):
            counted = tf.compat.v1.assign_add(count, total)
        if count_update == "declared":
            pl.per_rank_update(count)
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.group(train, counted))

    return model_fn


def check_refused(rank: int, case: str, estimator, make_input, *fragments: str) -> None:
    expect_error(rank, case, lambda: estimator.train(make_input, steps=STEPS),
                 pl.PerRankUpdateError, f"rank {rank} of {pl.size()}", *fragments)
    checkpoint = tf.train.latest_checkpoint(estimator.model_dir)
    if checkpoint is not None and int(tf.train.load_variable(checkpoint, "global_step")) > 0:
        fail(rank, f"{case}: a checkpoint past step 0 was written before the refusal: "
                   f"{checkpoint}")


def config() -> tf.estimator.RunConfig:
    return pl.run_config(model_dir=tempfile.mkdtemp(prefix="per_rank_"), tf_random_seed=1,
                         save_summary_steps=None, log_step_count_steps=None)


def kmeans_refused(rank: int) -> None:
    estimator = tf.compat.v1.estimator.experimental.KMeans(
        num_clusters=3, use_mini_batch=False, config=config())
    check_refused(rank, "kmeans_refused", estimator, input_fn(features_only=True),
                  "tf.compat.v1.estimator.experimental.KMeans", "'clusters'",
                  "IteratorGetNext", "refused, not averaged", "per_rank_update")


def sdca_refused(rank: int) -> None:
    def make() -> tf.data.Dataset:
        ids = tf.data.Dataset.range(ROWS).map(lambda i: tf.strings.as_string(i))
        x, y = global_data()
        rows = tf.data.Dataset.zip((ids, tf.data.Dataset.from_tensor_slices((x, y))))
        rows = pl.data.shard(rows)
        return rows.map(lambda i, xy: ({"x": xy[0], "id": i}, xy[1])).batch(BATCH)

    estimator = tf.compat.v1.estimator.LinearRegressor(
        [tf.feature_column.numeric_column("x", shape=[FEATURES])],
        optimizer=tf.compat.v1.estimator.experimental.LinearSDCA(example_id_column="id"),
        config=config())
    check_refused(rank, "sdca_refused", estimator, make,
                  "LinearSDCA", "AssignAddVariableOp", "a gradient optimizer")


def assign_add_refused(rank: int) -> None:
    estimator = tf.estimator.Estimator(linear_model_fn("local"), config=config())
    check_refused(rank, "assign_add_refused", estimator, input_fn(),
                  "op 'count_batch/AssignAddVariableOp' (AssignAddVariableOp) writes global "
                  "variable 'count'",
                  "perseus_legacy.allreduce", "per_rank_update(variable_or_op)")


def train_linear(rank: int, count_update: str) -> tuple:
    estimator = tf.estimator.Estimator(linear_model_fn(count_update), config=config())
    final = FinalValues("w", "count")
    estimator.train(input_fn(), steps=STEPS, hooks=[final])
    return final.values["w"], final.values["count"]


def assign_add_declared(rank: int) -> None:
    w, count = train_linear(rank, "declared")
    x, _ = global_data()
    mine = sum(x[rows_of_step(s, rank)].sum(dtype=np.float64) for s in range(STEPS))
    assert_close(rank, "assign_add_declared: this rank's count", np.float64(count), mine,
                 rtol=1e-5)
    other = sum(x[rows_of_step(s, 1 - rank)].sum(dtype=np.float64) for s in range(STEPS))
    if np.isclose(mine, other):
        fail(rank, "assign_add_declared: the ranks' data sums are equal; the case proves nothing")
    assert_close(rank, "assign_add_declared: w", w.astype(np.float64), numpy_sgd(), rtol=1e-4,
                 atol=1e-6)


def allreduce_value(rank: int) -> None:
    w, count = train_linear(rank, "allreduce")
    x, _ = global_data()
    everyone = sum(x[rows_of_step(s, None)].sum(dtype=np.float64) for s in range(STEPS))
    assert_close(rank, "allreduce_value: count", np.float64(count), everyone, rtol=1e-5)
    assert_close(rank, "allreduce_value: w", w.astype(np.float64), numpy_sgd(), rtol=1e-4,
                 atol=1e-6)


def batch_norm(rank: int) -> None:
    def model_fn(features, labels, mode):
        hidden = tf.compat.v1.layers.dense(features["x"], 4, name="hidden")
        normal = tf.compat.v1.layers.batch_normalization(hidden, training=True, name="bn")
        predictions = tf.compat.v1.layers.dense(normal, 1, name="out")
        loss = tf.reduce_mean(tf.square(predictions - labels))
        optimizer = tf.compat.v1.train.MomentumOptimizer(LR, 0.9)
        with tf.control_dependencies(tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.UPDATE_OPS)):
            train = optimizer.minimize(loss, tf.compat.v1.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train)

    estimator = tf.estimator.Estimator(model_fn, config=config())
    final = FinalValues("out/kernel", "bn/moving_mean")
    estimator.train(input_fn(), steps=STEPS, hooks=[final])
    agree(rank, "batch_norm: out/kernel", final.values["out/kernel"])
    means = pl.allgather_object(final.values["bn/moving_mean"].tolist())
    if np.allclose(means[0], means[1]):
        fail(rank, f"batch_norm: the moving means are equal on both ranks ({means}); they are "
                   "per-rank statistics of different data")


CASES = {f.__name__: f for f in (kmeans_refused, sdca_refused, assign_add_refused,
                                 assign_add_declared, allreduce_value, batch_norm)}


def main() -> None:
    pl.init()
    if pl.size() != 2:
        fail(pl.rank(), f"run on 2 ranks, not {pl.size()}")
    for case in sys.argv[1:]:
        start = time.perf_counter()
        CASES[case](pl.rank())
        print(f"[rank {pl.rank()}] {case}: OK ({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()

"""Stop requests on some ranks stop every rank after the same step: named cases, run in order.

Usage: stop_requests.py OUT_DIR MODEL_ROOT rank CASE...       (perseusrun, or TF_CONFIG by hand)
       stop_requests.py OUT_DIR MODEL_ROOT reference CASE...  (one plain process, the reference)
       stop_requests.py OUT_DIR MODEL_ROOT evaluator CASE...  (the TF_CONFIG evaluator task)

Each case trains a linear regression with gradient descent, a rank on its slice of every global
batch, until a hook stops it; every rank writes OUT_DIR/<case>.rank<R>.npz with its variables
and global step after training (the reference: <case>.reference.npz). The reference is the same
program as one process on the whole global batch, with the same hook; in it, the hook that asks
"on the last rank" asks on its only rank. The evaluation is never sharded.

Cases:
  early_stopping           train_and_evaluate with stop_if_no_decrease_hook (evaluations every 2
                           steps; the training data's target changes at step 6, so the eval loss
                           rises after it and the hook stops training a few steps later)
  stop_at_checkpoint_step  Estimator.train with make_stop_at_checkpoint_step_hook(last_step=5)
  request_stop_last_rank   Estimator.train; a hook on the last rank alone asks to stop at step 4
  session_sync_replicas    MonitoredTrainingSession with SyncReplicasHook, then (after it in the
                           hooks) the hook asking on the last rank at step 4
  session_broadcast_hook   MonitoredTrainingSession, DistributedOptimizer and
                           BroadcastGlobalVariablesHook; the hook asks on the last rank at step 3
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import os
import sys

import numpy as np
import tensorflow as tf

GLOBAL_BATCH = 12  # divisible by 2 and 3 ranks
FEATURES = 3
MAX_STEPS = 30
LEARNING_RATE = 0.1
SHIFT_STEP = 6  # the training target changes here (early_stopping)
ESTIMATOR_CASES = ("early_stopping", "stop_at_checkpoint_step", "request_stop_last_rank")
CASES = (*ESTIMATOR_CASES, "session_sync_replicas", "session_broadcast_hook")


def global_batches(case: str) -> tuple:
    rng = np.random.RandomState(5)
    x = rng.normal(size=(MAX_STEPS, GLOBAL_BATCH, FEATURES)).astype(np.float32)
    w = np.array([[1.0], [-2.0], [0.5]], np.float32)
    y = x @ w
    if case == "early_stopping":
        y[SHIFT_STEP:] = x[SHIFT_STEP:] @ -w
    return x, y


def shard(case: str, rank: int, size: int) -> tuple:
    """This rank's contiguous slice of every global batch."""
    x, y = global_batches(case)
    local = GLOBAL_BATCH // size
    part = slice(rank * local, (rank + 1) * local)
    return x[:, part].reshape(-1, FEATURES), y[:, part].reshape(-1, 1), local


def model(features, labels):
    w = tf.compat.v1.get_variable("w", [FEATURES, 1], initializer=tf.compat.v1.zeros_initializer())
    b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer())
    return tf.reduce_mean(tf.square(tf.matmul(features, w) + b - labels))


class StopOnLastRank(tf.compat.v1.train.SessionRunHook):
    """Asks to stop, on the last rank only, once the global step reaches `step`."""

    def __init__(self, step: int, last: bool) -> None:
        self._step, self._last = step, last

    def begin(self):
        self._global_step = tf.compat.v1.train.get_global_step()

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(self._global_step)

    def after_run(self, run_context, run_values):
        if self._last and run_values.results + 1 >= self._step:
            run_context.request_stop()


class Record(tf.compat.v1.train.SessionRunHook):
    """Writes this rank's variables and global step when its training session ends."""

    def __init__(self, path: str) -> None:
        self._path = path

    def end(self, session):
        names = [v for v in tf.compat.v1.global_variables() if v.op.name in ("w", "b")]
        values = dict(zip([v.op.name for v in names], session.run(names)))
        values["global_step"] = session.run(tf.compat.v1.train.get_global_step())
        np.savez(self._path, **values)


def run_estimator(case: str, out: str, model_root: str, who: str, rank: int, size: int) -> None:
    x, y, local = shard(case, rank, size)

    def model_fn(features, labels, mode):
        loss = model(features, labels)
        train_op = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    def train_input_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(local)

    def eval_input_fn():
        ex, ey = global_batches("")
        return tf.data.Dataset.from_tensor_slices((ex[0], ey[0])).batch(GLOBAL_BATCH)

    model_dir = os.path.join(model_root, case)
    # Checkpoints (and evaluations) every 2 steps for early stopping, else at the end only.
    every = 2 if case == "early_stopping" else MAX_STEPS
    kwargs = dict(model_dir=model_dir, save_checkpoints_steps=every, save_summary_steps=0,
                  log_step_count_steps=None)
    config = (tf.estimator.RunConfig(**kwargs) if who == "reference"
              else pl.run_config(**kwargs))
    est = tf.estimator.Estimator(model_fn, config=config)
    record = Record(os.path.join(out, f"{case}.{who}.npz"))
    last = rank == size - 1
    if case == "early_stopping":
        hook = tf.estimator.experimental.stop_if_no_decrease_hook(
            est, "loss", max_steps_without_decrease=3, run_every_secs=None, run_every_steps=1)
        train = tf.estimator.TrainSpec(train_input_fn, max_steps=MAX_STEPS, hooks=[hook, record])
        evaluate = tf.estimator.EvalSpec(eval_input_fn, steps=None, throttle_secs=0,
                                         start_delay_secs=0)
        tf.estimator.train_and_evaluate(est, train, evaluate)
    elif case == "stop_at_checkpoint_step":
        hook = tf.estimator.experimental.make_stop_at_checkpoint_step_hook(est, last_step=5)
        est.train(train_input_fn, max_steps=MAX_STEPS, hooks=[hook, record])
    else:
        est.train(train_input_fn, max_steps=MAX_STEPS, hooks=[StopOnLastRank(4, last), record])


def run_session(case: str, out: str, who: str, rank: int, size: int) -> None:
    x, y, local = shard(case, rank, size)
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        features, labels = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(local)).get_next()
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
        last = rank == size - 1
        record = Record(os.path.join(out, f"{case}.{who}.npz"))
        if case == "session_sync_replicas":
            ours = [pl.SyncReplicasHook()] if who != "reference" else []
            hooks = [*ours, StopOnLastRank(4, last), record]
        else:
            if who != "reference":
                optimizer = pl.DistributedOptimizer(optimizer)
            ours = [pl.BroadcastGlobalVariablesHook(0)] if who != "reference" else []
            hooks = [StopOnLastRank(3, last), *ours, record]
        train_op = optimizer.minimize(model(features, labels), global_step=step)
        hooks.append(tf.compat.v1.train.StopAtStepHook(last_step=MAX_STEPS))
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
            while not session.should_stop():
                session.run(train_op)


def main() -> None:
    out, model_root, mode, *cases = sys.argv[1:]
    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
    if mode == "reference":
        rank, size, who = 0, 1, "reference"
    elif mode == "evaluator":
        # The TF_CONFIG evaluator: evaluates the chief's checkpoints of each train_and_evaluate.
        rank, size, who = 0, 1, "evaluator"
    else:
        pl.init()
        rank, size = pl.rank(), pl.size()
        who = f"rank{rank}"
    for case in cases:
        if case in ESTIMATOR_CASES:
            if mode == "evaluator" and case != "early_stopping":
                continue
            run_estimator(case, out, model_root, who, rank, size)
        else:
            run_session(case, out, who, rank, size)
        print(f"[{who}] {case}: done", flush=True)


if __name__ == "__main__":
    main()

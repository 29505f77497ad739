"""Estimator training with perseus_legacy.run_config() on every rank, or its single-process
reference.

Usage: est_distributed.py OUT_DIR distributed [SLOW_EVAL_SECONDS]   (every rank, perseusrun)
       est_distributed.py OUT_DIR reference     (one plain process: no collective, no hook;
                                                 perseus_legacy is imported only for tf.estimator)

Both run the same scenarios with the same seed; the reference trains on the whole global batch
with a plain RunConfig, each rank on its slice of it. Every process writes what it saw to
OUT_DIR/<who>.npz (variables) and OUT_DIR/<who>.json (steps, metrics, files); the pytest side
(tests/estimator/test_distributed_estimator.py) compares them with numpy.

Scenarios, in order:
  custom         custom model_fn (dense + embedding, Adam), config only, max_steps=STEPS
  custom_hooks   the same, config + estimator_hooks()
  canned         DNNClassifier, config only
  retrain_same   custom again to max_steps=STEPS (already there: every rank returns at once)
  retrain_more   custom to max_steps=2*STEPS: resumes from rank 0's checkpoint
  more_steps     custom for steps=STEPS/2 more: every rank counts them from rank 0's step
  train_eval     train_and_evaluate without TF_CONFIG (rank 0 evaluates; its first evaluation
                 lasts SLOW_EVAL_SECONDS at least)
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import json
import logging
import os
import sys
import time

import numpy as np
import tensorflow as tf
from worker_util import files_under

SEED = 7
STEPS = 4
GLOBAL_BATCH = 12  # divisible by 2 and 3
VOCAB, EMBED, FEATURES, CLASSES = 10, 3, 4, 3


def data(rows: int, seed: int) -> tuple:
    rng = np.random.RandomState(seed)  # the same stream under numpy 1.26 (TF 2.15) and 2
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    ids = rng.randint(0, VOCAB // 2, size=(rows, 2)).astype(np.int64)  # duplicate ids
    y = (x.sum(axis=1, keepdims=True) + ids[:, :1]).astype(np.float32)
    return {"x": x, "ids": ids}, y


def input_fn(rank: int, size: int, classes: bool = False):
    """This rank's slice of every global batch; STEPS * 2 batches (the resumed run needs them)."""
    features, y = data(GLOBAL_BATCH * STEPS * 2, 1)
    local = GLOBAL_BATCH // size
    part = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local,
                                     s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(STEPS * 2)])
    features = {k: v[part] for k, v in features.items()}
    labels = (np.abs(y[part, 0]).astype(np.int64) % CLASSES) if classes else y[part]
    return lambda: tf.data.Dataset.from_tensor_slices((features, labels)).batch(local)


def eval_input_fn():
    features, y = data(24, 2)
    return tf.data.Dataset.from_tensor_slices((features, y)).batch(8)


def initial_values(rank: int) -> dict:
    """Every rank starts elsewhere: only the broadcast of rank 0's values makes them agree."""
    rng = np.random.RandomState(3)
    values = {"emb": rng.normal(size=(VOCAB, EMBED)),
              "kernel": rng.normal(size=(FEATURES + EMBED, 1)), "bias": rng.normal(size=(1,))}
    return {k: (v + 0.5 * rank).astype(np.float32) for k, v in values.items()}


def make_model_fn(rank: int):
    init = initial_values(rank)

    def model_fn(features, labels, mode):
        var = {k: tf.compat.v1.get_variable(k, initializer=tf.constant(v)) for k, v in init.items()}
        ids = tf.reduce_mean(tf.nn.embedding_lookup(var["emb"], features["ids"]), 1)
        pred = tf.matmul(tf.concat([features["x"], ids], 1), var["kernel"]) + var["bias"]
        loss = tf.compat.v1.losses.mean_squared_error(labels, pred)
        train_op = tf.compat.v1.train.AdamOptimizer(0.05).minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        metrics = {"mae": tf.compat.v1.metrics.mean_absolute_error(labels, pred)}
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                          eval_metric_ops=metrics)

    return model_fn


def session_config():
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                    inter_op_parallelism_threads=1)


class Capture(tf.compat.v1.train.SessionRunHook):
    """What this rank's training session saw: start step, collectives, final variables."""

    def __init__(self):
        self.record = {"sessions": 0}
        self.values = {}

    def begin(self):
        ops = tf.compat.v1.get_default_graph().get_operations()
        self.record["collectives"] = sorted(op.type for op in ops if op.type.startswith("Perseus"))
        self._variables = tf.compat.v1.global_variables()

    def after_create_session(self, session, coord):
        self.record["sessions"] += 1
        self.record["start_step"] = int(session.run(tf.compat.v1.train.get_global_step()))

    def end(self, session):
        values = session.run(self._variables)
        self.values = {v.op.name: value for v, value in zip(self._variables, values)}
        self.record["end_step"] = int(self.values["global_step"])


class Logs(logging.Handler):
    """The TensorFlow log lines that reach this process's handlers."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class SlowEvaluation(tf.compat.v1.train.SessionRunHook):
    """Makes the first evaluation last `seconds` longer (rank 0 busy while the others wait)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def end(self, session):
        # Stands for a long evaluation (the behaviour under test is the others waiting through
        # it without a stall error); nothing synchronises on it.
        time.sleep(self.seconds)
        self.seconds = 0


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    slow_eval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    distributed = mode == "distributed"
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
    logs = Logs()
    tf.get_logger().addHandler(logs)
    if distributed:
        pl.init()
        rank, size = pl.rank(), pl.size()
        who = f"rank{rank}"
    else:
        rank, size, who = 0, 1, "reference"
    view = os.path.join(out, f"fs_of_{who}")  # this rank's view of the "shared" model_dir root
    record, values = {"size": size}, {}

    def config(name, **kwargs):
        kwargs.update(model_dir=os.path.join(view, name), tf_random_seed=SEED,
                      session_config=session_config())
        if distributed:
            return pl.run_config(**kwargs)
        return tf.estimator.RunConfig(**kwargs)

    def train(name, estimator, max_steps=None, hooks=(), classes=False, steps=None):
        capture = Capture()
        estimator.train(input_fn(rank, size, classes), max_steps=max_steps, steps=steps,
                        hooks=[*hooks, capture])
        record[name] = capture.record
        values.update({f"{name}/{k}": v for k, v in capture.values.items()})
        return estimator

    model_fn = make_model_fn(rank)
    log_start = len(logs.lines)
    custom = tf.estimator.Estimator(model_fn, config=config("custom", log_step_count_steps=1))
    train("custom", custom, STEPS)
    record["custom_logs"] = logs.lines[log_start:]
    record["custom_private_dir"] = custom.model_dir

    hooks = pl.estimator_hooks() if distributed else []
    train("custom_hooks", tf.estimator.Estimator(model_fn, config=config("custom_hooks")), STEPS,
          hooks=hooks)

    columns = [tf.feature_column.numeric_column("x", shape=[FEATURES])]
    canned = tf.estimator.DNNClassifier(hidden_units=[8], feature_columns=columns,
                                        n_classes=CLASSES, config=config("canned"))
    train("canned", canned, STEPS, classes=True)

    train("retrain_same", custom, STEPS)
    train("retrain_more", custom, 2 * STEPS)
    train("more_steps", custom, steps=STEPS // 2)

    train_eval = tf.estimator.Estimator(model_fn, config=config(
        "train_eval", save_checkpoints_steps=2))
    train_spec = tf.estimator.TrainSpec(input_fn(rank, size), max_steps=STEPS)
    eval_spec = tf.estimator.EvalSpec(eval_input_fn, steps=None, throttle_secs=1,
                                      hooks=[SlowEvaluation(slow_eval)])
    metrics, _ = tf.estimator.train_and_evaluate(train_eval, train_spec, eval_spec)
    record["train_eval_metrics"] = {k: float(v) for k, v in (metrics or {}).items()}

    # What this process left in the directories it was given (its own filesystem view) and in
    # the private model_dirs the Estimators chose.
    record["view_files"] = files_under(view)
    record["private_dirs"] = sorted({e.model_dir for e in (custom, canned, train_eval)})
    record["private_files"] = {d: files_under(d) for d in record["private_dirs"]}
    if rank == 0:
        values.update({f"checkpoint/{n}": custom.get_variable_value(n)
                       for n in custom.get_variable_names()})
    np.savez(os.path.join(out, f"{who}.npz"), **values)
    with open(os.path.join(out, f"{who}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"[{who}] done", flush=True)


if __name__ == "__main__":
    main()

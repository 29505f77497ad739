"""What every process of benchmarks/cluster_training.py trains: one Estimator model_fn for every
configuration, its input, and the hooks that time it and start the tasks of a cluster together.

The model is a multilayer perceptron on synthetic features, written the way parameter-server
users write Estimator models: its weights are partitioned across the ps tasks that the
RunConfig reports, as the canned estimators do (one partition when there are none). Its dense
weights hold 24 MiB of float32 and a batch of 32 needs about 10 ms of one core, so on 1 Gbit/s
links moving the gradients (or the variables) takes far longer than computing them. This module
imports TensorFlow: import it after `perseus_legacy` where that is imported at all.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import tensorflow as tf

from .emulated import BUILT, CONNECT, GO, READY

FEATURES = 1024
HIDDEN = 2048
CLASSES = 10
LEARNING_RATE = 0.01
# Kernels are split along their rows into one slice per ps task; smaller variables stay whole.
MIN_SLICE_BYTES = 256 << 10
LAYERS = ((FEATURES, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, CLASSES))


def parameter_bytes() -> int:
    """Bytes of float32 weights and biases: what one step's gradients (or variables) weigh."""
    return 4 * sum(rows * cols + cols for rows, cols in LAYERS)


def _dense(inputs: tf.Tensor, name: str, rows: int, cols: int) -> tf.Tensor:
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [rows, cols], initializer=tf.compat.v1.glorot_uniform_initializer())
        bias = tf.compat.v1.get_variable("bias", [cols], initializer=tf.zeros_initializer())
    return tf.matmul(inputs, kernel) + bias


def model_fn(features, labels, mode, params, config):
    """Softmax classifier; `params["sync_replicas"]` = N wraps the optimizer in TensorFlow's
    SyncReplicasOptimizer aggregating N gradients per step (parameter-server sync training)."""
    partitioner = tf.compat.v1.min_max_variable_partitioner(
        max_partitions=max(1, config.num_ps_replicas), min_slice_size=MIN_SLICE_BYTES)
    with tf.compat.v1.variable_scope("mlp", partitioner=partitioner):
        x = features
        for index, (rows, cols) in enumerate(LAYERS):
            x = _dense(x, f"dense{index}", rows, cols)
            if index < len(LAYERS) - 1:
                x = tf.nn.relu(x)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=x))
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
    hooks = []
    replicas = params.get("sync_replicas", 0)
    if replicas:
        optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
            optimizer, replicas_to_aggregate=replicas, total_num_replicas=replicas)
        hooks.append(optimizer.make_session_run_hook(config.is_chief))
    train_op = optimizer.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op, training_hooks=hooks)


def input_fn(batch: int, seed: int) -> tf.data.Dataset:
    """One fixed synthetic batch of `batch` examples, repeated: the input costs nothing."""
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((batch, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=batch).astype(np.int64)
    return tf.data.Dataset.from_tensors((features, labels)).repeat()


class GlobalStepTimer(tf.compat.v1.train.SessionRunHook):
    """Seconds and global steps from the end of the first step that leaves global step at or
    past `start_at` to the end of training, printed as JSON after `report` (if given) when training
    ends. global_step is read where it lives (a ps, with parameter servers) at both ends."""

    def __init__(self, start_at: int, report: str | None = None) -> None:
        self.start_at = start_at
        self.report = report
        self.first = self.last = None  # (seconds, global step)

    def begin(self) -> None:
        self._global_step = tf.compat.v1.train.get_global_step()

    def after_run(self, run_context, run_values) -> None:
        if self.first is None:  # a read of its own: one fetched with the step may precede it
            now = self._now(run_context.session)
            if now[1] >= self.start_at:
                self.first = now

    def end(self, session) -> None:
        if self.first is not None:
            self.last = self._now(session)
        if self.report is not None:
            print(self.report + json.dumps(self.result()), flush=True)

    def _now(self, session) -> tuple[float, int]:
        step = int(session.run(self._global_step))
        return time.perf_counter(), step

    def result(self) -> dict:
        if self.last is None:
            raise RuntimeError(f"training ended before global step {self.start_at}: nothing "
                               "was timed; raise --steps")
        return {"seconds": self.last[0] - self.first[0],
                "global_steps": self.last[1] - self.first[1],
                "parameter_bytes": parameter_bytes()}


class StartTogether(tf.compat.v1.train.SessionRunHook):
    """Holds a task twice until the launcher writes a line on its stdin: with its graph built,
    before it connects (prints BUILT, waits for `connect`), and with its session created
    (prints READY, waits for `go`). The launcher connects each task once those it needs are
    up, and sends `go` to all at once, so that every task takes its first step together."""

    def begin(self) -> None:
        self._hold(BUILT, CONNECT)

    def after_create_session(self, session, coord) -> None:
        self._hold(READY, GO)

    @staticmethod
    def _hold(announce: str, expected: str) -> None:
        print(announce, flush=True)
        line = sys.stdin.readline().strip()
        if line != expected:
            raise RuntimeError(f"expected {expected!r} from the launcher on stdin, got {line!r}")

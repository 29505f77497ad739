"""What the digits examples share: the data, the model and the reference run (plain TF1; the
Session examples' start below joins the job).

Data: an MNIST .npz (x_train, y_train, x_test, y_test) or scikit-learn's bundled 8x8 digits
(no download). Images come back flattened, scaled to [0, 1], as float32.

The Session examples (session_run.py, monitored_session.py) share their options
(session_arguments), their start (session_setup: init(), this rank's shard, the scaled learning
rate) and their graph (classifier).

Reference: an example run with `--reference-ranks N` joins no job and runs no collective. One
process trains on what N synchronous ranks see together: each step, the N ranks' batches
concatenated (global_batches, global_order, concatenated), with the learning rate scaled by N and
rank 0's initial weights.
Every run prints weights_line() (on every rank), so a test can check that the ranks agree with
each other and with the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

BATCH, HIDDEN, LR = 32, 128, 3e-3


def load(path: str | None = None) -> tuple:
    """(x_train, y_train, x_test, y_test), the same split in every process."""
    if path:
        with np.load(path) as d:
            x_train, y_train, x_test, y_test = (d[k] for k in
                                                ("x_train", "y_train", "x_test", "y_test"))
    else:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x_train, x_test, y_train, y_test = train_test_split(
            digits.data, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    scale = float(max(x_train.max(), 1))
    return (np.reshape(x_train, (len(x_train), -1)).astype(np.float32) / scale,
            y_train.astype(np.int64),
            np.reshape(x_test, (len(x_test), -1)).astype(np.float32) / scale,
            y_test.astype(np.int64))


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0):
    """Endless shuffled mini-batches of (x, y)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch_size + 1, batch_size):
            rows = order[start:start + batch_size]
            yield x[rows], y[rows]


def add_reference_argument(parser) -> None:
    """Adds --reference-ranks N (default 0: train on the ranks of this job)."""
    parser.add_argument("--reference-ranks", type=int, default=0, metavar="N",
                        help="no ranks: one plain process trains on the global batch of N ranks "
                             "(what the tests compare an N-rank run with)")


def session_arguments(doc: str) -> argparse.ArgumentParser:
    """The options of the Session examples: --data, --steps, --smoke (20 steps) and
    --reference-ranks; a script adds its own before parsing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--data", help="MNIST .npz (default: scikit-learn's 8x8 digits)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="a tiny run: 20 steps")
    add_reference_argument(parser)
    return parser


@dataclasses.dataclass
class SessionSetup:
    """What a Session example trains with (session_setup())."""

    rank: int
    ranks: int
    learning_rate: float
    data: Iterator  # endless (x, y) training batches
    x_test: np.ndarray
    y_test: np.ndarray
    features: int
    classes: int
    steps: int
    reference: int  # --reference-ranks: 0 on the ranks of a job


def session_setup(args: argparse.Namespace) -> SessionSetup:
    """Loads the data and, on a rank of a job, joins it: this rank's shard (every size()-th
    example) and the learning rate scaled by size(); in a reference run, the N ranks' batches of
    a step concatenated and their learning rate. Seeds the graph by rank (rank 0's initial
    values are broadcast, so any seed will do)."""
    import perseus_legacy as pl

    x_train, y_train, x_test, y_test = load(args.data)
    classes = int(max(y_train.max(), y_test.max())) + 1
    reference = args.reference_ranks
    if reference:
        rank, ranks, learning_rate = 0, reference, LR * reference
        data = global_batches(x_train, y_train, BATCH, reference)
    else:
        pl.init()  # perseus_legacy
        rank, ranks = pl.rank(), pl.size()  # perseus_legacy
        learning_rate = pl.scale_learning_rate(LR)  # perseus_legacy
        shard = slice(rank, None, ranks)  # perseus_legacy: every size()-th example
        data = batches(x_train[shard], y_train[shard], BATCH)
    tf.compat.v1.set_random_seed(rank)
    return SessionSetup(rank, ranks, learning_rate, data, x_test, y_test, x_train.shape[1],
                        classes, 20 if args.smoke else args.steps, reference)


def global_batches(x: np.ndarray, y: np.ndarray, batch_size: int, ranks: int):
    """Endless global batches: each step, what batches() gives every rank of `ranks` from its
    shard (every ranks-th example), concatenated in rank order."""
    per_rank = [batches(x[rank::ranks], y[rank::ranks], batch_size) for rank in range(ranks)]
    for step in zip(*per_rank):
        yield tuple(np.concatenate(parts) for parts in zip(*step))


def global_order(x: np.ndarray, y: np.ndarray, batch_size: int, ranks: int) -> tuple:
    """x and y rearranged for fit(batch_size=batch_size * ranks, shuffle=False): batch k holds
    batch k of every rank's equal shard (every ranks-th example), in rank order."""
    shards = np.arange(len(x) // ranks * ranks).reshape(-1, ranks).T  # row r: rank r's rows
    order = np.concatenate([shards[:, start:start + batch_size].ravel()
                            for start in range(0, shards.shape[1], batch_size)])
    return x[order], y[order]


def concatenated(datasets: list) -> tf.data.Dataset:
    """One element of every dataset (a batch each) per step, concatenated in order."""
    return tf.data.Dataset.zip(tuple(datasets)).map(
        lambda *batch: tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *batch))


def weights_line(values: list) -> str:
    """`weights: <sum of |w| over every array of values>`, the fingerprint a test compares."""
    return f"weights: {sum(np.abs(v).astype(np.float64).sum() for v in values):.10g}"


class PrintWeights(tf.compat.v1.train.SessionRunHook):
    """Prints weights_line() of the trainable variables when the session ends (every rank)."""

    def begin(self):
        self.variables = tf.compat.v1.trainable_variables()

    def end(self, session):
        print(weights_line(session.run(self.variables)), flush=True)


def classifier(features: int, classes: int) -> tuple:
    """The Session examples' graph: placeholders x and y, the loss and the accuracy."""
    x = tf.compat.v1.placeholder(tf.float32, [None, features], name="x")
    y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
    logits = model(x, classes)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    return x, y, loss, accuracy


def model(x, classes):
    """Logits of a one-hidden-layer classifier."""
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        hidden = tf.nn.relu(tf.matmul(x, tf.compat.v1.get_variable(
            "w1", [x.shape[1], HIDDEN])) + tf.compat.v1.get_variable(
            "b1", [HIDDEN], initializer=tf.zeros_initializer()))
        return tf.matmul(hidden, tf.compat.v1.get_variable("w2", [HIDDEN, classes])) + \
            tf.compat.v1.get_variable("b2", [classes], initializer=tf.zeros_initializer())

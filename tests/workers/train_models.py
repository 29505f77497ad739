"""Runs on every rank: DistributedOptimizer training equals single-process training.

A small model (an embedding lookup, whose gradient is a sparse tf.IndexedSlices, then a dense
layer) trains N steps with SGD, Momentum and Adam. Each rank starts from its own random values
and trains on its slice of every global batch; the final variables must equal those of a plain
TensorFlow graph (no perseus op) trained in this process on the whole global batch from rank 0's
initial values. argv[1]: a directory shared by all ranks, for the checkpoint check.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import functools
import os
import sys

import numpy as np
import tensorflow as tf
from worker_util import assert_close, barrier, fail, run_cases

STEPS = 5
GLOBAL_BATCH = 6  # divisible by 2 and 3
VOCAB, EMBED, OUT = 10, 4, 3
RTOL, ATOL = 1e-5, 1e-6  # fp32, different summation order than the single-process run
FP16_RTOL, FP16_ATOL = 2e-2, 2e-3  # gradients rounded to float16 before the reduction
CONFIG = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.2, momentum=0.9),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
}
VAR_NAMES = ("embedding", "kernel", "bias")


def initial_values(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"embedding": rng.normal(size=(VOCAB, EMBED)).astype(np.float32),
            "kernel": rng.normal(size=(EMBED, OUT)).astype(np.float32),
            "bias": rng.normal(size=(OUT,)).astype(np.float32)}


def global_batch(step: int) -> tuple:
    rng = np.random.default_rng(100 + step)
    ids = rng.integers(0, VOCAB // 2, size=GLOBAL_BATCH).astype(np.int32)  # with duplicates
    return ids, rng.normal(size=(GLOBAL_BATCH, OUT)).astype(np.float32)


def local_batch(step: int, rank: int, size: int) -> tuple:
    ids, targets = global_batch(step)
    rows = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
    return ids[rows], targets[rows]


def build_model(init: dict, global_step_init: int = 0, inputs: tuple | None = None) -> tuple:
    """(ids, targets, loss, global step, variables) in the default graph; ids and targets are
    placeholders unless `inputs` gives them (e.g. from a dataset iterator)."""
    if inputs is None:
        inputs = (tf.compat.v1.placeholder(tf.int32, [None], name="ids"),
                  tf.compat.v1.placeholder(tf.float32, [None, OUT], name="targets"))
    ids, targets = inputs
    variables = [tf.compat.v1.Variable(init[n], name=n, use_resource=True) for n in VAR_NAMES]
    global_step = tf.compat.v1.Variable(
        np.int64(global_step_init), name="global_step", trainable=False, use_resource=True,
        collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
                     tf.compat.v1.GraphKeys.GLOBAL_STEP])
    embedding, kernel, bias = variables
    hidden = tf.nn.embedding_lookup(embedding, ids)
    logits = tf.matmul(hidden, kernel) + bias
    loss = tf.reduce_mean(tf.square(logits - targets))
    return ids, targets, loss, global_step, variables


@functools.cache
def reference(opt_name: str, steps: int = STEPS, passes: int = 1,
              loss_scale: float = 1.0) -> list:
    """Single process, plain TensorFlow, rank 0's initial values: `steps` steps, each on `passes`
    global batches concatenated, of `loss_scale` x the loss."""
    with tf.Graph().as_default():
        ids, targets, loss, global_step, variables = build_model(initial_values(0))
        train = OPTIMIZERS[opt_name]().minimize(loss * loss_scale, global_step=global_step)
        with tf.compat.v1.Session(config=CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(steps):
                batches = [global_batch(step * passes + p) for p in range(passes)]
                sess.run(train, {ids: np.concatenate([b[0] for b in batches]),
                                 targets: np.concatenate([b[1] for b in batches])})
            return sess.run(variables)


def assert_like_reference(rank: int, what: str, got: list, expected: list, rtol: float = RTOL,
                          atol: float = ATOL) -> None:
    """Every final variable of this rank within rtol/atol of the single-process reference's."""
    for name, g, e in zip(VAR_NAMES, got, expected):
        assert_close(rank, f"{what}: {name}", g, e, rtol=rtol, atol=atol)


def train_on_slices(sess, rank: int, size: int, what: str, model: tuple, train) -> list:
    """Checks that every rank starts from rank 0's initial values (the broadcast), runs STEPS
    steps of `train` on this rank's slices, checks the global step; the final variable values."""
    ids, targets, _, global_step, variables = model
    start = sess.run(variables + [global_step])
    wanted = [initial_values(0)[n] for n in VAR_NAMES] + [np.int64(0)]
    for name, got, want in zip(VAR_NAMES + ("global_step",), start, wanted):
        assert_close(rank, f"{what}: {name} after the broadcast", got, want, rtol=0.0)
    for step in range(STEPS):
        batch_ids, batch_targets = local_batch(step, rank, size)
        sess.run(train, {ids: batch_ids, targets: batch_targets})
    final = sess.run(variables + [global_step])
    assert_close(rank, f"{what}: global step", final[-1], np.int64(STEPS))
    return final[:-1]


def monitored_session(hooks: list, **settings) -> tf.compat.v1.train.MonitoredTrainingSession:
    """A MonitoredTrainingSession of CONFIG that writes no logs, summaries or checkpoints unless
    `settings` ask for them."""
    quiet = dict(config=CONFIG, log_step_count_steps=None, save_summaries_steps=None,
                 save_checkpoint_secs=None)
    return tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks, **{**quiet, **settings})


def check_sparse_gradient(rank: int, opt: pl.DistributedOptimizer, loss, embedding) -> None:
    for grad, var in opt.compute_gradients(loss):
        if var is embedding and not isinstance(grad, tf.IndexedSlices):
            fail(rank, f"the embedding gradient became {type(grad).__name__}, not IndexedSlices")


def distributed(opt_name: str, rank: int, size: int, mode: str, compression=pl.Compression.none,
                checkpoint_root: str | None = None) -> list:
    """Trains on this rank's slices; `mode` is "monitored" or "session". Returns final values."""
    own_init = initial_values(rank)  # differs per rank: only the broadcast makes them agree
    with tf.Graph().as_default() as graph:
        ids, targets, loss, global_step, variables = build_model(own_init, 7 * rank)
        tf.constant(0, name=f"rank_marker_{rank}")  # shows which rank wrote a graph file
        opt = pl.DistributedOptimizer(OPTIMIZERS[opt_name](), compression=compression)
        train = opt.minimize(loss, global_step=global_step)
        if mode == "monitored":
            check_sparse_gradient(rank, opt, loss, variables[0])
        if compression is pl.Compression.fp16:
            halves = [op for op in graph.get_operations()
                      if op.type in ("PerseusAllreduce", "PerseusAllgather")
                      and op.inputs[0].dtype == tf.float16]
            if len(halves) < 3:  # kernel, bias, embedding values
                fail(rank, f"fp16 compression: only {len(halves)} float16 collectives")

        model = (ids, targets, loss, global_step, variables)

        def run_steps(sess) -> list:
            return train_on_slices(sess, rank, size, f"{opt_name} {mode}", model, train)

        if mode == "monitored":
            hooks = [pl.BroadcastGlobalVariablesHook(0)]
            with monitored_session(hooks, checkpoint_dir=pl.checkpoint_dir(checkpoint_root),
                                   save_checkpoint_steps=2, save_summaries_steps=2) as sess:
                return run_steps(sess)
        return run_in_plain_session(run_steps)


def run_in_plain_session(run_steps) -> list:
    """Initialises a plain Session, broadcasts rank 0's variables, then trains with run_steps."""
    init = [tf.compat.v1.global_variables_initializer(),
            tf.compat.v1.local_variables_initializer()]
    broadcast = pl.broadcast_global_variables(0)
    with tf.compat.v1.Session(config=CONFIG) as sess:
        sess.run(init)
        sess.run(broadcast)
        return run_steps(sess)


def check_checkpoint_files(rank: int, size: int, root: str, expected: list) -> None:
    """Every rank: only rank 0 wrote, and its last checkpoint holds the trained values."""
    barrier("checkpoint written")  # rank 0 has closed its session before anyone looks
    entries = sorted(os.listdir(root))
    if not any(e.endswith(".index") for e in entries) or "checkpoint" not in entries:
        fail(rank, f"no checkpoint in {root}: {entries}")
    events = [e for e in entries if e.startswith("events.out.tfevents")]
    if len(events) != 1:
        fail(rank, f"expected rank 0's one events file, found {events}")
    for entry in entries:
        if entry.endswith((".meta", ".pbtxt")):
            with open(os.path.join(root, entry), "rb") as handle:
                text = handle.read()
            others = [r for r in range(1, size) if f"rank_marker_{r}".encode() in text]
            if others or b"rank_marker_0" not in text:
                fail(rank, f"{entry} was written by rank(s) {others}, not only rank 0")
    latest = tf.train.latest_checkpoint(root)
    if latest is None or not latest.endswith(f"-{STEPS}"):
        fail(rank, f"latest checkpoint {latest}, expected one at step {STEPS}")
    reader = tf.train.load_checkpoint(latest)
    for name, want in zip(VAR_NAMES, expected):
        assert_close(rank, f"checkpoint {name}", reader.get_tensor(name), want, rtol=RTOL,
                     atol=ATOL)
    barrier("checkpoint read")  # nobody removes the directory while another rank reads it


def named_cases(rank: int, size: int, root: str) -> dict:
    """`<optimizer>_<mode>`: monitored (the Adam one also checks rank 0's checkpoints), session,
    fp16 (a Session with Compression.fp16, for sgd and adam)."""
    def train(opt_name: str, mode: str) -> None:
        expected = reference(opt_name)
        if mode == "fp16":
            got = distributed(opt_name, rank, size, "session", pl.Compression.fp16)
            assert_like_reference(rank, f"{opt_name} fp16", got, expected, FP16_RTOL, FP16_ATOL)
            return
        checkpoints = opt_name == "adam" and mode == "monitored"
        got = distributed(opt_name, rank, size, mode,
                          checkpoint_root=root if checkpoints else None)
        assert_like_reference(rank, f"{opt_name} {mode}", got, expected)
        if checkpoints:
            check_checkpoint_files(rank, size, root, expected)

    return {case: functools.partial(train, *case.split("_")) for case in CASES}


# The case names (tests/test_training.py parametrizes over them).
CASES = ("sgd_monitored", "sgd_session", "sgd_fp16", "momentum_monitored", "momentum_session",
         "adam_monitored", "adam_session", "adam_fp16")


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    root = os.path.join(sys.argv[1], "ckpt")
    if rank != 0 and pl.checkpoint_dir(root) is not None:
        fail(rank, "checkpoint_dir() is not None on a rank other than 0")
    sys.exit(1 if run_cases(rank, named_cases(rank, size, root), sys.argv[2:] or None) else 0)


if __name__ == "__main__":
    main()

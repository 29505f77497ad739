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

import os
import sys

import numpy as np
import tensorflow as tf
from worker_util import assert_close, barrier, fail

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


def reference(opt_name: str, steps: int = STEPS) -> list:
    """Single process, plain TensorFlow, whole global batch, rank 0's initial values."""
    with tf.Graph().as_default():
        ids, targets, loss, global_step, variables = build_model(initial_values(0))
        train = OPTIMIZERS[opt_name]().minimize(loss, global_step=global_step)
        with tf.compat.v1.Session(config=CONFIG) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(steps):
                batch_ids, batch_targets = global_batch(step)
                sess.run(train, {ids: batch_ids, targets: batch_targets})
            return sess.run(variables)


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

        def run_steps(sess) -> list:
            start = sess.run(variables + [global_step])
            for name, got, want in zip(VAR_NAMES + ("global_step",), start,
                                       [initial_values(0)[n] for n in VAR_NAMES] + [np.int64(0)]):
                assert_close(rank, f"{opt_name} {mode}: {name} after the broadcast", got, want,
                             rtol=0.0)
            for step in range(STEPS):
                batch_ids, batch_targets = local_batch(step, rank, size)
                sess.run(train, {ids: batch_ids, targets: batch_targets})
            final = sess.run(variables + [global_step])
            assert_close(rank, f"{opt_name} {mode}: global step", final[-1], np.int64(STEPS))
            return final[:-1]

        if mode == "monitored":
            hooks = [pl.BroadcastGlobalVariablesHook(0)]
            with tf.compat.v1.train.MonitoredTrainingSession(
                    checkpoint_dir=pl.checkpoint_dir(checkpoint_root), hooks=hooks,
                    config=CONFIG, save_checkpoint_steps=2, save_summaries_steps=2,
                    log_step_count_steps=None) as sess:
                return run_steps(sess)
        return run_in_plain_session(run_steps)


def run_in_plain_session(run_steps) -> list:
    """Initialises a plain Session, broadcasts rank 0's variables, then trains with run_steps."""
    init = tf.compat.v1.global_variables_initializer()
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


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    shared = sys.argv[1]
    root = os.path.join(shared, "ckpt")
    if rank != 0 and pl.checkpoint_dir(root) is not None:
        fail(rank, "checkpoint_dir() is not None on a rank other than 0")
    for opt_name in OPTIMIZERS:
        expected = reference(opt_name)
        for mode in ("monitored", "session"):
            got = distributed(opt_name, rank, size, mode,
                              checkpoint_root=root if opt_name == "adam" else None)
            for name, g, e in zip(VAR_NAMES, got, expected):
                assert_close(rank, f"{opt_name} {mode}: {name}", g, e, rtol=RTOL, atol=ATOL)
            if opt_name == "adam" and mode == "monitored":
                check_checkpoint_files(rank, size, root, expected)
        if opt_name in ("sgd", "adam"):
            got = distributed(opt_name, rank, size, "session", pl.Compression.fp16)
            for name, g, e in zip(VAR_NAMES, got, expected):
                assert_close(rank, f"{opt_name} fp16: {name}", g, e, rtol=FP16_RTOL,
                             atol=FP16_ATOL)
    print(f"[rank {rank}] OK: sgd/momentum/adam x (MonitoredTrainingSession, Session), fp16, "
          "rank-0 checkpoints", flush=True)


if __name__ == "__main__":
    main()

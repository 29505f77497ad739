"""Two-rank smoke run of the native collectives and a synchronous TF1 training loop.

    perseusrun -np 2 python examples/allreduce_smoke.py

Each rank trains linear regression on its own shard of a shared synthetic data set; gradients
are averaged with perseus_legacy.allreduce, so every rank ends with the weights that one
process would reach on the global batch. Rank 0 checks that against numpy and prints a summary.
"""

import time

import numpy as np
import tensorflow as tf

import perseus_legacy as pl

STEPS, LR, BATCH_PER_RANK, FEATURES = 50, 0.1, 32, 8


def global_data(size: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(size * BATCH_PER_RANK, FEATURES)).astype(np.float32)
    true_w = np.arange(1, FEATURES + 1, dtype=np.float32)
    return x, x @ true_w + 0.5


def numpy_reference(x, y):
    """Full-batch gradient descent on the global batch: what synchronous training must equal."""
    w, b = np.zeros(FEATURES, np.float64), 0.0
    for _ in range(STEPS):
        err = x @ w + b - y
        w -= LR * 2 * x.T @ err / len(y)
        b -= LR * 2 * err.mean()
    return w, b


def main():
    tf.compat.v1.disable_eager_execution()
    pl.init()
    rank, size = pl.rank(), pl.size()
    x_all, y_all = global_data(size)
    shard = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)

    x = tf.constant(x_all[shard])
    y = tf.constant(y_all[shard])
    w = tf.compat.v1.get_variable("w", [FEATURES], initializer=tf.zeros_initializer())
    b = tf.compat.v1.get_variable("b", [], initializer=tf.zeros_initializer())
    loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) + b - y))
    opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
    grads = [(pl.allreduce(g, op=pl.Average), v) for g, v in opt.compute_gradients(loss)]  # sync
    train = opt.apply_gradients(grads)
    global_loss = pl.allreduce(loss, op=pl.Average)
    every_rank_w = pl.allgather(tf.expand_dims(w, 0))  # one row per rank

    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=2)
    with tf.compat.v1.Session(config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        start = time.perf_counter()
        for _ in range(STEPS):
            sess.run(train)
        elapsed = time.perf_counter() - start
        final_w, final_b, final_loss, all_w = sess.run([w, b, global_loss, every_rank_w])

    if rank == 0:
        ref_w, ref_b = numpy_reference(x_all, y_all)
        identical = bool(np.all(all_w == all_w[0]))
        matches = np.allclose(final_w, ref_w, rtol=1e-3, atol=1e-3) and abs(final_b - ref_b) < 1e-3
        print(f"ranks: {size}  steps: {STEPS}  steps/s: {STEPS / elapsed:.1f}  "
              f"examples/s: {STEPS * BATCH_PER_RANK * size / elapsed:.0f}")
        print(f"final global loss: {final_loss:.5f}")
        print(f"weights identical on all ranks: {identical}")
        print(f"weights equal one process on the global batch (numpy): {matches}")
        if not (identical and matches):
            raise SystemExit("smoke run FAILED")
    pl.shutdown()


if __name__ == "__main__":
    main()

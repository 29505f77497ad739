"""A TF1 digit classifier trained with a plain tf.compat.v1.Session, on every rank.

    perseusrun -np 2 python examples/session_run.py [--data mnist.npz] [--steps 300] [--smoke]
    python examples/session_run.py --reference-ranks 2 [...]   # what 2 ranks must reach

The script is ordinary single-process TF1 code; the lines marked `# perseus_legacy` make it
synchronous data-parallel: each rank trains on its own shard, and distribute_graph() rewrites the
plain Adam update ops to use gradients averaged over all ranks. With --reference-ranks N, one
plain process skips them and trains on the N ranks' global batch instead (`reference` below).
"""

import perseus_legacy as pl  # perseus_legacy (first: before tensorflow)  # noqa: I001

import argparse
import time

import tensorflow as tf

import digits

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="MNIST .npz (default: scikit-learn's 8x8 digits)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="a tiny run: 20 steps")
    digits.add_reference_argument(parser)
    args = parser.parse_args()
    steps = 20 if args.smoke else args.steps
    reference = args.reference_ranks  # reference: 0 on the ranks of a job

    tf.compat.v1.disable_eager_execution()
    x_train, y_train, x_test, y_test = digits.load(args.data)
    classes = int(max(y_train.max(), y_test.max())) + 1
    if reference:  # reference: the N ranks' batches of a step concatenated, their learning rate
        rank, ranks, learning_rate = 0, reference, digits.LR * reference
        data = digits.global_batches(x_train, y_train, digits.BATCH, reference)
    else:
        pl.init()  # perseus_legacy
        rank, ranks = pl.rank(), pl.size()  # perseus_legacy
        learning_rate = pl.scale_learning_rate(digits.LR)  # perseus_legacy
        shard = slice(pl.rank(), None, pl.size())  # perseus_legacy: every size()-th example
        data = digits.batches(x_train[shard], y_train[shard], digits.BATCH)
    tf.compat.v1.set_random_seed(rank)  # any seed: rank 0's initial values are broadcast

    x = tf.compat.v1.placeholder(tf.float32, [None, x_train.shape[1]], name="x")
    y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
    logits = digits.model(x, classes)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    train_op = tf.compat.v1.train.AdamOptimizer(learning_rate).minimize(loss)
    if not reference:
        pl.distribute_graph()  # perseus_legacy: the Adam updates now use averaged gradients

    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
    if not reference:
        config = pl.session_config(config)  # perseus_legacy
    with tf.compat.v1.Session(config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if not reference:
            sess.run(pl.broadcast_global_variables(0))  # perseus_legacy: rank 0's values
        start = time.perf_counter()
        for _ in range(steps):
            batch_x, batch_y = next(data)
            sess.run(train_op, {x: batch_x, y: batch_y})
        elapsed = time.perf_counter() - start
        test_accuracy = sess.run(accuracy, {x: x_test, y: y_test})  # the whole test set
        print(digits.weights_line(sess.run(tf.compat.v1.trainable_variables())))  # every rank

    if rank == 0:  # perseus_legacy
        print(f"ranks: {ranks}  steps: {steps}  steps/s: {steps / elapsed:.1f}")
        print(f"test accuracy: {test_accuracy:.4f}")
    if not reference:
        pl.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

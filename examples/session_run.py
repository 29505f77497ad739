"""A TF1 digit classifier trained with a plain tf.compat.v1.Session, on every rank.

    perseusrun -np 2 python examples/session_run.py [--data mnist.npz] [--steps 300] [--smoke]

The script is ordinary single-process TF1 code; the lines marked `# perseus_legacy` make it
synchronous data-parallel: each rank trains on its own shard, and distribute_graph() rewrites the
plain Adam update ops to use gradients averaged over all ranks.
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
    args = parser.parse_args()
    steps = 20 if args.smoke else args.steps

    tf.compat.v1.disable_eager_execution()
    pl.init()  # perseus_legacy
    x_train, y_train, x_test, y_test = digits.load(args.data)
    shard = slice(pl.rank(), None, pl.size())  # perseus_legacy: every size()-th example
    x_train, y_train = x_train[shard], y_train[shard]  # perseus_legacy
    classes = int(max(y_train.max(), y_test.max())) + 1

    x = tf.compat.v1.placeholder(tf.float32, [None, x_train.shape[1]], name="x")
    y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
    logits = digits.model(x, classes)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    opt = tf.compat.v1.train.AdamOptimizer(pl.scale_learning_rate(digits.LR))  # perseus_legacy
    train_op = opt.minimize(loss)
    pl.distribute_graph()  # perseus_legacy: the Adam updates now use averaged gradients

    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
    with tf.compat.v1.Session(config=pl.session_config(config)) as sess:  # perseus_legacy
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(pl.broadcast_global_variables(0))  # perseus_legacy: start from rank 0's values
        data = digits.batches(x_train, y_train, digits.BATCH)
        start = time.perf_counter()
        for _ in range(steps):
            batch_x, batch_y = next(data)
            sess.run(train_op, {x: batch_x, y: batch_y})
        elapsed = time.perf_counter() - start
        test_accuracy = sess.run(accuracy, {x: x_test, y: y_test})  # the whole test set

    if pl.rank() == 0:  # perseus_legacy
        print(f"ranks: {pl.size()}  steps: {steps}  steps/s: {steps / elapsed:.1f}")
        print(f"test accuracy: {test_accuracy:.4f}")
    pl.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

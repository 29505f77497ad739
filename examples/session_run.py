"""A TF1 digit classifier trained with a plain tf.compat.v1.Session, on every rank.

    perseusrun -np 2 python examples/session_run.py [--data mnist.npz] [--steps 300] [--smoke]
    python examples/session_run.py --reference-ranks 2 [...]   # what 2 ranks must reach

The script is ordinary single-process TF1 code; the lines marked `# perseus_legacy` make it
synchronous data-parallel: each rank trains on its own shard, and distribute_graph() rewrites the
plain Adam update ops to use gradients averaged over all ranks. With --reference-ranks N, one
plain process skips them and trains on the N ranks' global batch instead (`reference` below).
"""

import perseus_legacy as pl  # perseus_legacy (first: before tensorflow)  # noqa: I001

import time

import tensorflow as tf

import digits

def main():
    parser = digits.session_arguments(__doc__)
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    # perseus_legacy: init(), this rank's shard, the learning rate scaled by size() (digits.py)
    setup = digits.session_setup(args)
    reference, rank, data, steps = setup.reference, setup.rank, setup.data, setup.steps

    x, y, loss, accuracy = digits.classifier(setup.features, setup.classes)
    train_op = tf.compat.v1.train.AdamOptimizer(setup.learning_rate).minimize(loss)
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
        test_accuracy = sess.run(accuracy, {x: setup.x_test, y: setup.y_test})  # the whole test set
        print(digits.weights_line(sess.run(tf.compat.v1.trainable_variables())))  # every rank

    if rank == 0:  # perseus_legacy
        print(f"ranks: {setup.ranks}  steps: {steps}  steps/s: {steps / elapsed:.1f}")
        print(f"test accuracy: {test_accuracy:.4f}")
    if not reference:
        pl.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

"""A TF1 digit classifier trained with MonitoredTrainingSession, on every rank.

    perseusrun -np 2 python examples/monitored_session.py [--data mnist.npz] [--steps 300]
        [--model-dir DIR] [--smoke]

The script is ordinary single-process TF1 code; the lines marked `# perseus_legacy` make it
synchronous data-parallel: each rank trains on its own shard, SyncReplicasHook rewrites the plain
Adam update ops to use gradients averaged over all ranks and broadcasts rank 0's variables, and
only rank 0 writes checkpoints.
"""

import perseus_legacy as pl  # perseus_legacy (first: before tensorflow)  # noqa: I001

import argparse
import tempfile
import time

import tensorflow as tf

import digits

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="MNIST .npz (default: scikit-learn's 8x8 digits)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model-dir", default=None, help="checkpoints (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="a tiny run: 20 steps")
    args = parser.parse_args()
    steps = 20 if args.smoke else args.steps

    tf.compat.v1.disable_eager_execution()
    pl.init()  # perseus_legacy
    # Only rank 0 writes checkpoints, so only rank 0 needs a default directory.
    model_dir = args.model_dir or (
        tempfile.mkdtemp(prefix="monitored_session_") if pl.is_chief() else None)
    x_train, y_train, x_test, y_test = digits.load(args.data)
    shard = slice(pl.rank(), None, pl.size())  # perseus_legacy: every size()-th example
    x_train, y_train = x_train[shard], y_train[shard]  # perseus_legacy
    classes = int(max(y_train.max(), y_test.max())) + 1

    x = tf.compat.v1.placeholder(tf.float32, [None, x_train.shape[1]], name="x")
    y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
    logits = digits.model(x, classes)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = tf.compat.v1.train.AdamOptimizer(pl.scale_learning_rate(digits.LR))  # perseus_legacy
    train_op = opt.minimize(loss, global_step=global_step)

    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
    hooks = [pl.SyncReplicasHook(),  # perseus_legacy: averaged gradients, rank 0's start values
             tf.compat.v1.train.StopAtStepHook(last_step=steps)]
    data = digits.batches(x_train, y_train, digits.BATCH)
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=pl.checkpoint_dir(model_dir),  # perseus_legacy: only rank 0 writes
            config=pl.session_config(config),  # perseus_legacy
            hooks=hooks, log_step_count_steps=None) as sess:
        done, start = 0, time.perf_counter()
        while not sess.should_stop():
            batch_x, batch_y = next(data)
            sess.run(train_op, {x: batch_x, y: batch_y})
            done += 1
        elapsed = time.perf_counter() - start
        # The whole test set, on the raw session: the hooks have already asked to stop.
        test_accuracy = sess.run_step_fn(
            lambda step_context: step_context.session.run(accuracy, {x: x_test, y: y_test}))

    if pl.rank() == 0:  # perseus_legacy
        print(f"ranks: {pl.size()}  steps: {done}  steps/s: {done / elapsed:.1f}")
        print(f"test accuracy: {test_accuracy:.4f}  checkpoints: {model_dir}")
    pl.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

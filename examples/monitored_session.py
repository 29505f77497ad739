"""A TF1 digit classifier trained with MonitoredTrainingSession, on every rank.

    perseusrun -np 2 python examples/monitored_session.py [--data mnist.npz] [--steps 300]
        [--model-dir DIR] [--smoke]
    python examples/monitored_session.py --reference-ranks 2 [...]   # what 2 ranks must reach

The script is ordinary single-process TF1 code; the lines marked `# perseus_legacy` make it
synchronous data-parallel: each rank trains on its own shard, SyncReplicasHook rewrites the plain
Adam update ops to use gradients averaged over all ranks and broadcasts rank 0's variables, and
only rank 0 writes checkpoints. With --reference-ranks N, one plain process skips them and
trains on the N ranks' global batch instead (`reference` below).
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
    # Only rank 0 writes checkpoints, so only rank 0 needs a default directory.
    model_dir = args.model_dir or (
        tempfile.mkdtemp(prefix="monitored_session_") if rank == 0 else None)

    x = tf.compat.v1.placeholder(tf.float32, [None, x_train.shape[1]], name="x")
    y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
    logits = digits.model(x, classes)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.AdamOptimizer(learning_rate).minimize(
        loss, global_step=global_step)

    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
    hooks = [tf.compat.v1.train.StopAtStepHook(last_step=steps),
             digits.PrintWeights()]  # every rank: the same weights
    if not reference:
        config = pl.session_config(config)  # perseus_legacy
        model_dir = pl.checkpoint_dir(model_dir)  # perseus_legacy: only rank 0 writes
        hooks.append(pl.SyncReplicasHook())  # perseus_legacy: averaged gradients, rank 0's values
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=model_dir, config=config, hooks=hooks,
            log_step_count_steps=None) as sess:
        done, start = 0, time.perf_counter()
        while not sess.should_stop():
            batch_x, batch_y = next(data)
            sess.run(train_op, {x: batch_x, y: batch_y})
            done += 1
        elapsed = time.perf_counter() - start
        # The whole test set, on the raw session: the hooks have already asked to stop.
        test_accuracy = sess.run_step_fn(
            lambda step_context: step_context.session.run(accuracy, {x: x_test, y: y_test}))

    if rank == 0:  # perseus_legacy
        print(f"ranks: {ranks}  steps: {done}  steps/s: {done / elapsed:.1f}")
        print(f"test accuracy: {test_accuracy:.4f}  checkpoints: {model_dir}")
    if not reference:
        pl.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

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

import tempfile
import time

import tensorflow as tf

import digits

def main():
    parser = digits.session_arguments(__doc__)
    parser.add_argument("--model-dir", default=None, help="checkpoints (default: a temp dir)")
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    # perseus_legacy: init(), this rank's shard, the learning rate scaled by size() (digits.py)
    setup = digits.session_setup(args)
    reference, rank, data, steps = setup.reference, setup.rank, setup.data, setup.steps
    # Only rank 0 writes checkpoints, so only rank 0 needs a default directory.
    model_dir = args.model_dir or (
        tempfile.mkdtemp(prefix="monitored_session_") if rank == 0 else None)

    x, y, loss, accuracy = digits.classifier(setup.features, setup.classes)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.AdamOptimizer(setup.learning_rate).minimize(
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
        test = {x: setup.x_test, y: setup.y_test}
        test_accuracy = sess.run_step_fn(
            lambda step_context: step_context.session.run(accuracy, test))

    if rank == 0:  # perseus_legacy
        print(f"ranks: {setup.ranks}  steps: {done}  steps/s: {done / elapsed:.1f}")
        print(f"test accuracy: {test_accuracy:.4f}  checkpoints: {model_dir}")
    if not reference:
        pl.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

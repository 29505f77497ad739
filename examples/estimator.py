"""A tf.estimator DNNClassifier on digits, trained synchronously on every rank.

    perseusrun -np 2 python examples/estimator.py [--data mnist.npz] [--steps 300]
        [--model-dir DIR] [--smoke]
    python examples/estimator.py --reference-ranks 2 [...]   # what 2 ranks must reach

Ordinary single-process Estimator code; the lines marked `# perseus_legacy` make it
synchronous data-parallel: run_config() (rank 0 checkpoints into model_dir, the others write
nothing) and each rank's own shard of the training data. estimator_hooks() is optional: the
config alone applies the same hook. Rank 0 evaluates the final checkpoint and prints a summary.
With --reference-ranks N, one plain process skips them and trains on the N ranks' global batch
instead (`reference` below).
"""

import perseus_legacy as pl  # perseus_legacy (first: brings back tf.estimator)  # noqa: I001

import argparse
import tempfile
import time

import tensorflow as tf

import digits

BATCH = 32  # examples per rank and step


def input_fns(data_path: str | None, reference: int = 0) -> tuple:
    """(train_input_fn, eval_input_fn, feature columns, classes); training data is sharded
    (reference: the global batches of `reference` ranks)."""
    x_train, y_train, x_test, y_test = digits.load(data_path)
    classes = int(max(y_train.max(), y_test.max())) + 1

    def shard_batches(index=None, count=None):
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x_train}, y_train))
        dataset = pl.data.shard(dataset, index, count)  # perseus_legacy: default rank(), size()
        return dataset.shuffle(len(x_train), seed=0).repeat().batch(BATCH)

    def train_input_fn():
        if reference:  # reference: every rank's batch of a step, concatenated
            return digits.concatenated([shard_batches(r, reference) for r in range(reference)])
        return shard_batches()

    def eval_input_fn():
        return tf.data.Dataset.from_tensor_slices(({"x": x_test}, y_test)).batch(256)

    columns = [tf.feature_column.numeric_column("x", shape=[x_train.shape[1]])]
    return train_input_fn, eval_input_fn, columns, classes


def classifier(config, columns: list, classes: int, reference: int = 0):
    """The model: a DNNClassifier with one hidden layer, Adam (its learning rate scaled)."""

    def optimizer():  # called for training only (a TF_CONFIG evaluator is no rank: no size())
        if reference:  # reference: the learning rate of `reference` ranks
            return tf.keras.optimizers.legacy.Adam(digits.LR * reference)
        return tf.keras.optimizers.legacy.Adam(pl.scale_learning_rate(digits.LR))  # perseus_legacy

    return tf.estimator.DNNClassifier(hidden_units=[digits.HIDDEN], feature_columns=columns,
                                      n_classes=classes, optimizer=optimizer, config=config)


class Throughput(tf.compat.v1.train.SessionRunHook):
    """Steps per second of this rank, from the end of the first step to the end of the last."""

    def __init__(self):
        self.steps, self.first, self.last = 0, None, None

    def after_run(self, run_context, run_values):
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last
        else:
            self.steps += 1

    def steps_per_second(self) -> float:
        return self.steps / (self.last - self.first) if self.steps else 0.0


def session_config():
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="MNIST .npz (default: scikit-learn's 8x8 digits)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model-dir", default=None, help="checkpoints (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="a tiny run: 40 steps")
    digits.add_reference_argument(parser)
    args = parser.parse_args()
    steps = 40 if args.smoke else args.steps
    reference = args.reference_ranks  # reference: 0 on the ranks of a job

    tf.get_logger().setLevel("ERROR")  # tf.estimator's deprecation notices
    if reference:  # reference: a plain RunConfig, no hooks
        rank, ranks, run_config, hooks = 0, reference, tf.estimator.RunConfig, []
    else:
        pl.init()  # perseus_legacy (run_config() would too): only rank 0 needs a model_dir
        rank, ranks = pl.rank(), pl.size()  # perseus_legacy
        run_config, hooks = pl.run_config, pl.estimator_hooks()  # perseus_legacy (hooks optional)
    model_dir = args.model_dir or (
        tempfile.mkdtemp(prefix="estimator_example_") if rank == 0 else None)
    config = run_config(model_dir=model_dir, tf_random_seed=1,
                        session_config=session_config(), log_step_count_steps=100)
    train_input_fn, eval_input_fn, columns, classes = input_fns(args.data, reference)
    est = classifier(config, columns, classes, reference)
    throughput = Throughput()
    est.train(train_input_fn, max_steps=steps,
              hooks=[*hooks, throughput, digits.PrintWeights()])  # every rank: the same weights

    if rank == 0:  # perseus_legacy: rank 0 holds the checkpoints
        metrics = est.evaluate(eval_input_fn)
        rate = throughput.steps_per_second()
        print(f"ranks: {ranks}  steps: {int(metrics['global_step'])}  steps/s: {rate:.1f}  "
              f"examples/s: {rate * BATCH * ranks:.0f}")
        print(f"test accuracy: {metrics['accuracy']:.4f}  final loss: {metrics['loss']:.4f}")
        print(f"checkpoint: {est.latest_checkpoint()}")


if __name__ == "__main__":
    main()

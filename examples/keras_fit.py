"""A tf-keras digit classifier trained with Model.fit, on every rank.

    perseusrun -np 2 python examples/keras_fit.py [--data mnist.npz] [--epochs 10]
        [--model-dir DIR] [--smoke]
    python examples/keras_fit.py --reference-ranks 2 [...]   # what 2 ranks must reach

Ordinary single-process Keras code; the lines marked `# perseus_legacy` make it synchronous
data-parallel: each rank fits its own shard, DistributedOptimizer averages the gradients, the
callbacks start every rank from rank 0's weights, warm the scaled learning rate up, average the
metrics and back training up (rank 0 writes; a restarted job resumes at the last epoch), and only
rank 0 saves the model. With --reference-ranks N, one plain process skips them and fits the N
ranks' global batches instead, with the same warmup as a learning rate schedule (`reference`
below).
"""

import perseus_legacy.keras as hvd  # perseus_legacy (first: selects tf-keras)  # noqa: I001

import argparse
import math
import os
import tempfile
import time

import tf_keras

import digits


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="MNIST .npz (default: scikit-learn's 8x8 digits)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--model-dir", default=None, help="model and backup (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="a tiny run: 2 epochs")
    digits.add_reference_argument(parser)
    args = parser.parse_args()
    epochs = 2 if args.smoke else args.epochs
    reference = args.reference_ranks  # reference: 0 on the ranks of a job

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="keras_fit_")
    x_train, y_train, x_test, y_test = digits.load(args.data)
    classes = int(max(y_train.max(), y_test.max())) + 1
    if reference:  # reference: each batch holds the N ranks' batches of a step
        rank, ranks, batch_size = 0, reference, digits.BATCH * reference
        x_train, y_train = digits.global_order(x_train, y_train, digits.BATCH, reference)
    else:
        hvd.init()  # perseus_legacy
        rank, ranks, batch_size = hvd.rank(), hvd.size(), digits.BATCH  # perseus_legacy
        # perseus_legacy: every size()-th example; equal shards, so every rank runs as many steps
        shard = slice(hvd.rank(), len(x_train) // hvd.size() * hvd.size(), hvd.size())
        x_train, y_train = x_train[shard], y_train[shard]  # perseus_legacy

    tf_keras.utils.set_random_seed(rank)  # any seed: rank 0's weights are broadcast
    model = tf_keras.Sequential([
        tf_keras.layers.Input((x_train.shape[1],)),
        tf_keras.layers.Dense(digits.HIDDEN, activation="relu"),
        tf_keras.layers.Dense(classes),
    ])
    warmup_epochs = min(3, epochs - 1) or 1
    if reference:  # reference: Goyal et al.'s warmup, from lr / N to lr, as a schedule
        lr, callbacks = digits.LR * reference, []
        opt = tf_keras.optimizers.Adam(tf_keras.optimizers.schedules.PolynomialDecay(
            lr / reference, warmup_epochs * math.ceil(len(x_train) / batch_size), lr, power=1))
    else:
        lr = hvd.scale_learning_rate(digits.LR)  # perseus_legacy: the global batch is size() x
        opt = hvd.DistributedOptimizer(tf_keras.optimizers.Adam(lr))  # perseus_legacy
        callbacks = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # perseus_legacy
            hvd.callbacks.MetricAverageCallback(),  # perseus_legacy: before metric readers
            hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs),  # perseus_legacy
            hvd.callbacks.BackupAndRestore(os.path.join(model_dir, "backup")),  # perseus_legacy
        ]
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    # The data is in random order already; a fixed order lets one process reproduce the ranks.
    model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, callbacks=callbacks,
              shuffle=False, verbose=2 if rank == 0 else 0)  # perseus_legacy: rank 0 reports
    elapsed = time.perf_counter() - start
    _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)  # the whole test set
    print(digits.weights_line(model.get_weights()))  # every rank: the same weights

    if rank == 0:  # perseus_legacy: one writer
        os.makedirs(model_dir, exist_ok=True)
        model.save(os.path.join(model_dir, "model.keras"))
        print(f"ranks: {ranks}  epochs: {epochs}  s/epoch: {elapsed / epochs:.2f}")
        print(f"test accuracy: {test_accuracy:.4f}")
    if not reference:
        hvd.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

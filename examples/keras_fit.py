"""A tf-keras digit classifier trained with Model.fit, on every rank.

    perseusrun -np 2 python examples/keras_fit.py [--data mnist.npz] [--epochs 10]
        [--model-dir DIR] [--smoke]

Ordinary single-process Keras code; the lines marked `# perseus_legacy` make it synchronous
data-parallel: each rank fits its own shard, DistributedOptimizer averages the gradients, the
callbacks start every rank from rank 0's weights, warm the scaled learning rate up, average the
metrics and back training up (rank 0 writes; a restarted job resumes at the last epoch), and only
rank 0 saves the model.
"""

import perseus_legacy.keras as hvd  # perseus_legacy (first: selects tf-keras)  # noqa: I001

import argparse
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
    args = parser.parse_args()
    epochs = 2 if args.smoke else args.epochs

    hvd.init()  # perseus_legacy
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="keras_fit_")
    x_train, y_train, x_test, y_test = digits.load(args.data)
    # perseus_legacy: every size()-th example; equal shards, so every rank runs as many steps
    shard = slice(hvd.rank(), len(x_train) // hvd.size() * hvd.size(), hvd.size())
    x_train, y_train = x_train[shard], y_train[shard]  # perseus_legacy
    classes = int(max(y_train.max(), y_test.max())) + 1

    tf_keras.utils.set_random_seed(hvd.rank())  # any seed: rank 0's weights are broadcast
    model = tf_keras.Sequential([
        tf_keras.layers.Input((x_train.shape[1],)),
        tf_keras.layers.Dense(digits.HIDDEN, activation="relu"),
        tf_keras.layers.Dense(classes),
    ])
    lr = hvd.scale_learning_rate(digits.LR)  # perseus_legacy: the global batch is size() x
    opt = hvd.DistributedOptimizer(tf_keras.optimizers.Adam(lr))  # perseus_legacy
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # perseus_legacy
        hvd.callbacks.MetricAverageCallback(),  # perseus_legacy: before metric readers
        hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=min(3, epochs - 1) or 1),
        hvd.callbacks.BackupAndRestore(os.path.join(model_dir, "backup")),  # perseus_legacy
    ]
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=digits.BATCH, epochs=epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)  # perseus_legacy: rank 0 reports
    elapsed = time.perf_counter() - start
    _, test_accuracy = model.evaluate(x_test, y_test, verbose=0)  # the whole test set

    if hvd.rank() == 0:  # perseus_legacy: one writer
        model.save(os.path.join(model_dir, "model.keras"))
        print(f"ranks: {hvd.size()}  epochs: {epochs}  s/epoch: {elapsed / epochs:.2f}")
        print(f"test accuracy: {test_accuracy:.4f}")
    hvd.shutdown()  # perseus_legacy


if __name__ == "__main__":
    main()

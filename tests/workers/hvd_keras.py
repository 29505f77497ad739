"""Runs on every rank: Horovod's Keras arguments and callbacks that perseus_legacy.keras added.

backward_passes_per_step (summed and averaged) equals single-process fit on the global batch;
PartialDistributedOptimizer and BroadcastGlobalVariablesCallback(local_variables) keep a local
layer per rank; LearningRateScheduleCallback sets Horovod's staircase rates;
BestModelCheckpoint saves on rank 0 only. Named cases, run by hvd_checks.py.
"""

from __future__ import annotations  # noqa: I001

import keras_common as kc
from keras_common import hvd

import os
import shutil
import tempfile

import numpy as np
from worker_util import agree, barrier, fail

from perseus_legacy import broadcast_object
from perseus_legacy.keras.keras2 import keras

EPOCHS = 2


def check_backward_passes(mode: str, average: bool) -> None:
    case = f"backward_passes_per_step=2 average={average} {mode}"
    m = kc.model(0)
    initial = m.get_weights()
    lr = 0.1
    kc.compile_model(m, hvd.DistributedOptimizer(
        keras.optimizers.SGD(lr), backward_passes_per_step=2,
        average_aggregated_gradients=average), run_eagerly=mode == "eager")
    inputs, y = kc.shard(*kc.data())
    # Two passes of BATCH/2 rows per update: the rows of one global batch of BATCH * size().
    m.fit(list(inputs), y, batch_size=kc.BATCH // 2, epochs=EPOCHS, shuffle=False, verbose=0)
    agree(hvd.rank(), case, m.get_weights())
    if m.optimizer.iterations.numpy() != EPOCHS * len(y) // (kc.BATCH // 2):
        fail(hvd.rank(),
             f"{case}: iterations {m.optimizer.iterations.numpy()} do not count every pass")
    if hvd.rank() == 0:
        # Summed passes are twice the mean: the same as SGD with twice the rate.
        reference_lr = lr if average else 2 * lr
        expected = kc.reference_weights(initial, keras.optimizers.SGD(reference_lr), EPOCHS,
                                        hvd.size())
        for i, (got, want) in enumerate(zip(m.get_weights(), expected)):
            if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                fail(hvd.rank(), f"{case}: weight {i} differs from single-process fit by "
                        f"{np.abs(got - want).max()}")
        print(f"{case}: same weights as single-process fit on the global batch", flush=True)
    barrier(case)


def check_local_layer(rank: int, size: int) -> None:
    keras.utils.set_random_seed(100 + hvd.rank())  # every rank starts from other weights
    shared = keras.layers.Dense(4, activation="tanh")
    local = keras.layers.Dense(kc.CLASSES)
    features = keras.Input((kc.FEATURES,))
    m = keras.Model(features, local(shared(features)))
    kc.compile_model(m, hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                        local_layers=[local]))
    (x, _), y = kc.shard(*kc.data())
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(
        0, local_variables=local.trainable_weights)
    m.fit(x, y, batch_size=kc.BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    agree(hvd.rank(), "PartialDistributedOptimizer shared layer", shared.get_weights())
    everyone = hvd.allgather(kc.flat(local.get_weights())[None, :]).numpy()
    if np.allclose(everyone[0], everyone[1]):
        fail(hvd.rank(), "PartialDistributedOptimizer: the local layer is the same on every rank")
    print("local layer: shared weights equal, local weights per rank", flush=True)


def check_backward_passes_averaged_graph(rank: int, size: int) -> None:
    check_backward_passes("graph", average=True)


def check_backward_passes_averaged_eager(rank: int, size: int) -> None:
    check_backward_passes("eager", average=True)


def check_backward_passes_summed_graph(rank: int, size: int) -> None:
    check_backward_passes("graph", average=False)


def check_schedule_and_best_checkpoint(rank: int, size: int) -> None:
    """In a directory rank 0 makes and names to the others (the ranks share a host)."""
    shared_dir = broadcast_object(tempfile.mkdtemp(prefix="hvd_keras_") if rank == 0 else None,
                                  root_rank=0)
    try:
        schedule_and_best_checkpoint(shared_dir)
    finally:
        barrier("best checkpoint read")
        if rank == 0:
            shutil.rmtree(shared_dir, ignore_errors=True)


def schedule_and_best_checkpoint(shared_dir: str) -> None:
    lrs = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(keras.backend.get_value(self.model.optimizer.learning_rate)))

    m = kc.model(0)
    kc.compile_model(m, hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.3)))
    inputs, y = kc.shard(*kc.data())
    path = os.path.join(shared_dir, f"best-rank{hvd.rank()}.h5")
    history = m.fit(list(inputs), y, batch_size=kc.BATCH, epochs=4, shuffle=False, verbose=0,
                    validation_data=(list(inputs), y),
                    callbacks=[hvd.callbacks.LearningRateScheduleCallback(
                        0.2, 0.5, start_epoch=1, end_epoch=3),
                        hvd.callbacks.MetricAverageCallback(),
                        hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=path),
                        Record()])
    steps = len(y) // kc.BATCH
    expected = [0.3] * steps + [0.2] * steps + [0.1] * (2 * steps)  # unchanged after epoch 3
    if not np.allclose(lrs, expected):
        fail(hvd.rank(), f"LearningRateScheduleCallback rates {lrs}, expected {expected}")
    if not np.allclose(history.history["lr"], [0.3, 0.2, 0.1, 0.1]):
        fail(hvd.rank(), f"logged lr {history.history['lr']}")
    barrier("best checkpoint")
    saved = sorted(f for f in os.listdir(shared_dir) if f.startswith("best-"))
    if saved != ["best-rank0.h5"]:
        fail(hvd.rank(), f"BestModelCheckpoint files {saved}, expected rank 0's only")
    print("schedule and best checkpoint: ok", flush=True)


# The cases, in the order they run: hvd_checks.py runs `hvd_keras.<case>` as check_<case>.
CASES = ("backward_passes_averaged_graph", "backward_passes_averaged_eager",
         "backward_passes_summed_graph", "local_layer", "schedule_and_best_checkpoint")

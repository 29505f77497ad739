"""Runs on every rank: the perseus_legacy.keras callbacks and load_model; writes what it saw.

argv[1]: a directory shared by the ranks. Each rank writes rank<r>.json there (learning rates
and momenta per batch, raw and averaged metrics, weights before and after the broadcast, the
epochs run around a stop and a resume, ...); the test checks them against numpy.
"""

from __future__ import annotations  # noqa: I001

import keras_common as kc
from keras_common import hvd

import os
import sys

import numpy as np
from worker_util import agree, barrier, fail
import tf_keras

WARMUP_EPOCHS, INITIAL_LR, MOMENTUM = 2, 0.1, 0.9
BACKUP_EPOCHS, STOP_AT = 4, 2


class Recorder(tf_keras.callbacks.Callback):
    """Calls `record(self, event, *args)` for the events it is given."""

    def __init__(self, **events):
        super().__init__()
        for event, record in events.items():
            setattr(self, event, record.__get__(self))


class Stop(Exception):
    pass


def fitted(seed: int, optimizer, callbacks: list, epochs: int, **kwargs) -> tf_keras.Model:
    m = kc.model(seed)
    kc.compile_model(m, hvd.DistributedOptimizer(optimizer))
    inputs, y = kc.shard(*kc.data())
    m.fit(list(inputs), y, batch_size=kc.BATCH, epochs=epochs, shuffle=False, verbose=0,
          callbacks=callbacks, **kwargs)
    return m


def warmup() -> dict:
    lr = INITIAL_LR * hvd.size()
    seen = {"lr": [], "momentum": [], "lr_before": lr, "momentum_after": None}

    def batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        seen["lr"].append(float(tf_keras.backend.get_value(opt.learning_rate)))
        seen["momentum"].append(float(tf_keras.backend.get_value(opt.momentum)))

    def train_end(self, logs=None):
        seen["momentum_after"] = float(tf_keras.backend.get_value(self.model.optimizer.momentum))

    callbacks = [hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=WARMUP_EPOCHS),
                 Recorder(on_train_batch_begin=batch_begin, on_train_end=train_end)]
    fitted(0, tf_keras.optimizers.legacy.SGD(lr, momentum=MOMENTUM), callbacks,
           WARMUP_EPOCHS + 1)
    seen.update(initial_lr=lr, warmup_epochs=WARMUP_EPOCHS, base_momentum=MOMENTUM,
                steps_per_epoch=kc.EXAMPLES // hvd.size() // kc.BATCH)
    return seen


def metric_average() -> dict:
    seen = {"raw": [], "averaged": []}

    def raw(self, epoch, logs=None):
        seen["raw"].append({k: float(v) for k, v in logs.items()})

    def averaged(self, epoch, logs=None):
        seen["averaged"].append({k: float(v) for k, v in logs.items()})

    m = fitted(0, tf_keras.optimizers.SGD(0.1),
               [Recorder(on_epoch_end=raw), hvd.callbacks.MetricAverageCallback(),
                Recorder(on_epoch_end=averaged)], 2)
    seen["history"] = {k: [float(v) for v in vs] for k, vs in m.history.history.items()}
    return seen


def broadcast() -> dict:
    seen = {}

    def first_batch(self, batch, logs=None):
        seen.setdefault("first_batch", kc.flat(self.model.get_weights()).tolist())

    seed = 10 + hvd.rank()  # every rank starts from other weights
    seen["initial"] = kc.flat(kc.model(seed).get_weights()).tolist()
    m = fitted(seed, tf_keras.optimizers.Adam(0.01),
               [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                Recorder(on_train_batch_begin=first_batch)], 1)
    agree(hvd.rank(), "after fit with BroadcastGlobalVariablesCallback", m.get_weights())
    return seen


def backup_and_restore(shared: str) -> dict:
    # Each rank names its own directory: only rank 0's may ever appear.
    backup_dir = os.path.join(shared, f"backup-rank{hvd.rank()}")
    seen = {"stopped_run": [], "resumed_run": []}

    def begun(run):
        return lambda self, epoch, logs=None: seen[run].append(epoch)

    def stop(self, epoch, logs=None):
        if epoch == STOP_AT:
            raise Stop()

    try:
        fitted(1, tf_keras.optimizers.Adam(0.01),
               [hvd.callbacks.BackupAndRestore(backup_dir),
                Recorder(on_epoch_begin=begun("stopped_run")), Recorder(on_epoch_begin=stop)],
               BACKUP_EPOCHS)
        fail(hvd.rank(), "the run was not stopped")
    except Stop:
        pass
    barrier("stopped")
    seen["backup_dirs_after_stop"] = sorted(
        d for d in os.listdir(shared) if d.startswith("backup-rank"))
    barrier("listed")
    # A new process would start from fresh random weights: different ones on every rank here.
    resumed = fitted(20 + hvd.rank(), tf_keras.optimizers.Adam(0.01),
                     [hvd.callbacks.BackupAndRestore(backup_dir),
                      Recorder(on_epoch_begin=begun("resumed_run"))], BACKUP_EPOCHS)
    seen["backup_left_after_resume"] = os.path.exists(os.path.join(backup_dir, "chief"))
    uninterrupted = fitted(1, tf_keras.optimizers.Adam(0.01), [], BACKUP_EPOCHS)
    seen["resumed"] = kc.flat(resumed.get_weights()).tolist()
    seen["uninterrupted"] = kc.flat(uninterrupted.get_weights()).tolist()
    return seen


def load_model(shared: str) -> dict:
    path = os.path.join(shared, "model.keras")
    m = kc.model(0)
    initial = m.get_weights()
    kc.compile_model(m, hvd.DistributedOptimizer(tf_keras.optimizers.Adam(0.01)))
    inputs, y = kc.shard(*kc.data())
    m.fit(list(inputs), y, batch_size=kc.BATCH, epochs=1, shuffle=False, verbose=0)
    if hvd.rank() == 0:
        m.save(path)
    barrier("saved")
    plain = tf_keras.models.load_model(path)
    loaded = hvd.load_model(path)
    seen = {"plain_is_distributed": isinstance(plain.optimizer,
                                               hvd.optimizer.DistributedOptimizerMixin),
            "loaded_is_distributed": isinstance(loaded.optimizer,
                                                hvd.optimizer.DistributedOptimizerMixin),
            "loaded_class": type(loaded.optimizer).__name__,
            "iterations_saved": int(m.optimizer.iterations),
            "iterations_loaded": int(loaded.optimizer.iterations)}
    loaded.fit(list(inputs), y, batch_size=kc.BATCH, epochs=1, shuffle=False, verbose=0)
    agree(hvd.rank(), "after fit of the loaded model", loaded.get_weights())
    if hvd.rank() == 0:
        expected = kc.reference_weights(initial, tf_keras.optimizers.Adam(0.01), 2, hvd.size())
        seen["max_diff_to_single_process"] = float(
            np.abs(kc.flat(loaded.get_weights()) - kc.flat(expected)).max())
    return seen


def main() -> None:
    shared = sys.argv[1]
    hvd.init()
    results = {"size": hvd.size(), "warmup": warmup(), "metric_average": metric_average(),
               "broadcast": broadcast(), "backup": backup_and_restore(shared),
               "load_model": load_model(shared)}
    kc.write_json(os.path.join(shared, f"rank{hvd.rank()}.json"), results)
    barrier("done")
    hvd.shutdown()


if __name__ == "__main__":
    main()

"""An elastic training loop (run by perseusrun --tcp in elastic mode on every worker): a linear
model trained on seeded global batches with @hvd.elastic.run, committing after every step.

    elastic_train.py keras|tape MIN_STEPS ROUNDS MAX_STEPS

`keras`: a Keras 2 model compiled with hvd.DistributedOptimizer, train_on_batch, KerasState.
`tape`: the same model trained eagerly with hvd.DistributedGradientTape, TensorFlowKerasState.
Step s trains on global batch s (GLOBAL_BATCH rows, the same on every worker), each rank on its
contiguous share of it; with an Average allreduce that equals one process on the whole batch,
whatever the group's size, so the final weights must equal reference() over the steps done.
Training runs until MIN_STEPS steps are done and the group has trained ROUND_STEPS steps in its
ROUNDS-th round (the test removes and adds hosts meanwhile), at most MAX_STEPS. Rank 0 prints
one line per step (`STEP s SIZE n ROUND r TIME t`), the first round's initial weights and the
final ones (JSON lines).
Every worker starts from other initial weights: sync() must give newcomers rank 0's.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy.keras as hvd_keras

import json
import os
import sys
import time
import zlib

import numpy as np
import tensorflow as tf

import perseus_legacy as hvd
from perseus_legacy.common import elastic_client
from perseus_legacy.keras import elastic as keras_elastic
from perseus_legacy.keras.keras2 import keras

FEATURES = 4
GLOBAL_BATCH = 12  # divisible by 3 and 4 ranks
LEARNING_RATE = 0.05
ROUND_STEPS = 5  # steps the last round trains at least
TRUE_W = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step`: the same on every worker."""
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = (x @ TRUE_W + 0.1 * rng.normal(size=(GLOBAL_BATCH, 1))).astype(np.float32)
    return x, y


def reference(kernel: np.ndarray, bias: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """One process's SGD on the mean squared error over global batches 0 .. steps-1 (float64)."""
    w, b = kernel.astype(np.float64), bias.astype(np.float64)
    for step in range(steps):
        x, y = global_batch(step)
        residual = x @ w + b - y
        w = w - LEARNING_RATE * 2.0 * x.T @ residual / GLOBAL_BATCH
        b = b - LEARNING_RATE * 2.0 * residual.mean(axis=0)
    return w, b


def share(step: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = global_batch(step)
    rows = GLOBAL_BATCH // hvd.size()
    part = slice(hvd.rank() * rows, (hvd.rank() + 1) * rows)
    return x[part], y[part]


def build_model() -> keras.Model:
    worker = os.environ.get("PERSEUS_ELASTIC_WORKER", "")
    seed = zlib.crc32(worker.encode()) % 1000
    model = keras.Sequential([keras.layers.Dense(
        1, kernel_initializer=keras.initializers.RandomNormal(seed=seed),
        bias_initializer=keras.initializers.RandomNormal(seed=seed + 1))])
    model.build((None, FEATURES))
    return model


def say(what: str, **values) -> None:
    print(json.dumps({"what": what, "pid": os.getpid(),
                      "worker": os.environ.get("PERSEUS_ELASTIC_WORKER"), **values}), flush=True)


def main() -> None:
    mode, min_steps, rounds, max_steps = sys.argv[1], *map(int, sys.argv[2:5])
    hvd.init()
    say("started")
    model = build_model()
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
    if mode == "keras":
        model.compile(optimizer=hvd_keras.DistributedOptimizer(optimizer), loss="mse")
        state = keras_elastic.KerasState(model, optimizer=optimizer, step=0)
    else:
        state = hvd.elastic.TensorFlowKerasState(model, optimizer=optimizer, step=0)
    if hvd.rank() == 0 and elastic_client.current_round() == 1:
        say("initial", kernel=model.get_weights()[0].tolist(),
            bias=model.get_weights()[1].tolist())

    def tape_step(x: np.ndarray, y: np.ndarray) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @hvd.elastic.run
    def train(state) -> None:
        in_this_round = 0  # every rank of a round counts the same: each call starts one
        while state.step < max_steps and not (
                state.step >= min_steps and elastic_client.current_round() >= rounds
                and in_this_round >= ROUND_STEPS):
            in_this_round += 1
            x, y = share(state.step)
            if mode == "keras":
                model.train_on_batch(x, y)
            else:
                tape_step(x, y)
            state.step += 1
            if hvd.rank() == 0:
                print(f"STEP {state.step} SIZE {hvd.size()} ROUND "
                      f"{elastic_client.current_round()} TIME {time.time():.3f}", flush=True)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        say("final", steps=state.step, size=hvd.size(), round=elastic_client.current_round(),
            kernel=model.get_weights()[0].tolist(), bias=model.get_weights()[1].tolist())


if __name__ == "__main__":
    main()

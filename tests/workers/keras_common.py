"""What the tf-keras test workers share: seeded data, a small model, the single-process reference.

The model has a dense input and an embedding lookup (its gradient is a sparse tf.IndexedSlices),
so both reduction paths of DistributedOptimizer are exercised.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy.keras as hvd

import json

import numpy as np
from perseus_legacy.keras.keras2 import keras as tf_keras  # tf-keras, or tf.keras on TF < 2.16

FEATURES, VOCAB, CLASSES = 6, 10, 3
EXAMPLES = 96  # divisible by BATCH * 2 and BATCH * 3
BATCH = 8  # per rank
OPTIMIZERS = {
    "sgd": lambda lr=0.1: tf_keras.optimizers.SGD(lr),
    "momentum": lambda lr=0.05: tf_keras.optimizers.SGD(lr, momentum=0.9),
    "adam": lambda lr=0.01: tf_keras.optimizers.Adam(lr),
    "legacy_adam": lambda lr=0.01: tf_keras.optimizers.legacy.Adam(lr),
}


def data(seed: int = 0) -> tuple:
    """((dense features, token ids), labels): the global data set, the same on every rank."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    tokens = rng.integers(0, VOCAB, size=(EXAMPLES, 1)).astype(np.int32)
    y = ((x[:, 0] > 0).astype(np.int64) + (tokens[:, 0] % 2)) % CLASSES
    return (x, tokens), y


def shard(inputs: tuple, y: np.ndarray) -> tuple:
    """This rank's every size()-th example: its batch i is a part of global batch i."""
    rows = slice(hvd.rank(), None, hvd.size())
    return tuple(a[rows] for a in inputs), y[rows]


def model(seed: int) -> tf_keras.Model:
    """A built functional model whose initial weights depend only on `seed`."""
    tf_keras.utils.set_random_seed(seed)
    dense_in = tf_keras.Input((FEATURES,), name="features")
    token_in = tf_keras.Input((1,), dtype="int32", name="token")
    embedded = tf_keras.layers.Flatten()(tf_keras.layers.Embedding(VOCAB, 4)(token_in))
    hidden = tf_keras.layers.Dense(8, activation="tanh")(
        tf_keras.layers.Concatenate()([dense_in, embedded]))
    return tf_keras.Model([dense_in, token_in], tf_keras.layers.Dense(CLASSES)(hidden))


def compile_model(m: tf_keras.Model, optimizer, run_eagerly: bool = False) -> None:
    m.compile(optimizer=optimizer, run_eagerly=run_eagerly, metrics=["accuracy"],
              loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def reference_weights(initial: list, optimizer, epochs: int, size: int) -> list:
    """Plain single-process tf-keras (no perseus op) on the global batch BATCH * size."""
    m = model(0)
    m.set_weights(initial)
    compile_model(m, optimizer)
    inputs, y = data()
    m.fit(list(inputs), y, batch_size=BATCH * size, epochs=epochs, shuffle=False, verbose=0)
    return m.get_weights()


def flat(weights: list) -> np.ndarray:
    return np.concatenate([np.ravel(w).astype(np.float64) for w in weights])


def write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f)

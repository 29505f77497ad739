"""TF1-style Keras on every rank through a session set with `K.set_session` (Horovod's TF1 Keras
recipe): `from tensorflow.keras import backend as K`, a ConfigProto naming this rank's GPU and
one thread, `K.set_session(tf.compat.v1.Session(config=config))`, then compile and fit in the
graph with perseus_legacy.DistributedOptimizer.

Usage: keras_session.py OUT_DIR rank    (perseusrun -np N)
       keras_session.py OUT_DIR plain   (one process on the global batch, no perseus_legacy
                                         collectives: the reference, and the check on a
                                         TensorFlow without perseus_legacy's op library)

Each process checks that Keras trained in the session it set (K.get_session() and
tf.compat.v1.keras.backend.get_session() are that session, with that config) and writes
OUT_DIR/<rank<R>|plain>.npz: the trained weights read through that session.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it selects legacy Keras.
import perseus_legacy as pl

import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow.keras import backend as K

STEPS, GLOBAL_BATCH, FEATURES = 4, 8, 3
LEARNING_RATE = 0.1


def global_batches() -> tuple:
    rng = np.random.RandomState(3)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.25).astype(np.float32)
    return x, y


def main() -> None:
    out, mode = sys.argv[1:]
    v1 = tf.compat.v1.keras.backend
    assert K.set_session is v1.set_session and K.get_session is v1.get_session
    report = pl.tf_compat.compat_report()["tf.keras.backend.set_session, get_session"]
    print(f"keras sessions: {report}", flush=True)
    tf.compat.v1.disable_eager_execution()
    if mode == "plain":
        rank, size, local_rank, who = 0, 1, 0, "plain"
    else:
        pl.init()
        rank, size, local_rank, who = pl.rank(), pl.size(), pl.local_rank(), f"rank{pl.rank()}"
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
    config.gpu_options.visible_device_list = str(local_rank)
    session = tf.compat.v1.Session(config=config)
    K.set_session(session)

    x, y = global_batches()
    local = GLOBAL_BATCH // size
    mine = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local,
                                     s * GLOBAL_BATCH + (rank + 1) * local) for s in range(STEPS)])
    # Each rank starts elsewhere: the broadcast makes them all start from rank 0's weights.
    initial = tf.keras.initializers.Constant([[0.3 + rank], [0.2], [-0.1]])
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(FEATURES,),
                                                       kernel_initializer=initial)])
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(LEARNING_RATE)
    if mode != "plain":
        optimizer = pl.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer, loss="mse")
    if mode != "plain":
        K.get_session().run(pl.broadcast_global_variables(0))
    model.fit(x[mine], y[mine], batch_size=local, epochs=1, shuffle=False, verbose=0)

    used = K.get_session()
    if used is not session or tf.compat.v1.keras.backend.get_session() is not session:
        print(f"[rank {rank}] FAILED: Keras did not train in the session set", flush=True)
        sys.exit(1)
    if session._config.gpu_options.visible_device_list != str(local_rank):
        print(f"[rank {rank}] FAILED: the session lost its config: {session._config}", flush=True)
        sys.exit(1)
    kernel, bias = session.run(model.weights)
    np.savez(os.path.join(out, f"{who}.npz"), kernel=kernel, bias=bias)
    print(f"[{who}] trained in the session it set", flush=True)


if __name__ == "__main__":
    main()

"""Runs on every rank: programs written for elastic Horovod, unchanged but for the import, on a
fixed set of ranks.

Every rank starts from other values (model, optimizer slots, state attributes); @elastic.run
must give every rank rank 0's, and training must then equal one process on the global batch.
A custom loop with TensorFlowKerasState and commits per batch, Model.fit with KerasState and
the Commit/UpdateBatch/UpdateEpoch callbacks, and a tf.compat.v1 Session with TensorFlowState;
restore() returns to the last commit, dropping a step taken after it. Named cases, run by
hvd_checks.py.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import keras_common as kc
from keras_common import hvd as hvd_keras

import numpy as np
import tensorflow as tf
from worker_util import agree, assert_close, fail, rank_data

import perseus_legacy as hvd
from perseus_legacy.keras.optimizer import optimizer_variables
from perseus_legacy.keras.keras2 import keras

EPOCHS = 2


def momentum_sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def start_of(rank: int) -> tuple:
    """The model and momentum SGD of `rank` before any sync: weights and slots differ by rank."""
    model = kc.model(100 + rank)
    opt = momentum_sgd()
    opt.build(model.trainable_variables)
    for k, var in enumerate(optimizer_variables(opt)):
        if var.dtype.is_floating:
            var.assign(tf.fill(var.shape, 0.01 * (rank + 1) * (k + 1)))
    return model, opt


def loss_of(model, inputs, y):
    logits = model(list(inputs), training=True)
    return tf.reduce_mean(
        keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))


def check_custom_loop(rank: int, size: int) -> None:
    model, opt = start_of(rank)
    inputs, y = kc.shard(*kc.data())
    steps = len(y) // kc.BATCH

    @tf.function
    def training_step(x0, x1, labels):
        with tf.GradientTape() as tape:
            loss = loss_of(model, (x0, x1), labels)
        tape = hvd.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    def step(batch: int) -> None:
        rows = slice(batch * kc.BATCH, (batch + 1) * kc.BATCH)
        training_step(inputs[0][rows], inputs[1][rows], y[rows])

    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0, epoch=0, owner=rank)
    state.register_reset_callbacks([lambda: fail(rank, "a reset callback was called")])

    @hvd.elastic.run
    def train(state):
        if state.owner != 0:
            fail(rank, f"state.owner is {state.owner} after the sync, not rank 0's 0")
        while state.epoch < EPOCHS:
            while state.batch < steps:
                step(state.batch)
                state.batch += 1
                state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    # One process on the global batch, from rank 0's model and optimizer.
    reference, reference_opt = start_of(0)
    everything, labels = kc.data()
    for _ in range(EPOCHS):
        for batch in range(steps):
            rows = slice(batch * kc.BATCH * size, (batch + 1) * kc.BATCH * size)
            with tf.GradientTape() as tape:
                loss = loss_of(reference, tuple(a[rows] for a in everything), labels[rows])
            reference_opt.apply_gradients(zip(tape.gradient(loss, reference.trainable_variables),
                                              reference.trainable_variables))
    committed = model.get_weights()
    for k, (got, want) in enumerate(zip(committed, reference.get_weights())):
        assert_close(rank, f"elastic custom loop: weight {k}", got, want, 1e-5, 1e-6)
    agree(hvd.rank(), "elastic custom loop", committed)
    slots = [v.numpy() for v in optimizer_variables(opt)]
    step(0)  # not committed: restore() drops it
    state.epoch = 99
    state.restore()
    for k, (got, want) in enumerate(zip(model.get_weights(), committed)):
        assert_close(rank, f"restore(): weight {k}", got, want)
    for k, (var, want) in enumerate(zip(optimizer_variables(opt), slots)):
        assert_close(rank, f"restore(): optimizer variable {k}", var.numpy(), want)
    if (state.epoch, state.batch) != (EPOCHS, 0):
        fail(rank, f"restore(): epoch, batch = {state.epoch}, {state.batch}")
    objects = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, values=[rank])
    objects.check_host_updates()  # the hosts never change: no HostsUpdatedInterrupt
    objects.sync()
    objects.values.append("uncommitted")
    objects.restore()
    if objects.values != [0]:
        fail(rank, f"ObjectState values {objects.values} after sync and restore, expected [0]")
    print("custom loop: rank 0's state everywhere, one-process weights, restore", flush=True)


class CountingKerasState(hvd_keras.elastic.KerasState):
    """KerasState counting its commits (the count is no state attribute)."""

    def __init__(self, *args, **kwargs) -> None:
        self.commits = 0
        super().__init__(*args, **kwargs)

    def commit(self) -> None:
        self.commits += 1
        super().commit()


def check_keras_fit(rank: int, size: int) -> None:
    model = kc.model(100 + rank)
    kc.compile_model(model, hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    inputs, y = kc.shard(*kc.data())
    state = CountingKerasState(model, batch=0, epoch=0)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((state.epoch, state.batch == batch))

    per_commit = 2
    callbacks = [hvd_keras.elastic.UpdateEpochStateCallback(state),
                 hvd_keras.elastic.UpdateBatchStateCallback(state),
                 hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=per_commit),
                 Record()]

    @hvd_keras.elastic.run
    def train(state):
        state.model.fit(list(inputs), y, batch_size=kc.BATCH, epochs=EPOCHS - state.epoch,
                        callbacks=callbacks, shuffle=False, verbose=0)

    train(state)
    expected = kc.reference_weights(kc.model(100).get_weights(), keras.optimizers.SGD(0.1),
                                    EPOCHS, size)
    for k, (got, want) in enumerate(zip(model.get_weights(), expected)):
        assert_close(rank, f"elastic fit: weight {k}", got, want, 1e-5, 1e-6)
    steps = len(y) // kc.BATCH
    if seen != [(epoch, True) for epoch in range(EPOCHS) for _ in range(steps)]:
        fail(rank, f"state (epoch, batch is the batch index) during fit: {seen}")
    if (state.epoch, state.batch) != (EPOCHS, 0):
        fail(rank, f"after fit: epoch, batch = {state.epoch}, {state.batch}")
    if state.commits != EPOCHS * steps // per_commit + EPOCHS:
        fail(rank, f"{state.commits} commits in {EPOCHS} epochs of {steps} batches")
    print("fit: rank 0's start, one-process weights, epoch/batch/commit callbacks", flush=True)


def check_tf1_session(rank: int, size: int) -> None:
    lr, steps = 0.1, 3
    xs = [rank_data(r, (4, 3), np.float32, seed=30) for r in range(size)]
    ys = [rank_data(r, (4,), np.float32, seed=31) for r in range(size)]
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.Variable(rank_data(rank, (3,), np.float32, seed=32), use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.linalg.matvec(tf.constant(xs[rank]), w) - ys[rank]))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr))
        init = tf.compat.v1.global_variables_initializer()
        with tf.compat.v1.Session() as session:
            session.run(init)
            state = hvd.elastic.TensorFlowState(session=session, batch=0)
            train_op = opt.minimize(loss)

            @hvd.elastic.run
            def train(state, step):
                while state.batch < steps:
                    step()
                    state.batch += 1
                    state.commit()

            train(state, lambda: session.run(train_op))
            committed = session.run(w)
            session.run(train_op)  # not committed: restore() drops it
            state.restore()
            restored = session.run(w)
    expected = rank_data(0, (3,), np.float32, seed=32).astype(np.float64)
    for _ in range(steps):  # the mean of every rank's gradient of mean((x w - y)^2)
        expected = expected - lr * np.mean(
            [2.0 * x.T @ (x @ expected - y) / len(y) for x, y in zip(xs, ys)], axis=0)
    assert_close(rank, "elastic TF1 session: variable", committed,
                 expected.astype(np.float32), 1e-5, 1e-6)
    assert_close(rank, "elastic TF1 session: restore()", restored, committed)
    if state.batch != steps:
        fail(rank, f"elastic TF1 session: state.batch {state.batch}, expected {steps}")
    print("TF1 session: rank 0's start, numpy result, restore", flush=True)


# The cases, in the order they run: hvd_checks.py runs `hvd_elastic.<case>` as check_<case>.
CASES = ("custom_loop", "keras_fit", "tf1_session")

"""Runs on every rank (a power of 2 of them): op=Adasum against a numpy tree of every rank's data.

allreduce and grouped_allreduce (eager, tf.function; float16/32/64, zero, orthogonal and parallel
tensors, scale factors, fp16 compression, a process set), bitwise the same on every rank;
DistributedGradientTape, the Keras DistributedOptimizer (directly and through
perseus_legacy.DistributedOptimizer) and the TF1 DistributedOptimizer, whose Adasum combines
the variables' changes after local steps (1 and 2 passes, in a graph; 1 eagerly). The errors:
sparse and integer tensors, reducescatter, gradients, a non-power-of-2 process set. Named cases,
run by hvd_checks.py.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as hvd

import numpy as np
import tensorflow as tf
from worker_util import agree, assert_close, expect_error, fail, rank_data

import perseus_legacy.keras as hvd_keras
from perseus_legacy.keras.keras2 import keras


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Horovod's combination of two flat float64 vectors; a zero vector keeps coefficient 1."""
    dot, a_sq, b_sq = float(a @ b), float(a @ a), float(b @ b)
    a_coefficient = 1.0 - dot / (2.0 * a_sq) if a_sq > 0 else 1.0
    b_coefficient = 1.0 - dot / (2.0 * b_sq) if b_sq > 0 else 1.0
    return a_coefficient * a + b_coefficient * b


def adasum_tree(per_rank: list) -> np.ndarray:
    """Ranks combined pairwise (0 with 1, 2 with 3, ...), then the results pairwise, ..."""
    level = [np.ravel(np.asarray(x, np.float64)) for x in per_rank]
    while len(level) > 1:
        level = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].reshape(np.shape(per_rank[0]))


def signed_data(rank: int, shape, dtype, seed: int) -> np.ndarray:
    return (rank_data(rank, shape, np.float64, seed) - 1.0).astype(dtype)


TOLERANCE = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-12}


def expect(rank: int, what: str, got: np.ndarray, per_rank: list, dtype, scale: float = 1.0):
    expected = (adasum_tree(per_rank) * scale).astype(dtype)
    tol = TOLERANCE[dtype]
    assert_close(rank, what, got, expected, tol, tol)


def check_allreduce(rank: int, size: int) -> None:
    cases = []  # (label, dtype, every rank's tensor, expected or None for the numpy tree)
    for dtype in (np.float32, np.float64, np.float16):
        name = np.dtype(dtype).name
        for shape in ((3, 4), ()):
            cases += [
                (f"{name} {shape} random", dtype,
                 [signed_data(r, shape, dtype, 1) for r in range(size)], None),
                (f"{name} {shape} rank 1 zero", dtype,
                 [np.zeros(shape, dtype) if r == 1 else signed_data(r, shape, dtype, 2)
                  for r in range(size)], None),
                (f"{name} {shape} all zero", dtype, [np.zeros(shape, dtype)] * size, None)]
        # Orthogonal tensors add up; equal (parallel) ones give the tensor itself.
        cases.append((f"{name} orthogonal", dtype, list(np.eye(size, dtype=dtype)),
                      np.ones(size, dtype)))
        same = signed_data(0, (5,), dtype, 3)
        cases.append((f"{name} parallel", dtype, [same] * size, same))
    first = cases[0]
    got = hvd.allreduce(tf.constant(first[2][rank]), op=hvd.Adasum).numpy()
    expect(rank, f"allreduce Adasum {first[0]}", got, first[2], first[1])
    # One grouped call: every tensor keeps its own coefficients within a dtype's allgather.
    results = hvd.grouped_allreduce([tf.constant(c[2][rank]) for c in cases], op=hvd.Adasum)
    for (label, dtype, per_rank, expected), result in zip(cases, results):
        what = f"grouped_allreduce Adasum {label}"
        if expected is None:
            expect(rank, what, result.numpy(), per_rank, dtype)
        else:
            assert_close(rank, what, result.numpy(), expected, TOLERANCE[dtype])
    agree(rank, "grouped_allreduce Adasum", np.concatenate(
        [r.numpy().astype(np.float64).ravel() for r in results]))
    a = [signed_data(r, (2, 3), np.float32, 4) for r in range(size)]
    b = [signed_data(r, (5,), np.float64, 5) for r in range(size)]

    @tf.function
    def in_a_function(x, y):
        return (hvd.grouped_allreduce([x, y], op=hvd.Adasum),
                hvd.allreduce(x, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0))

    (got_a, got_b), scaled = in_a_function(tf.constant(a[rank]), tf.constant(b[rank]))
    expect(rank, "tf.function grouped_allreduce Adasum float32", got_a.numpy(), a, np.float32)
    expect(rank, "tf.function grouped_allreduce Adasum float64", got_b.numpy(), b, np.float64)
    expect(rank, "Adasum prescale 0.5 postscale 3", scaled.numpy(), a, np.float32, 1.5)
    compressed = hvd.allreduce(tf.constant(a[rank]), op=hvd.Adasum,
                               compression=hvd.Compression.fp16)
    assert_close(rank, "Adasum with fp16 compression", compressed.numpy(),
                 adasum_tree([x.astype(np.float16) for x in a]).astype(np.float32), 2e-3, 2e-3)


def check_process_sets_and_errors(rank: int, size: int) -> None:
    x = [signed_data(r, (6,), np.float32, 8) for r in range(size)]
    if size >= 4:
        odd = hvd.add_process_set([1, 3])
        three = hvd.add_process_set([0, 1, 2])
        if odd.included():
            got = hvd.allreduce(tf.constant(x[rank]), op=hvd.Adasum, process_set=odd).numpy()
            expect(rank, "Adasum over process set [1, 3]", got, [x[1], x[3]], np.float32)
        if three.included():
            expect_error(rank, "Adasum over 3 ranks",
                         lambda: hvd.allreduce(tf.constant(x[rank]), op=hvd.Adasum,
                                               process_set=three),
                         NotImplementedError, "one of 3")
    slices = tf.IndexedSlices(tf.constant(x[rank][:2].reshape(2, 1)), tf.constant([0, 1]),
                              tf.constant([3, 1]))
    expect_error(rank, "Adasum of IndexedSlices",
                 lambda: hvd.allreduce(slices, op=hvd.Adasum),
                 NotImplementedError, "sparse_as_dense")
    expect_error(rank, "Adasum of int32",
                 lambda: hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum), TypeError, "int32")
    expect_error(rank, "reducescatter with Adasum",
                 lambda: hvd.reducescatter(tf.constant(x[rank]), op=hvd.Adasum),
                 ValueError, "Adasum")
    xt = tf.constant(x[rank])
    with tf.GradientTape() as tape:
        tape.watch(xt)
        total = tf.reduce_sum(hvd.allreduce(xt, op=hvd.Adasum))
    expect_error(rank, "gradient of Adasum",
                 lambda: tape.gradient(total, xt), ValueError, "not differentiable")


def linear_data(rank: int) -> tuple:
    return signed_data(rank, (5, 4), np.float32, 9), signed_data(rank, (5, 3), np.float32, 10)


def linear_variables() -> list:
    return [tf.Variable(signed_data(0, (4, 3), np.float32, 11)),
            tf.Variable(np.zeros(3, np.float32)),
            tf.Variable(signed_data(0, (6, 3), np.float32, 12))]  # an embedding


def linear_loss(variables: list, x, y, rank: int):
    w, b, embedding = variables
    prediction = tf.matmul(x, w) + b + tf.gather(embedding, [rank % 6, 5])[:1]
    return tf.reduce_mean(tf.square(prediction - y))


def local_gradients(size: int) -> list:
    """Every rank's own gradients (dense), computed here without collectives."""
    variables = linear_variables()
    per_rank = []
    for r in range(size):
        with tf.GradientTape() as tape:
            loss = linear_loss(variables, *linear_data(r), r)
        per_rank.append([tf.convert_to_tensor(g).numpy()
                         for g in tape.gradient(loss, variables)])
    return per_rank


def check_gradient_tape(rank: int, size: int) -> None:
    per_rank = local_gradients(size)
    variables = linear_variables()
    x, y = linear_data(rank)

    def gradients(sparse_as_dense: bool):
        with tf.GradientTape() as tape:
            loss = linear_loss(variables, x, y, rank)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, variables)

    for mode, run in (("eager", lambda fn: fn()), ("tf.function", lambda fn: tf.function(fn)())):
        grads = run(lambda: gradients(True))
        for k, grad in enumerate(grads):
            expect(rank, f"{mode} DistributedGradientTape Adasum gradient {k}", grad.numpy(),
                   [g[k] for g in per_rank], np.float32)
    expect_error(rank, "Adasum tape with a sparse gradient",
                 lambda: gradients(False), NotImplementedError, "sparse_as_dense")


def check_keras_optimizer(rank: int, size: int) -> None:
    x, y = linear_data(rank)
    lr = 0.1
    for label, wrap in (
            ("perseus_legacy.keras.DistributedOptimizer",
             lambda opt: hvd_keras.DistributedOptimizer(opt, op=hvd.Adasum)),
            ("perseus_legacy.DistributedOptimizer(Keras optimizer)",
             lambda opt: hvd.DistributedOptimizer(opt, op=hvd.Adasum))):
        keras.utils.set_random_seed(13)
        model = keras.Sequential([keras.layers.Dense(3, input_shape=(4,))])
        initial = model.get_weights()
        per_rank = []
        for r in range(size):  # every rank's gradient of the same weights, one process
            xr, yr = linear_data(r)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xr) - yr))
            per_rank.append([g.numpy() for g in tape.gradient(loss, model.trainable_weights)])
        model.compile(optimizer=wrap(keras.optimizers.SGD(lr)), loss="mse")
        model.train_on_batch(x, y)
        for k, (got, start) in enumerate(zip(model.get_weights(), initial)):
            expected = start - lr * adasum_tree([g[k] for g in per_rank])
            assert_close(rank, f"{label} Adasum step, weight {k}", got,
                         expected.astype(np.float32), 1e-5, 1e-6)


def sgd_steps(w: np.ndarray, rank: int, steps: int, lr: float) -> np.ndarray:
    """`steps` plain gradient descent steps of rank `rank`'s loss, in numpy."""
    x, y = linear_data(rank)
    for _ in range(steps):  # d/dw mean((xw - y)^2) = 2 x^T (xw - y) / (rows * outputs)
        w = w - lr * 2.0 * x.T.astype(np.float64) @ (x @ w - y) / y.size
    return w


def check_tf1_optimizer(rank: int, size: int) -> None:
    lr, updates = 0.1, 2
    start = signed_data(0, (4, 3), np.float32, 11).astype(np.float64)
    for passes in (1, 2):
        expected = start
        for _ in range(updates):  # every rank's change after `passes` local steps, combined
            expected = expected + adasum_tree([sgd_steps(expected, r, passes, lr) - expected
                                               for r in range(size)])
        graph = tf.Graph()
        with graph.as_default():
            w = tf.compat.v1.Variable(start.astype(np.float32), use_resource=True)
            x, y = linear_data(rank)
            loss = tf.reduce_mean(tf.square(tf.matmul(tf.constant(x), w) - tf.constant(y)))
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr),
                                           op=hvd.Adasum, backward_passes_per_step=passes)
            train = opt.minimize(loss, global_step=step)
            init = [tf.compat.v1.global_variables_initializer(),
                    tf.compat.v1.local_variables_initializer()]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(init)
            for _ in range(updates * passes):
                sess.run(train)
            got, steps = sess.run([w, step])
        what = f"TF1 DistributedOptimizer Adasum backward_passes_per_step={passes}"
        assert_close(rank, what, got, expected.astype(np.float32), 1e-5, 1e-6)
        agree(rank, what, got)
        if steps != updates * passes:  # the wrapped optimizer steps on every pass
            fail(rank, f"{what}: global step {steps}, expected {updates * passes}")
    w = tf.Variable(start.astype(np.float32))
    x, y = linear_data(rank)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr),
                                   op=hvd.Adasum)
    opt.minimize(lambda: tf.reduce_mean(tf.square(tf.matmul(x, w) - y)), var_list=[w])
    expected = start + adasum_tree([sgd_steps(start, r, 1, lr) - start for r in range(size)])
    assert_close(rank, "eager TF1 DistributedOptimizer Adasum", w.numpy(),
                 expected.astype(np.float32), 1e-5, 1e-6)
    expect_error(rank, "Adasum with average_aggregated_gradients",
                 lambda: hvd.DistributedOptimizer(
                     tf.compat.v1.train.GradientDescentOptimizer(lr), op=hvd.Adasum,
                     backward_passes_per_step=2, average_aggregated_gradients=True),
                 ValueError, "average_aggregated_gradients")


# The cases, in the order they run: hvd_checks.py runs `hvd_adasum.<case>` as check_<case>.
CASES = ("allreduce", "process_sets_and_errors", "gradient_tape", "keras_optimizer",
         "tf1_optimizer")

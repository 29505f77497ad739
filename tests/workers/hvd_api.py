"""Runs on every rank: Horovod's TensorFlow API names against numpy or a one-process run.

reducescatter (uneven rows, scale factors, gradients), grouped_allgather, broadcast_, the object
collectives, the *_op queries, the *_built flags, IndexedSlices rules, deprecated arguments,
TF1 DistributedOptimizer predivision, DistributedGradientTape and its partial variant in a
tf.function train step, SyncBatchNormalization, TF1 register_local_var, the Keras optimizer given
to perseus_legacy.DistributedOptimizer, and is_homogeneous. Named cases, run by hvd_checks.py; a
mismatch fails its case naming the rank.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as hvd

import os
import warnings

import numpy as np
import tensorflow as tf
from worker_util import assert_close, expect_error, fail, rank_data

from perseus_legacy.keras.keras2 import keras


def scatter_part(rows: int, size: int, rank: int) -> slice:
    base, extra = divmod(rows, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def check_reducescatter(rank: int, size: int) -> None:
    rows = 2 * size + 1  # uneven: the first rank gets one row more
    x = [rank_data(r, (rows, 3), np.float64, seed=1) for r in range(size)]
    w = [rank_data(r, (rows, 3), np.float64, seed=2) for r in range(size)]
    part = scatter_part(rows, size, rank)
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0)):
        label = f"reducescatter {hvd.common.basics.REDUCE_OP_NAMES[op]} pre {pre} post {post}"
        expected = np.sum(x, axis=0) * pre * post / (size if op == hvd.Average else 1)

        def forward(t, op=op, pre=pre, post=post):
            return hvd.reducescatter(t, op=op, prescale_factor=pre, postscale_factor=post)

        assert_close(rank, f"eager {label}", forward(tf.constant(x[rank])).numpy(),
                     expected[part], 1e-12)
        assert_close(rank, f"tf.function {label}",
                     tf.function(forward)(tf.constant(x[rank])).numpy(), expected[part], 1e-12)
        xt = tf.constant(x[rank])
        with tf.GradientTape() as tape:
            tape.watch(xt)
            out = forward(xt)
            loss = tf.reduce_sum(tf.constant(w[rank][part]) * out)
        # Horovod's gradient: every rank's incoming gradient gathered, x size() for Sum.
        gathered = np.concatenate([w[r][scatter_part(rows, size, r)] for r in range(size)])
        scale = pre * post * (size if op == hvd.Sum else 1)
        assert_close(rank, f"gradient of {label}", tape.gradient(loss, xt).numpy(),
                     gathered * scale, 1e-12)
    ints = [rank_data(r, (size, 2), np.int32, seed=3) for r in range(size)]
    a = [rank_data(r, (rows, 2), np.float32, seed=4) for r in range(size)]
    got = hvd.grouped_reducescatter([tf.constant(ints[rank]), tf.constant(a[rank])], op=hvd.Sum)
    assert_close(rank, "grouped_reducescatter int32", got[0].numpy(),
                 np.sum(ints, axis=0)[rank:rank + 1].astype(np.int32))
    assert_close(rank, "grouped_reducescatter float32", got[1].numpy(),
                 np.sum(a, axis=0)[part].astype(np.float32), 1e-6)
    try:
        hvd.reducescatter(tf.constant(x[rank]), op=hvd.Max)
        fail(rank, "reducescatter with op=Max did not raise")
    except ValueError as exc:
        assert "Max" in str(exc), exc


def check_gather_broadcast_objects(rank: int, size: int) -> None:
    a = [rank_data(r, (r + 1, 2), np.float32, seed=5) for r in range(size)]
    b = [rank_data(r, (2 * r, 1), np.int64, seed=6) for r in range(size)]
    for mode, run in (("eager", lambda f: f()), ("tf.function", lambda f: tf.function(f)())):
        got = run(lambda: hvd.grouped_allgather([tf.constant(a[rank]), tf.constant(b[rank])]))
        assert_close(rank, f"{mode} grouped_allgather 0", got[0].numpy(), np.concatenate(a))
        assert_close(rank, f"{mode} grouped_allgather 1", got[1].numpy(), np.concatenate(b))
    variables = [tf.Variable(rank_data(rank, (3,), np.float32, seed=7)),
                 tf.Variable(rank_data(rank, (2, 2), np.int32, seed=8))]
    values = hvd.broadcast_(variables, root_rank=size - 1)
    for k, (var, value) in enumerate(zip(variables, values)):
        expected = rank_data(size - 1, var.shape, var.dtype.as_numpy_dtype, seed=7 + k)
        assert_close(rank, f"broadcast_ variable {k}", var.numpy(), expected)
        assert_close(rank, f"broadcast_ returned value {k}", value.numpy(), expected)
    obj = {"from": rank, "payload": list(range(rank + 3))} if rank == 0 else None
    if hvd.broadcast_object(obj, 0) != {"from": 0, "payload": [0, 1, 2]}:
        fail(rank, "broadcast_object did not return rank 0's object")
    if hvd.allgather_object(("rank", rank)) != [("rank", r) for r in range(size)]:
        fail(rank, "allgather_object did not return every rank's object in rank order")
    send = hvd.broadcast_object_fn(root_rank=size - 1)
    for step in range(2):
        if send(f"step {step} from {rank}") != f"step {step} from {size - 1}":
            fail(rank, "broadcast_object_fn did not return the root's object")


def check_queries(rank: int, size: int) -> None:
    assert_close(rank, "rank_op", hvd.rank_op().numpy(), np.int32(rank))
    assert_close(rank, "size_op", tf.function(hvd.size_op)().numpy(), np.int32(size))
    assert_close(rank, "local_rank_op", hvd.local_rank_op().numpy(), np.int32(hvd.local_rank()))
    assert_close(rank, "local_size_op", hvd.local_size_op().numpy(), np.int32(hvd.local_size()))
    assert_close(rank, "process_set_included_op", hvd.process_set_included_op().numpy(),
                 np.int32(1))
    try:
        hvd.size_op(process_set_id=1)
        fail(rank, "size_op of process set 1 did not raise")
    except ValueError as exc:
        assert "global process set" in str(exc), exc
    controller = os.environ.get("PERSEUS_EXPECT_CONTROLLER", "mpi")
    flags = {"mpi_built": hvd.mpi_built(), "mpi_enabled": hvd.mpi_enabled(),
             "gloo_built": hvd.gloo_built(), "gloo_enabled": hvd.gloo_enabled(),
             "nccl_built": hvd.nccl_built(), "ddl_built": hvd.ddl_built(),
             "ccl_built": hvd.ccl_built(), "cuda_built": hvd.cuda_built(),
             "rocm_built": hvd.rocm_built(), "gpu_available": hvd.gpu_available("tensorflow")}
    expected = dict.fromkeys(flags, False)
    expected.update(mpi_built=True, mpi_enabled=controller == "mpi")
    if flags != expected:
        fail(rank, f"build flags {flags}, expected {expected}")


def check_sparse_and_arguments(rank: int, size: int) -> None:
    values = [rank_data(r, (2, 3), np.int32, seed=9) for r in range(size)]
    slices = tf.IndexedSlices(tf.constant(values[rank]), tf.constant([0, rank + 1]),
                              tf.constant([size + 1, 3]))
    for op in (hvd.Min, hvd.Max, hvd.Product):
        expect_error(rank, f"IndexedSlices op {op}",
                     lambda op=op: hvd.allreduce(slices, op=op),
                     NotImplementedError, "Average and Sum")
    averaged = hvd.allreduce(slices, op=hvd.Average)  # integer values: true division
    assert_close(rank, "int32 IndexedSlices Average", averaged.values.numpy(),
                 np.concatenate(values).astype(np.float64) / size, 1e-12)
    x = [rank_data(r, (4,), np.float32, seed=10) for r in range(size)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = hvd.allreduce(tf.constant(x[rank]), average=False, device_dense="/gpu:0")
        mean = hvd.grouped_allreduce([tf.constant(x[rank])], average=True)[0]
    if not any(issubclass(c.category, DeprecationWarning) and "average" in str(c.message)
               for c in caught):
        fail(rank, f"average= gave no DeprecationWarning: {[str(c.message) for c in caught]}")
    assert_close(rank, "allreduce(average=False)", total.numpy(), np.sum(x, axis=0), 1e-6)
    assert_close(rank, "grouped_allreduce(average=True)", mean.numpy(), np.mean(x, axis=0), 1e-6)
    expect_error(rank, "allreduce with op and average",
                 lambda: hvd.allreduce(tf.constant(x[rank]), average=True, op=hvd.Sum),
                 ValueError, "not both")
    fp16 = hvd.allreduce(tf.constant(x[rank]), op=hvd.Sum, compression=hvd.Compression.fp16)
    if fp16.dtype != tf.float32:
        fail(rank, f"allreduce with fp16 compression returned {fp16.dtype}, not float32")
    assert_close(rank, "allreduce fp16 compression", fp16.numpy(), np.sum(x, axis=0), 5e-3, 5e-3)


def check_tf1_predivide(rank: int, size: int) -> None:
    x = [rank_data(r, (3,), np.float32, seed=11) for r in range(size)]
    graph = tf.Graph()
    with graph.as_default():
        var = tf.compat.v1.Variable(tf.zeros([3]), use_resource=True)
        loss = tf.reduce_sum(var * tf.constant(x[rank]))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                       gradient_predivide_factor=4.0, device_dense="")
        grads = [g for g, _ in opt.compute_gradients(loss, [var])]
        factors = {(op.get_attr("prescale_factor"), op.get_attr("postscale_factor"))
                   for op in graph.get_operations() if op.type == "PerseusAllreduce"}
        init = tf.compat.v1.global_variables_initializer()
    if factors != {(0.25, 4.0)}:
        fail(rank, f"predivide 4: allreduce scale factors {factors}, expected (1/4, 4)")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(init)
        assert_close(rank, "TF1 DistributedOptimizer predivide gradient", sess.run(grads[0]),
                     np.mean(x, axis=0), 1e-6)
    expect_error(rank, "predivide with op=Sum",
                 lambda: hvd.DistributedOptimizer(
                     tf.compat.v1.train.GradientDescentOptimizer(1.0), op=hvd.Sum,
                     gradient_predivide_factor=2.0),
                 ValueError, "op=Average")


def check_tf1_local_variables(rank: int, size: int) -> None:
    """register_local_var: the variable's gradient stays on its rank, divided by size() unless
    scale_local_gradients=False; also when gradients accumulate over 2 passes."""
    x = [rank_data(r, (3,), np.float32, seed=18) for r in range(size)]
    z = [rank_data(r, (2,), np.float32, seed=19) for r in range(size)]
    for passes, scale_local in ((1, True), (1, False), (2, True)):
        what = f"TF1 register_local_var passes={passes} scale_local_gradients={scale_local}"
        graph = tf.Graph()
        with graph.as_default():
            shared = tf.compat.v1.Variable(tf.zeros([3]), use_resource=True)
            local = tf.compat.v1.Variable(tf.zeros([2]), use_resource=True)
            loss = tf.reduce_sum(shared * x[rank]) + tf.reduce_sum(local * z[rank])
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                           backward_passes_per_step=passes,
                                           scale_local_gradients=scale_local)
            opt.register_local_var(local)
            train = opt.minimize(loss)
            init = [tf.compat.v1.global_variables_initializer(),
                    tf.compat.v1.local_variables_initializer()]
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(init)
            for _ in range(passes):
                sess.run(train)
            got_shared, got_local = sess.run([shared, local])
        divisor = size if scale_local else 1
        # Gradient descent from zeros at rate 1: minus the gradients summed over the passes.
        assert_close(rank, f"{what}: shared variable", got_shared,
                     -passes * np.mean(x, axis=0), 1e-6)
        assert_close(rank, f"{what}: local variable", got_local,
                     -passes * z[rank] / divisor, 1e-6)


def check_keras_optimizer_forwarding(rank: int, size: int) -> None:
    """perseus_legacy.DistributedOptimizer(Keras optimizer, op=Sum) is the Keras one, op kept."""
    keras.utils.set_random_seed(20)
    model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
    initial = model.get_weights()
    xs = [rank_data(r, (4, 3), np.float32, seed=21) for r in range(size)]
    ys = [rank_data(r, (4, 2), np.float32, seed=22) for r in range(size)]
    summed = [np.zeros_like(w) for w in initial]
    for xr, yr in zip(xs, ys):  # every rank's gradient, one process
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xr) - yr))
        for total, grad in zip(summed, tape.gradient(loss, model.trainable_weights)):
            total += grad.numpy()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum)
    if not isinstance(opt, keras.optimizers.SGD) or not hasattr(opt, "register_local_var"):
        fail(rank, f"DistributedOptimizer(Keras SGD) returned {type(opt)}")
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(xs[rank], ys[rank])
    for k, (got, start, total) in enumerate(zip(model.get_weights(), initial, summed)):
        assert_close(rank, f"forwarded Keras DistributedOptimizer op=Sum weight {k}", got,
                     start - 0.1 * total, 1e-5, 1e-6)
    expect_error(rank, "DistributedOptimizer of a non-optimizer",
                 lambda: hvd.DistributedOptimizer(object()), TypeError, "Keras 2")


def check_homogeneous(rank: int, size: int) -> None:
    """Every rank on one host: homogeneous; the answer is remembered."""
    if hvd.is_homogeneous() is not True or hvd.is_homogeneous() is not True:
        fail(rank, "is_homogeneous() is not True for ranks that all share one host")


FEATURES, VOCAB, OUT, ROWS = 4, 6, 3, 4  # ROWS per rank per step


def tape_data(size: int, steps: int) -> tuple:
    rng = np.random.default_rng(12)
    n = ROWS * size * steps
    return (rng.normal(size=(n, FEATURES)).astype(np.float32),
            rng.integers(0, VOCAB, size=(n,)).astype(np.int32),
            rng.normal(size=(n, OUT)).astype(np.float32))


def tape_variables() -> list:
    rng = np.random.default_rng(13)
    return [tf.Variable(rng.normal(size=(FEATURES, OUT)).astype(np.float32)),
            tf.Variable(rng.normal(size=(VOCAB, OUT)).astype(np.float32)),
            tf.Variable(np.zeros(OUT, np.float32))]


def tape_loss(variables: list, x, tokens, y):
    w, embedding, b = variables
    prediction = tf.matmul(x, w) + tf.gather(embedding, tokens) + b
    return tf.reduce_mean(tf.square(prediction - y))


def check_distributed_gradient_tape(rank: int, size: int) -> None:
    steps, lr = 4, 0.1
    x, tokens, y = tape_data(size, steps)
    reference = tape_variables()
    for step in range(steps):  # one process, the global batch of every step
        rows = slice(step * ROWS * size, (step + 1) * ROWS * size)
        with tf.GradientTape() as tape:
            loss = tape_loss(reference, x[rows], tokens[rows], y[rows])
        for var, grad in zip(reference, tape.gradient(loss, reference)):
            var.assign_sub(lr * tf.convert_to_tensor(grad))
    cases = [({}, 1e-5), ({"gradient_predivide_factor": 2.0, "groups": 2}, 1e-5),
             ({"sparse_as_dense": True, "op": hvd.Average}, 1e-5),
             ({"compression": hvd.Compression.fp16}, 3e-2)]
    for kwargs, tol in cases:
        variables = tape_variables()

        @tf.function
        def train_step(x_, tokens_, y_, variables=variables, kwargs=kwargs):
            with tf.GradientTape() as tape:
                loss = tape_loss(variables, x_, tokens_, y_)
            tape = hvd.DistributedGradientTape(tape, **kwargs)
            grads = tape.gradient(loss, variables)
            for var, grad in zip(variables, grads):
                var.assign_sub(lr * tf.convert_to_tensor(grad))

        for step in range(steps):
            start = step * ROWS * size + rank * ROWS
            rows = slice(start, start + ROWS)
            train_step(x[rows], tokens[rows], y[rows])
        for k, (got, want) in enumerate(zip(variables, reference)):
            assert_close(rank, f"DistributedGradientTape {sorted(kwargs)} variable {k}",
                         got.numpy(), want.numpy(), tol, tol)


def check_partial_tape(rank: int, size: int) -> None:
    keras.utils.set_random_seed(14)
    shared, local = keras.layers.Dense(3), keras.layers.Dense(2)
    xs = [rank_data(r, (5, 4), np.float32, seed=15) for r in range(size)]

    def loss_of(x):
        return tf.reduce_sum(tf.square(local(shared(x))))

    loss_of(tf.constant(xs[0]))  # builds the layers
    variables = shared.trainable_weights + local.trainable_weights
    per_rank = []
    for x in xs:
        with tf.GradientTape() as tape:
            loss = loss_of(tf.constant(x))
        per_rank.append([g.numpy() for g in tape.gradient(loss, variables)])
    with tf.GradientTape() as tape:
        loss = loss_of(tf.constant(xs[rank]))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=local)
    grads = tape.gradient(loss, variables)
    for k, grad in enumerate(grads):
        if k < len(shared.trainable_weights):
            expected = np.mean([g[k] for g in per_rank], axis=0)
        else:  # kept on this rank, divided by size() as in Horovod
            expected = per_rank[rank][k] / size
        assert_close(rank, f"PartialDistributedGradientTape gradient {k}", grad.numpy(),
                     expected, 1e-5, 1e-6)


def check_sync_batch_norm(rank: int, size: int) -> None:
    xs = [rank_data(r, (2 + r, 3), np.float32, seed=16) for r in range(size)]  # uneven batches
    ws = [rank_data(r, (2 + r, 3), np.float32, seed=17) for r in range(size)]
    everything = np.concatenate(xs)
    epsilon = 1e-3
    mean, var = everything.mean(0), everything.var(0)
    start = sum(len(a) for a in xs[:rank])
    expected = ((everything - mean) / np.sqrt(var + epsilon))[start:start + len(xs[rank])]
    layer = hvd.SyncBatchNormalization(epsilon=epsilon)
    xt = tf.constant(xs[rank])
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = layer(xt, training=True)
        loss = tf.reduce_sum(tf.constant(ws[rank]) * out)
    assert_close(rank, "SyncBatchNormalization output", out.numpy(), expected, 1e-4, 1e-5)
    # One process on the concatenated batch, loss summed over the ranks' rows.
    plain = keras.layers.BatchNormalization(epsilon=epsilon, fused=False)
    whole = tf.constant(everything)
    with tf.GradientTape() as whole_tape:
        whole_tape.watch(whole)
        whole_loss = tf.reduce_sum(tf.constant(np.concatenate(ws)) * plain(whole, training=True))
    expected_grad = whole_tape.gradient(whole_loss, whole).numpy()[start:start + len(xs[rank])]
    assert_close(rank, "SyncBatchNormalization input gradient", tape.gradient(loss, xt).numpy(),
                 expected_grad, 1e-4, 1e-5)
    assert_close(rank, "SyncBatchNormalization moving mean", layer.moving_mean.numpy(),
                 plain.moving_mean.numpy(), 1e-5, 1e-6)
    expect_error(rank, "fused SyncBatchNormalization",
                 lambda: hvd.SyncBatchNormalization(fused=True), ValueError, "fused")


# The cases, in the order they run: hvd_checks.py runs `hvd_api.<case>` as check_<case>.
CASES = ("reducescatter", "gather_broadcast_objects", "queries", "sparse_and_arguments",
         "tf1_predivide", "tf1_local_variables", "keras_optimizer_forwarding", "homogeneous",
         "distributed_gradient_tape", "partial_tape", "sync_batch_norm")

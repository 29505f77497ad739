"""Runs on every rank: the TF collectives against numpy in eager, tf.function and Session modes.

Every rank regenerates every other rank's inputs (worker_util.rank_data), so each check compares
this rank's result with a numpy expectation computed from all ranks' data. Any mismatch exits
non-zero with the rank and the case named.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl
from perseus_legacy.tensorflow import collectives as pl_ops

import random
import re
import sys

import numpy as np
import tensorflow as tf
from worker_util import assert_close, fail, launcher_rank, rank_data, run_cases

BF16 = tf.bfloat16.as_numpy_dtype
REDUCIBLE = [np.float16, BF16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.int8,
             np.int16, np.uint16]
ALL_TYPES = REDUCIBLE + [np.bool_]
OPS = {pl.Average: "Average", pl.Sum: "Sum", pl.Min: "Min", pl.Max: "Max", pl.Product: "Product"}
SESSION_CONFIG = dict(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)


def session(graph: tf.Graph) -> tf.compat.v1.Session:
    return tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(**SESSION_CONFIG))


def tolerance(dtype) -> float:
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return 5e-3
    if dtype == BF16:
        return 3e-2
    return 1e-6 if dtype.kind == "f" else 0.0


def reduce_numpy(arrays: list, op: int, dtype, pre: float = 1.0, post: float = 1.0):
    stack = np.stack([a.astype(np.float64) for a in arrays])
    if np.dtype(dtype).kind == "f" or np.dtype(dtype) == BF16:
        stack = stack * pre
    if op == pl.Sum:
        out = stack.sum(0)
    elif op == pl.Average:
        out = stack.sum(0)
        out = out / len(arrays) if np.dtype(dtype).kind not in "iu" else np.trunc(out / len(arrays))
    elif op == pl.Min:
        out = stack.min(0)
    elif op == pl.Max:
        out = stack.max(0)
    else:
        out = stack.prod(0)
    if np.dtype(dtype).kind not in "iu":
        out = out * post
    return out.astype(dtype)


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def gather_rows(r: int) -> int:
    return (2 * r) % 3  # 0, 2, 1, 0, ...: uneven, and rank 0 contributes no rows


def alltoall_splits(r: int, size: int) -> list:
    return [(r + 2 * j) % 3 for j in range(size)]  # uneven, some zero


def build_cases(rank: int, size: int) -> list:
    """(label, build() -> tensor or tuple, expected numpy value or tuple) for every op x dtype."""
    cases = []
    everyone = range(size)
    for i, dtype in enumerate(REDUCIBLE):
        shape = (3, 4)
        datas = [rank_data(r, shape, dtype, seed=i) for r in everyone]
        for op, op_name in OPS.items():
            cases.append((f"allreduce {op_name} {dtype_name(dtype)}",
                          lambda x=datas[rank], op=op: pl.allreduce(tf.constant(x), op=op),
                          reduce_numpy(datas, op, dtype)))
    # Scale factors, with Average and Sum.
    datas = [rank_data(r, (5,), np.float32, seed=20) for r in everyone]
    for op in (pl.Average, pl.Sum):
        cases.append((f"allreduce {OPS[op]} prescale 0.5 postscale 3",
                      lambda x=datas[rank], op=op: pl.allreduce(
                          tf.constant(x), op=op, prescale_factor=0.5, postscale_factor=3.0),
                      reduce_numpy(datas, op, np.float32, 0.5, 3.0)))
    # A scalar and a large, multi-dimensional tensor.
    datas = [rank_data(r, (), np.float64, seed=21) for r in everyone]
    cases.append(("allreduce Sum scalar", lambda x=datas[rank]: pl.allreduce(
        tf.constant(x), op=pl.Sum), reduce_numpy(datas, pl.Sum, np.float64)))
    datas = [rank_data(r, (64, 33, 17), np.float32, seed=22) for r in everyone]
    cases.append(("allreduce Average 143 KiB", lambda x=datas[rank]: pl.allreduce(
        tf.constant(x)), reduce_numpy(datas, pl.Average, np.float32)))

    for i, dtype in enumerate(ALL_TYPES):
        datas = [rank_data(r, (gather_rows(r), 2, 3), dtype, seed=30 + i) for r in everyone]
        cases.append((f"allgather uneven {dtype_name(dtype)}",
                      lambda x=datas[rank]: pl.allgather(tf.constant(x)),
                      np.concatenate(datas, axis=0)))
        datas = [rank_data(r, (2, 5), dtype, seed=50 + i) for r in everyone]
        for root in everyone:
            cases.append((f"broadcast root {root} {dtype_name(dtype)}",
                          lambda x=datas[rank], root=root: pl.broadcast(tf.constant(x), root),
                          datas[root]))
        splits = [alltoall_splits(r, size) for r in everyone]
        datas = [rank_data(r, (sum(splits[r]), 3), dtype, seed=70 + i) for r in everyone]
        received, received_splits = [], []
        for r in everyone:
            offsets = np.cumsum([0] + splits[r])
            received.append(datas[r][offsets[rank]:offsets[rank + 1]])
            received_splits.append(splits[r][rank])
        cases.append((f"alltoall uneven {dtype_name(dtype)}",
                      lambda x=datas[rank], s=splits[rank]: pl.alltoall(tf.constant(x), s),
                      (np.concatenate(received, axis=0), np.array(received_splits, np.int32))))
    # Even alltoall without splits, int64 splits.
    datas = [rank_data(r, (2 * size, 2), np.float32, seed=90) for r in everyone]
    cases.append(("alltoall even, no splits: the tensor alone",
                  lambda x=datas[rank]: pl.alltoall(tf.constant(x)),
                  np.concatenate([d[2 * rank:2 * rank + 2] for d in datas])))
    cases.append(("alltoall even, int64 splits",
                  lambda x=datas[rank]: pl.alltoall(
                      tf.constant(x), tf.constant([2] * size, tf.int64)),
                  (np.concatenate([d[2 * rank:2 * rank + 2] for d in datas]),
                   np.full(size, 2, np.int64))))
    # Several tensors of different dtypes submitted together; one eager call is one function.
    specs = [((3,), np.float32), ((2, 2), np.float64), ((4,), np.int32)]
    group = [[rank_data(r, shape, dt, seed=96 + k) for r in everyone]
             for k, (shape, dt) in enumerate(specs)]
    cases.append(("grouped_allreduce Sum", lambda: tuple(pl.grouped_allreduce(
        [tf.constant(g[rank]) for g in group], op=pl.Sum, name="group")),
        tuple(reduce_numpy(g, pl.Sum, dt) for g, (_, dt) in zip(group, specs))))
    # Dense tensors in one op, the sparse one gathered beside it, results in order.
    rows = [rank_data(r, (2, 3), np.float32, seed=98) for r in everyone]
    cases.append(("grouped_allreduce dense and sparse", lambda: (lambda out: (
        out[0], *sparse_tuple(out[1]), out[2]))(pl.grouped_allreduce(
            [tf.constant(group[0][rank]),
             tf.IndexedSlices(tf.constant(rows[rank]), tf.constant([rank, size + rank]),
                              tf.constant([2 * size, 3])),
             tf.constant(group[1][rank])], op=pl.Average)),
        (reduce_numpy(group[0], pl.Average, np.float32), np.concatenate(rows) / size,
         np.array([i for r in everyone for i in (r, size + r)], np.int32),
         reduce_numpy(group[1], pl.Average, np.float64))))
    datas = [rank_data(r, (4,), np.float32, seed=97) for r in everyone]
    cases.append(("allreduce Max with a user name", lambda x=datas[rank]: pl.allreduce(
        tf.constant(x), op=pl.Max, name="user name:0"), reduce_numpy(datas, pl.Max, np.float32)))
    # Sparse gradients: allreduce of IndexedSlices gathers rows and indices.
    values = [rank_data(r, (r + 1, 3), np.float32, seed=95) for r in everyone]
    indices = [np.arange(r + 1, dtype=np.int64) * (r + 1) for r in everyone]
    cases.append(("allreduce IndexedSlices Average",
                  lambda: sparse_tuple(pl.allreduce(tf.IndexedSlices(
                      tf.constant(values[rank]), tf.constant(indices[rank]),
                      tf.constant([10, 3], tf.int64)))),
                  (np.concatenate(values) / size, np.concatenate(indices))))
    return cases


def sparse_tuple(slices: tf.IndexedSlices) -> tuple:
    return slices.values, slices.indices


def check(rank: int, label: str, got, expected) -> None:
    if isinstance(expected, tuple):
        for k, (g, e) in enumerate(zip(got, expected)):
            check(rank, f"{label} [output {k}]", g, e)
        return
    got = got.numpy() if hasattr(got, "numpy") else got
    tol = tolerance(expected.dtype) if expected.dtype != np.bool_ else 0.0
    assert_close(rank, label, got, expected, rtol=tol, atol=tol)


def shuffled(cases: list, rank: int) -> list:
    order = list(cases)
    random.Random(rank).shuffle(order)  # each rank builds and submits in its own order
    return order


def case_scope(label: str):
    """A name scope of the case's own, so default tensor names do not depend on the order in
    which the ranks build their graphs (graph mode names come from the op's scope and name)."""
    return tf.name_scope(re.sub(r"[^A-Za-z0-9_.]", "_", label))


def scoped(label: str, build):
    with case_scope(label):
        return build()


def run_eager(rank: int, cases: list) -> None:
    for label, build, expected in cases:
        check(rank, f"eager {label}", build(), expected)


def run_graph(rank: int, cases: list) -> None:
    graph = tf.Graph()
    with graph.as_default():
        built = {label: scoped(label, build) for label, build, _ in shuffled(cases, rank)}
    with session(graph) as sess:
        results = sess.run(built)
    for label, _, expected in cases:
        check(rank, f"graph {label}", results[label], expected)


def run_function(rank: int, cases: list) -> None:
    @tf.function
    def all_cases():
        return {label: scoped(label, build) for label, build, _ in shuffled(cases, rank)}

    results = all_cases()
    for label, _, expected in cases:
        check(rank, f"tf.function {label}", results[label], expected)


def check_fusion_of_many_small(rank: int, size: int) -> None:
    """200 small tensors of mixed shapes and dtypes in one session.run, exact results."""
    dtypes = [np.float32, np.int32, np.float64, np.int64]
    shapes = [(i % 7 + 1,) if i % 3 else (2, i % 5 + 1) for i in range(200)]
    # Integer values: sums are exact in every dtype, whatever order the runtime adds them in.
    datas = [[rank_data(r, shapes[i], np.int32, seed=100 + i).astype(dtypes[i % 4])
              for r in range(size)] for i in range(200)]
    graph = tf.Graph()
    with graph.as_default():
        outs = [None] * 200
        for i in shuffled(list(range(200)), rank):
            outs[i] = pl.allreduce(tf.constant(datas[i][rank]), op=pl.Sum, name=f"small_{i}")
    with session(graph) as sess:
        for step in range(3):
            results = sess.run(outs)
            for i, got in enumerate(results):
                expected = reduce_numpy(datas[i], pl.Sum, dtypes[i % 4])
                assert_close(rank, f"fused small tensor {i} step {step}", got, expected, 0.0)


def gradient_cases(rank: int, size: int) -> list:
    """(label, forward(x) -> y, x, w, expected gradient of sum(w*y) w.r.t. x on this rank, as
    Horovod defines it: w of every rank enters through the collectives of the backward pass)."""
    everyone = range(size)
    cases = []
    x = [rank_data(r, (2, 3), np.float32, seed=200) for r in everyone]
    w = [rank_data(r, (2, 3), np.float32, seed=201) for r in everyone]
    total_w = np.sum(w, axis=0)
    for op, scale in ((pl.Sum, 1.0), (pl.Average, 1.0 / size)):
        cases.append((f"allreduce {OPS[op]}", lambda t, op=op: pl.allreduce(
            t, op=op, prescale_factor=0.5, postscale_factor=4.0), x[rank], w[rank],
            total_w * scale * 2.0))
    # grouped_allreduce (Sum) of x and 2x, added: the gradient is 3 * the sum of the weights.
    cases.append(("grouped_allreduce Sum", lambda t: tf.add_n(pl.grouped_allreduce(
        [t, 2.0 * t], op=pl.Sum)), x[rank], w[rank], 3.0 * total_w))
    xs = [rank_data(r, (gather_rows(r) + 1, 2), np.float32, seed=202) for r in everyone]
    rows = sum(a.shape[0] for a in xs)
    ws = [rank_data(r, (rows, 2), np.float32, seed=203) for r in everyone]
    start = sum(a.shape[0] for a in xs[:rank])
    # Horovod's gradients: allgather's and broadcast's average the incoming gradient over ranks.
    cases.append(("allgather", pl.allgather, xs[rank], ws[rank],
                  np.mean(ws, axis=0)[start:start + xs[rank].shape[0]]))
    mean_w = total_w / size
    for root in everyone:
        cases.append((f"broadcast root {root}", lambda t, root=root: pl.broadcast(t, root),
                      x[rank], w[rank], mean_w if rank == root else np.zeros_like(mean_w)))
    splits = [alltoall_splits(r, size) for r in everyone]
    xa = [rank_data(r, (sum(splits[r]), 2), np.float32, seed=204) for r in everyone]
    wa = [rank_data(r, (sum(splits[k][r] for k in everyone), 2), np.float32, seed=205)
          for r in everyone]
    blocks = []
    for j in everyone:  # the rows this rank sent to j come back with j's weights
        offset = sum(splits[k][j] for k in range(rank))
        blocks.append(wa[j][offset:offset + splits[rank][j]])
    cases.append(("alltoall", lambda t: pl.alltoall(t, splits[rank])[0], xa[rank], wa[rank],
                  np.concatenate(blocks)))
    return cases


def check_gradients(rank: int, size: int) -> None:
    cases = gradient_cases(rank, size)
    # Session: tf.gradients over a graph built in this rank's own order.
    graph = tf.Graph()
    with graph.as_default():
        grads = {}
        for label, forward, x, w, _ in shuffled(cases, rank):
            xt = tf.constant(x)
            with case_scope(label):
                loss = tf.reduce_sum(tf.constant(w) * forward(xt))
            with case_scope(label + "_grad"):
                grads[label] = tf.gradients(loss, xt)[0]
        try:
            tf.gradients(tf.reduce_sum(pl.allreduce(xt, op=pl.Max)), xt)
            fail(rank, "the gradient of a Max allreduce did not raise")
        except ValueError as exc:
            if "not differentiable" not in str(exc):
                fail(rank, f"unclear error for the Max gradient: {exc}")
    with session(graph) as sess:
        results = sess.run(grads)
    for label, _, _, _, expected in cases:
        assert_close(rank, f"graph gradient {label}", results[label], expected, 1e-5)

    def tape_gradient(forward, x, w):
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            loss = tf.reduce_sum(tf.constant(w) * forward(xt))
        return tape.gradient(loss, xt)

    for label, forward, x, w, expected in cases:
        assert_close(rank, f"eager gradient {label}", tape_gradient(forward, x, w).numpy(),
                     expected, 1e-5)

    @tf.function(autograph=False)
    def function_gradients():
        return {label: tape_gradient(forward, x, w) for label, forward, x, w, _ in cases}

    results = function_gradients()
    for label, _, _, _, expected in cases:
        assert_close(rank, f"tf.function gradient {label}", results[label].numpy(), expected,
                     1e-5)


def check_large_outputs_are_not_overwritten(rank: int, size: int) -> None:
    """An allreduce of a variable (>= 1 MiB) reuses its previous output buffer only when nothing
    holds it any more: results fetched or kept from earlier steps must not change."""
    n = 300_000
    graph = tf.Graph()
    with graph.as_default():
        var = tf.compat.v1.Variable(tf.zeros([n]))
        value = tf.compat.v1.placeholder(tf.float32, [n])
        assign = var.assign(value)
        reduced = pl.allreduce(var.read_value(), op=pl.Sum, name="large_variable")
        doubled = reduced * 2.0  # a consumer of the output inside the graph
    with session(graph) as sess:
        sess.run(var.initializer)
        kept = []
        for step in range(4):
            sess.run(assign, {value: np.full(n, step + rank, np.float32)})
            kept.append(sess.run([reduced, doubled]))
        for step, (got, got_doubled) in enumerate(kept):
            expected = np.full(n, sum(step + r for r in range(size)), np.float32)
            assert_close(rank, f"large allreduce fetched at step {step}", got, expected)
            assert_close(rank, f"its consumer at step {step}", got_doubled, 2 * expected)
    first = pl.allreduce(tf.fill([n], float(rank)), op=pl.Sum, name="large_eager")
    second = pl.allreduce(tf.fill([n], 1.0), op=pl.Sum, name="large_eager")
    assert_close(rank, "earlier eager result", first.numpy(),
                 np.full(n, sum(range(size)), np.float32))
    assert_close(rank, "later eager result", second.numpy(), np.full(n, size, np.float32))


def check_errors(rank: int, size: int) -> None:
    # Invalid splits fail locally, before any communication.
    try:
        pl.alltoall(tf.zeros([3, 2]), [1] * (size + 1))
        fail(rank, "alltoall with one split too many did not raise")
    except tf.errors.InvalidArgumentError as exc:
        if "splits" not in str(exc):
            fail(rank, f"unclear alltoall splits error: {exc}")
    if size == 1:
        return
    # Shapes that differ across ranks: every rank's run fails, naming the tensor.
    graph = tf.Graph()
    with graph.as_default():
        bad = pl.allreduce(tf.ones([rank + 1, 2]), op=pl.Sum, name="mismatched_weights")
        good = pl.allreduce(tf.ones([4]), op=pl.Sum, name="after_the_error")
    with session(graph) as sess:
        try:
            sess.run(bad)
            fail(rank, "an allreduce with shapes differing across ranks did not fail")
        except tf.errors.FailedPreconditionError as exc:  # as Horovod raises it
            if "mismatched_weights" not in str(exc):
                fail(rank, f"the shape-mismatch error does not name the tensor: {exc}")
        # The runtime keeps working after a failed collective.
        assert_close(rank, "allreduce after an error", sess.run(good),
                     np.full(4, size, np.float32))


def check_before_init(rank: int) -> None:
    try:
        pl.allreduce(tf.constant([1.0]))
        fail(rank, "allreduce before init() did not raise")
    except pl.NotInitializedError as exc:
        if "perseus_legacy.init()" not in str(exc):
            fail(rank, f"unclear error before init(): {exc}")
    # The raw op, run anyway, fails with a FailedPrecondition that says what to do.
    try:
        pl_ops._op_library().perseus_allreduce(tf.constant([1.0]), reduce_op=pl.Sum,
                                               tensor_name="early")
        fail(rank, "the raw op before init() did not fail")
    except tf.errors.FailedPreconditionError as exc:
        if "perseus_legacy.init()" not in str(exc):
            fail(rank, f"unclear kernel error before init(): {exc}")


COLLECTIVES = ("allreduce", "allgather", "broadcast", "alltoall", "grouped_allreduce")
MODES = {"eager": run_eager, "graph": run_graph, "function": run_function}


def named_cases(rank: int, size: int) -> dict:
    """Every case by name: `<collective>_<mode>` runs build_cases' cases of that collective (every
    dtype, op and shape) in eager, Session or tf.function mode, then the checks of their own."""
    built = build_cases(rank, size)
    cases = {}
    for collective in COLLECTIVES:
        mine = [case for case in built if case[0].split(" ")[0] == collective]
        for mode, run in MODES.items():
            cases[f"{collective}_{mode}"] = lambda run=run, mine=mine: run(rank, mine)
    cases["fusion_of_200_small_tensors"] = lambda: check_fusion_of_many_small(rank, size)
    cases["gradients"] = lambda: check_gradients(rank, size)
    cases["large_outputs_are_not_overwritten"] = lambda: (
        check_large_outputs_are_not_overwritten(rank, size))
    cases["errors_name_the_tensor"] = lambda: check_errors(rank, size)
    grouped = sum(1 for case in built if case[0].split(" ")[0] in COLLECTIVES)
    if grouped != len(built) or set(cases) | {"before_init"} != set(CASES):
        fail(rank, f"CASES and the cases built differ: {sorted(cases)} against {CASES}")
    return cases


# The case names, a literal: tests/test_tf_ops.py parametrizes over them (harness.worker_cases).
CASES = (
    "allreduce_eager", "allreduce_graph", "allreduce_function",
    "allgather_eager", "allgather_graph", "allgather_function",
    "broadcast_eager", "broadcast_graph", "broadcast_function",
    "alltoall_eager", "alltoall_graph", "alltoall_function",
    "grouped_allreduce_eager", "grouped_allreduce_graph", "grouped_allreduce_function",
    "fusion_of_200_small_tensors", "gradients", "large_outputs_are_not_overwritten",
    "errors_name_the_tensor", "before_init",
)


def main() -> None:
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    names = sys.argv[1:] or CASES
    failed = []
    if "before_init" in names:  # it runs before init(), so first
        rank_env = launcher_rank()
        failed += run_cases(rank_env, {"before_init": lambda: check_before_init(rank_env)},
                            ["before_init"])
    pl.init()
    failed += run_cases(pl.rank(), named_cases(pl.rank(), pl.size()),
                        [name for name in names if name != "before_init"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

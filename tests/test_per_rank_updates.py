"""Model updates that bypass the optimizer, on 2 real ranks: KMeans, LinearSDCA and a model_fn's
own assign from this rank's data are refused before the first step; declared per-rank updates,
updates from an allreduce and batch normalization train, checked against numpy on the global
batch (tests/workers/per_rank_updates.py)."""

from __future__ import annotations  # noqa: I001 (perseus_legacy before tensorflow)

import perseus_legacy as pl

import pytest
import tensorflow as tf
from harness import run_ranks

from perseus_legacy.tensorflow import collectives
from perseus_legacy.tf1.per_rank import find_per_rank_updates

CASES = ("kmeans_refused", "sdca_refused", "assign_add_refused", "assign_add_declared",
         "allreduce_value", "batch_norm")


@pytest.fixture(scope="module")
def output() -> str:
    """One launch for every case (start-up dominates)."""
    return run_ranks(2, "tests/workers/per_rank_updates.py", *CASES, timeout=300).stdout


@pytest.mark.parametrize("case", CASES)
def test_update_outside_the_optimizer_is_refused_or_matches_one_process(output, case):
    assert output.count(f"] {case}: OK") == 2, (case, output)


# ---- the classification of graph ops, in-process (no ranks; the launch above is the evidence) ----

def _graph_case(build, control_flow_v1: bool = False) -> list:
    """(op name, variable name) of every update `build()` adds that the check refuses."""
    graph = tf.Graph()
    if control_flow_v1:
        tf.compat.v1.disable_control_flow_v2()
    try:
        with graph.as_default():
            build()
    finally:
        if control_flow_v1:
            tf.compat.v1.enable_control_flow_v2()
    return [(op.name, var.name) for op, var, _ in find_per_rank_updates(graph)]


def _data():
    dataset = tf.data.Dataset.from_tensors(tf.ones([4, 3])).repeat()
    return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def _allreduce(tensor, name):
    return collectives._op_library().perseus_allreduce(
        tensor, reduce_op=1, prescale_factor=1.0, postscale_factor=1.0, tensor_name=name,
        process_set_id=0)


def _var(name, shape=(), **kwargs):
    return tf.compat.v1.get_variable(name, shape, initializer=tf.zeros_initializer(), **kwargs)


def _refused_from_data():
    _var("v").assign_add(tf.reduce_sum(_data()), name="from_data")


def _reduced_value():
    _var("v").assign_add(_allreduce(tf.reduce_sum(_data()), "s") * 0.5)


def _through_local_variable():
    local = _var("local", collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
    written = local.assign(tf.reduce_sum(_data()))
    with tf.control_dependencies([written]):
        _var("v").assign(local.read_value() * 2.0)


def _fed_value():
    _var("v").assign(tf.compat.v1.placeholder(tf.float32, []))


def _cond_on_data():
    v = _var("v")
    tf.compat.v1.cond(tf.reduce_sum(_data()) > 0, lambda: v.assign(1.0).op, tf.no_op)


def _while_on_data():
    v = _var("v")
    limit = tf.cast(tf.reduce_sum(_data()), tf.int32)

    def body(i):
        with tf.control_dependencies([v.assign_add(1.0)]):
            return i + 1

    tf.while_loop(lambda i: i < limit, body, [tf.constant(0)])


def _optimizer_with_reduced_gradient_and_fed_rate():
    w = _var("w", [3])
    step = tf.compat.v1.train.get_or_create_global_step()
    loss = tf.reduce_sum(_data() * w)
    optimizer = tf.compat.v1.train.AdamOptimizer(tf.compat.v1.placeholder(tf.float32, []))
    grads = [(_allreduce(g, "g"), v) for g, v in optimizer.compute_gradients(loss)]
    train = optimizer.apply_gradients(grads, step)
    with tf.control_dependencies([train]):
        tf.train.ExponentialMovingAverage(0.9).apply([w])


def _optimizer_with_local_gradient():
    w = _var("w", [3])
    tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(_data() * w))


def _batch_norm_and_metrics():
    x = tf.compat.v1.layers.batch_normalization(_data(), training=True)
    tf.compat.v1.metrics.mean(x)
    tf.compat.v1.train.get_or_create_global_step().assign_add(tf.cast(tf.size(x), tf.int64))


def _declared():
    v, u = _var("v"), _var("u")
    pl.per_rank_update(v)
    v.assign_add(tf.reduce_sum(_data()))
    pl.per_rank_update(u.assign(tf.reduce_sum(_data())))


def _sparse_gathered():
    table = _var("table", [10, 3])
    data = _data()
    indices = tf.cast(data[:, 0], tf.int32)
    gather = collectives._op_library().perseus_allgather
    values = gather(data, tensor_name="values", process_set_id=0)
    rows = gather(indices, tensor_name="rows", process_set_id=0)
    table.scatter_add(tf.IndexedSlices(values, rows))


def _keras_model_in_graph():
    model = tf.keras.Sequential([tf.keras.layers.Dense(4), tf.keras.layers.BatchNormalization(),
                                 tf.keras.layers.Dense(1)])
    loss = tf.reduce_mean(model(_data(), training=True))
    optimizer = tf.keras.optimizers.legacy.Adam(0.1)
    grads = optimizer.get_gradients(loss, model.trainable_variables)
    with tf.control_dependencies(model.updates):
        optimizer.apply_gradients([(_allreduce(g, f"g{i}"), v) for i, (g, v)
                                   in enumerate(zip(grads, model.trainable_variables))])


GRAPH_CASES = {
    "keras_model_optimizer_and_batch_norm_in_a_graph": (_keras_model_in_graph, []),
    "assign_from_data": (_refused_from_data, [("from_data", "v")]),
    "assign_from_allreduce": (_reduced_value, []),
    "assign_from_a_local_variable_written_from_data": (_through_local_variable,
                                                       [("AssignVariableOp_1", "v")]),
    "assign_from_a_feed": (_fed_value, [("AssignVariableOp", "v")]),
    "assign_in_cond_on_data": (_cond_on_data, [("cond", "v")]),
    "assign_in_while_loop_on_data": (_while_on_data, [("while", "v")]),
    "optimizer_with_reduced_gradient_fed_rate_and_ema": (
        _optimizer_with_reduced_gradient_and_fed_rate, []),
    "optimizer_with_local_gradient": (_optimizer_with_local_gradient,
                                      [("GradientDescent/update_w/ResourceApplyGradientDescent",
                                        "w")]),
    "batch_norm_metrics_and_global_step": (_batch_norm_and_metrics, []),
    "declared_variable_and_op": (_declared, []),
    "sparse_update_of_gathered_rows": (_sparse_gathered, []),
}


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_graph_update_classification(case):
    build, refused = GRAPH_CASES[case]
    assert _graph_case(build) == refused


@pytest.mark.parametrize("build", [_cond_on_data, _while_on_data])
def test_update_inside_tf1_control_flow_on_data_is_refused(build):
    refused = _graph_case(build, control_flow_v1=True)
    assert [var for _, var in refused] == ["v"], refused

"""What the check for per-rank updates (perseus_legacy.tf1.per_rank) costs, once per graph.

    python benchmarks/per_rank_check.py

For training graphs of growing size (a dataset input, LAYERS dense + batch-norm layers, Adam,
an exponential moving average of the weights): the number of ops, the median time of
`find_per_rank_updates()` over 5 runs, and as baseline, measured in the same run, the median
time of `graph.as_graph_def()`, which creating a Session does anyway for the same graph. One
process: the walk is the same with any number of ranks (the optimizer updates show as refused
here because no collective was added; that changes what is reported, not what is walked).
"""

from __future__ import annotations  # noqa: I001 (perseus_legacy first)

import perseus_legacy  # noqa: F401 (selects tf-keras before TensorFlow is used)

import statistics
import time

import numpy as np
import tensorflow as tf

from perseus_legacy.tf1.per_rank import find_per_rank_updates


def build(layers: int) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        x = np.random.RandomState(0).rand(64, 16).astype(np.float32)
        features = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices(x).batch(8).repeat()).get_next()
        hidden = features
        for i in range(layers):
            hidden = tf.compat.v1.layers.dense(hidden, 16, activation=tf.nn.relu, name=f"d{i}")
            hidden = tf.compat.v1.layers.batch_normalization(hidden, training=True, name=f"bn{i}")
        loss = tf.reduce_mean(tf.square(hidden))
        step = tf.compat.v1.train.get_or_create_global_step()
        with tf.control_dependencies(tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.UPDATE_OPS)):
            train = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss, step)
        with tf.control_dependencies([train]):
            tf.train.ExponentialMovingAverage(0.99).apply(tf.compat.v1.trainable_variables())
    return graph


def median_seconds(function, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    print("| layers | ops | check (ms) | as_graph_def (ms), baseline | check / baseline |")
    print("|---:|---:|---:|---:|---:|")
    for layers in (5, 20, 60, 120):
        graph = build(layers)
        check = median_seconds(lambda graph=graph: find_per_rank_updates(graph))
        baseline = median_seconds(graph.as_graph_def)
        print(f"| {layers} | {len(graph.get_operations())} | {check * 1e3:.1f} | "
              f"{baseline * 1e3:.1f} | {check / baseline:.2f} |")


if __name__ == "__main__":
    main()

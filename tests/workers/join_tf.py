"""TF graph allreduces in a tf.compat.v1 Session complete while the other ranks are in join().

Rank 0 runs three session steps of two allreduces (Average, Sum; fused in one step) after every
other rank has joined: the results are numpy's reductions over rank 0's data alone.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import numpy as np
import tensorflow as tf
from worker_util import assert_close, fail, rank_data


def main() -> None:
    pl.init()
    rank = pl.rank()
    tf.compat.v1.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, shape=(4, 3))
        average = pl.allreduce(x, op=pl.Average)
        total = pl.allreduce(2.0 * x, op=pl.Sum)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=2)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        feed = rank_data(rank, (4, 3), np.float32)
        got_average, got_total = sess.run([average, total], {x: feed})
        everyone = [rank_data(r, (4, 3), np.float32) for r in range(pl.size())]
        assert_close(rank, "Session allreduce before joining", got_average,
                     np.mean(everyone, axis=0), rtol=1e-6)
        if rank != 0:
            last = pl.join()
        else:
            for step in range(3):
                feed = rank_data(0, (4, 3), np.float32, seed=step + 1)
                got_average, got_total = sess.run([average, total], {x: feed})
                assert_close(rank, f"Session step {step}: Average while the others are joined",
                             got_average, feed, rtol=1e-6)
                assert_close(rank, f"Session step {step}: Sum while the others are joined",
                             got_total, 2.0 * feed, rtol=1e-6)
            last = pl.join()
    if last != 0:
        fail(rank, f"join() returned {last}, expected 0 (the rank that joined last)")
    print(f"[rank {rank}] join tf OK", flush=True)


if __name__ == "__main__":
    main()

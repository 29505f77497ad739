"""join() with the numpy collectives of perseus_legacy._core, checked against numpy.

Phase 1: rank r runs 5 + 3r allreduce steps, then joins; each step's result is numpy's mean over
the ranks still running, and take_peer_joined() says whether a rank was missing. Phase 2 (join
again in the same job): the last rank joins at once and the others run every reduce op, fused
and prescaled allreduces, allgather, broadcast and the errors for a joined broadcast root and
for alltoall. Phase 3: a request submitted before joining keeps its data. Then TF graph
allreduces in a Session complete while the other ranks are in join(). Last: the last rank shuts
down while the others are in join().

argv[1:]: the CASES to run (default: all), in CASES' order; each prints `[rank R] CASE name: OK`
or `... FAILED: why` (worker_util.run_cases).
"""

from __future__ import annotations

import sys
import threading

import numpy as np
from worker_util import (
    assert_close,
    expect_error,
    fail,
    launcher_rank,
    rank_data,
    run_cases,
    wanted_cases,
)

import perseus_legacy as pl
from perseus_legacy import _core

SHAPE = (3, 4)


def steps_of(r: int) -> int:
    return 5 + 3 * r


def check_join_returns(rank: int, what: str, expected_last: int) -> None:
    last = pl.join()
    if last != expected_last:
        fail(rank, f"{what}: join() returned {last}, expected the last rank to join, "
                   f"{expected_last}")


def uneven_steps(rank: int, size: int) -> None:
    _core.take_peer_joined()
    for step in range(steps_of(rank)):
        got = _core.allreduce(rank_data(rank, SHAPE, np.float32, seed=step), f"uneven.{step}")
        running = [r for r in range(size) if steps_of(r) > step]
        # take_peer_joined(): whether this step ran without a joined rank's data.
        if _core.take_peer_joined() != (len(running) < size):
            fail(rank, f"uneven step {step}: take_peer_joined() is wrong with ranks {running} "
                       f"of {size} running")
        expected = np.mean([rank_data(r, SHAPE, np.float32, seed=step) for r in running], axis=0)
        assert_close(rank, f"uneven step {step} (ranks {running} running)", got,
                     expected.astype(np.float32), rtol=1e-6)
    # Rank size-1 runs the most steps: its last ones are ready only once the others have joined.
    check_join_returns(rank, "uneven steps", size - 1)


def with_a_joined_rank(rank: int, size: int) -> None:
    joined = size - 1
    if rank == joined:
        check_join_returns(rank, "a joined rank", 0)
        return
    running = list(range(size - 1))
    data = {r: rank_data(r, SHAPE, np.float32, seed=100) for r in running}
    stacked = np.stack([data[r].astype(np.float64) for r in running])
    for op, expected in ((pl.Sum, stacked.sum(0)), (pl.Min, stacked.min(0)),
                         (pl.Max, stacked.max(0)), (pl.Product, stacked.prod(0)),
                         (pl.Average, stacked.mean(0))):
        got = _core.allreduce(data[rank], f"joined.op{op}", op=op)
        label = f"op {pl.common.basics.REDUCE_OP_NAMES[op]} with rank {joined} joined"
        assert_close(rank, label, got, expected.astype(np.float32), rtol=1e-6)
    ints = {r: rank_data(r, (5,), np.int32, seed=101) for r in running}
    got = _core.allreduce(ints[rank], "joined.int_average", op=pl.Average)
    expected = np.trunc(np.sum([ints[r] for r in running], axis=0) / len(running))
    assert_close(rank, "int32 Average over the ranks with data", got, expected.astype(np.int32))
    got = _core.allreduce(data[rank], "joined.scaled", op=pl.Average, prescale_factor=2.0,
                          postscale_factor=0.5)
    assert_close(rank, "prescaled / postscaled Average", got,
                 stacked.mean(0).astype(np.float32), rtol=1e-6)
    fused = _core.grouped_allreduce([data[rank], 2 * data[rank], data[rank][:1]],
                                    ["joined.g0", "joined.g1", "joined.g2"], op=pl.Sum)
    for i, (got, factor, rows) in enumerate(zip(fused, (1, 2, 1), (3, 3, 1))):
        assert_close(rank, f"fused Sum {i}", got,
                     (factor * stacked.sum(0)[:rows]).astype(np.float32), rtol=1e-6)
    # Large tensors among small ones run as collectives of their own: the joined rank's
    # contribution must be split the same way.
    big = {r: rank_data(r, (300_000,), np.float32, seed=104) for r in running}
    mixed = _core.grouped_allreduce([data[rank], big[rank], 3 * data[rank], 2 * big[rank]],
                                    ["joined.m0", "joined.m1", "joined.m2", "joined.m3"],
                                    op=pl.Average)
    big_mean = np.mean([big[r].astype(np.float64) for r in running], axis=0)
    for i, (got, expected) in enumerate(zip(mixed, (stacked.mean(0), big_mean,
                                                    3 * stacked.mean(0), 2 * big_mean))):
        assert_close(rank, f"fused Average of large and small tensors {i}", got,
                     expected.astype(np.float32), rtol=1e-6)

    rows = rank_data(rank, (rank + 1, 2), np.float64, seed=102)
    got = _core.allgather(rows, "joined.gather")
    expected = np.concatenate([rank_data(r, (r + 1, 2), np.float64, seed=102) for r in running])
    assert_close(rank, "allgather without the joined rank's rows", got, expected)
    got = _core.broadcast(data[rank], 0, "joined.bcast")
    assert_close(rank, "broadcast from a rank with data", got, data[0])
    expect_error(rank, "broadcast from a joined root",
                 lambda: _core.broadcast(data[rank], joined, "joined.bcast_root"), RuntimeError,
                 '"joined.bcast_root"', f"root_rank {joined} has joined")
    expect_error(rank, "alltoall while a rank has joined",
                 lambda: _core.alltoall(np.ones((size, 2)), "joined.a2a"), RuntimeError,
                 '"joined.a2a"', f"ranks [{joined}] have joined")
    # Rank 0 joins last: rank 1 (with 3 ranks) joins first and rank 0 reduces alone meanwhile.
    if rank != 0:
        check_join_returns(rank, "a joined rank", 0)
        return
    if size == 3:
        got = _core.allreduce(data[0], "joined.alone", op=pl.Average)
        assert_close(rank, "Average with only rank 0 left", got, data[0])
    check_join_returns(rank, "a joined rank", 0)


def submitted_before_joining(rank: int, size: int) -> None:
    """The last rank submits "pre" (with "sync") from a thread, then joins; "pre" keeps its data."""
    last = size - 1
    x = rank_data(rank, SHAPE, np.float64, seed=103)
    if rank == last:
        result = {}
        pre = threading.Thread(target=lambda: result.update(zip(
            ("pre", "sync"), _core.grouped_allreduce([x, x], ["pre.x", "pre.sync"], op=pl.Sum))))
        pre.start()
        # "go" completes only after the others completed "pre.sync": "pre.x" is queued by then.
        _core.allreduce(x, "pre.go")
        check_join_returns(rank, "submitted before joining", 0)
        pre.join()
        got = result.get("pre")
    else:
        _core.allreduce(x, "pre.sync", op=pl.Sum)
        _core.allreduce(x, "pre.go")
        got = _core.allreduce(x, "pre.x", op=pl.Sum)
        if rank != 0:
            check_join_returns(rank, "submitted before joining", 0)
        else:
            # Rank 0 joins last: the others' joins are the only reason its next step completes.
            _core.allreduce(x, "pre.after", op=pl.Sum)
            check_join_returns(rank, "submitted before joining", 0)
    expected = np.sum([rank_data(r, SHAPE, np.float64, seed=103) for r in range(size)], axis=0)
    assert_close(rank, "a request submitted before joining uses the joined rank's data", got,
                 expected)


def shutdown_while_others_join(rank: int, size: int) -> None:
    leaver = size - 1
    if rank == leaver:
        _core.shutdown()
        return
    expect_error(rank, "join while a rank shuts down", pl.join,
                 RuntimeError, f"rank {leaver} shut down")


def join_before_init(rank: int) -> None:
    try:
        pl.join()
    except pl.NotInitializedError as exc:
        if "init()" not in str(exc):
            fail(rank, f"join before init: unhelpful message {exc}")
    else:
        fail(rank, "join before init did not raise NotInitializedError")


def allreduce_after_the_joins(rank: int, size: int) -> None:
    got = _core.allreduce(np.full(2, rank + 1.0), "after.joins", op=pl.Sum)
    assert_close(rank, "a normal allreduce after the joins", got,
                 np.full(2, size * (size + 1) / 2.0))


def session_allreduce_while_others_join(rank: int, size: int) -> None:
    """TF graph allreduces in a tf.compat.v1 Session complete while the other ranks are in
    join(): rank 0 runs three session steps of two allreduces (Average, Sum; fused in one step)
    after every other rank has joined, whose results are numpy's over rank 0's data alone."""
    import tensorflow as tf  # only this case needs TensorFlow

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
        got_average, _ = sess.run([average, total], {x: feed})
        everyone = [rank_data(r, (4, 3), np.float32) for r in range(size)]
        assert_close(rank, "Session allreduce before joining", got_average,
                     np.mean(everyone, axis=0), rtol=1e-6)
        if rank == 0:
            for step in range(3):
                feed = rank_data(0, (4, 3), np.float32, seed=step + 1)
                got_average, got_total = sess.run([average, total], {x: feed})
                assert_close(rank, f"Session step {step}: Average while the others are joined",
                             got_average, feed, rtol=1e-6)
                assert_close(rank, f"Session step {step}: Sum while the others are joined",
                             got_total, 2.0 * feed, rtol=1e-6)
        check_join_returns(rank, "Session allreduces while the others are joined", 0)


# The cases, in the order they run: join_before_init first (before init()), the shutdown last.
CASES = ("join_before_init", "uneven_steps", "with_a_joined_rank", "submitted_before_joining",
         "allreduce_after_the_joins", "session_allreduce_while_others_join",
         "shutdown_while_others_join")


def main() -> None:
    names = wanted_cases(CASES, sys.argv[1:])
    failed = []
    if "join_before_init" in names:
        failed += run_cases(launcher_rank(), {"join_before_init":
                                              lambda: join_before_init(launcher_rank())},
                            ["join_before_init"])
    pl.init()
    rank, size = pl.rank(), pl.size()
    phases = (uneven_steps, with_a_joined_rank, submitted_before_joining,
              allreduce_after_the_joins, session_allreduce_while_others_join,
              shutdown_while_others_join)
    cases = {phase.__name__: (lambda phase=phase: phase(rank, size)) for phase in phases}
    failed += run_cases(rank, cases, [name for name in names if name != "join_before_init"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

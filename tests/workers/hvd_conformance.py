"""Runs on every rank: Horovod idioms from Horovod's own examples and tests, checked against numpy.

Each case prints "<case>: OK" on success; a failed check exits non-zero naming the rank.
argv[1:]: the cases to run (default: all).
"""

from __future__ import annotations  # noqa: I001

import perseus_legacy as hvd

import sys

import numpy as np
import tensorflow as tf
from worker_util import assert_close, barrier, fail, rank_data


def broadcast_variables_in_tf_function() -> None:
    """hvd.broadcast_variables on eagerly created variables, called inside a tf.function (as
    tensorflow2_mnist.py does on its first step): every rank ends with rank 0's values."""
    shapes = {"dense/kernel": (3, 2), "dense/bias": (2,)}
    variables = [tf.Variable(rank_data(hvd.rank(), shape, np.float32), name=name)
                 for name, shape in shapes.items()]

    @tf.function
    def step(first_batch: bool) -> None:
        if first_batch:
            hvd.broadcast_variables(variables, root_rank=0)

    step(tf.constant(True))
    for var, shape in zip(variables, shapes.values()):
        assert_close(hvd.rank(), f"{var.name} after broadcast", var.numpy(),
                     rank_data(0, shape, np.float32))


def each_rank_its_own_process_set() -> None:
    """Every rank builds the same code for the set it belongs to (even or odd ranks), as
    Horovod's process-set tests do: a graph run by a Session, a tf.function and eagerly, with
    default and explicit names. Sets made from range() and reversed(range()) as in Horovod."""
    rank, size = hvd.rank(), hvd.size()
    even = hvd.add_process_set(hvd.ProcessSet(range(0, size, 2)))
    odd = hvd.add_process_set(hvd.ProcessSet(reversed(range(1, size, 2))))
    mine = even if rank % 2 == 0 else odd
    members = list(range(rank % 2, size, 2))
    if mine.ranks != members:
        fail(rank, f"set of {members} has ranks {mine.ranks}")
    value = rank_data(rank, (4,), np.float32)
    expected = sum(rank_data(r, (4,), np.float32) for r in members)

    graph = tf.Graph()
    with graph.as_default():
        summed = hvd.allreduce(tf.constant(value), op=hvd.Sum, process_set=mine)
        named = hvd.allreduce(tf.constant(value), op=hvd.Sum, process_set=mine, name="same")
        with tf.compat.v1.Session(graph=graph) as session:
            for what, got in zip(("graph", "graph name='same'"), session.run([summed, named])):
                assert_close(rank, f"{what} sum over {members}", got, expected, rtol=1e-6)

    @tf.function
    def in_function(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, process_set=mine)

    assert_close(rank, f"tf.function sum over {members}", in_function(value).numpy(), expected,
                 rtol=1e-6)
    assert_close(rank, f"eager name='same' sum over {members}",
                 hvd.allreduce(value, op=hvd.Sum, process_set=mine, name="same").numpy(),
                 expected, rtol=1e-6)
    barrier("sets used")  # no rank removes the sets too early
    hvd.remove_process_set(odd)
    hvd.remove_process_set(even)


def init_with_a_repeated_set_registers_none() -> None:
    """init(process_sets=...) naming the same ranks twice fails before registering any set, so
    the next init() with a valid list registers them (Horovod's static process-set test)."""
    rank, size = hvd.rank(), hvd.size()
    rest = list(range(1, size))
    try:
        hvd.init(process_sets=[[0], range(1, size), [0]])
    except ValueError as error:
        if "twice" not in str(error):
            fail(rank, f"the error does not say what is repeated: {error}")
    else:
        fail(rank, "init() accepted the ranks [0] twice")
    from perseus_legacy.common.process_sets import registered

    if set(registered()) != {0}:
        fail(rank, f"a refused init() left sets behind: {registered()}")
    first, others = hvd.ProcessSet([0]), hvd.ProcessSet(range(1, size))
    hvd.init(process_sets=[first, others])
    mine, members = (first, [0]) if rank == 0 else (others, rest)
    value = rank_data(rank, (3,), np.float32)
    assert_close(rank, f"sum over {members}",
                 hvd.allreduce(value, op=hvd.Sum, process_set=mine).numpy(),
                 sum(rank_data(r, (3,), np.float32) for r in members), rtol=1e-6)
    barrier("init_sets")
    hvd.remove_process_set(others)
    hvd.remove_process_set(first)


CASES = {
    "broadcast_variables_in_tf_function": broadcast_variables_in_tf_function,
    "each_rank_its_own_process_set": each_rank_its_own_process_set,
    "init_with_a_repeated_set_registers_none": init_with_a_repeated_set_registers_none,
}


def main() -> None:
    hvd.init()
    for name in sys.argv[1:] or CASES:
        if name not in CASES:
            fail(hvd.rank(), f"unknown case {name!r}; known: {sorted(CASES)}")
        CASES[name]()
        print(f"[rank {hvd.rank()}] {name}: OK", flush=True)


if __name__ == "__main__":
    main()

"""The TF allreduce op's Session steps and mpi4py's Allreduce, as the collective benchmarks time
them (benchmarks/allreduce.py, benchmarks/cluster.py; allreduce_horovod.py with Horovod's op).

How the op is measured: the input is a variable (no feed copied into the graph each step), and
the session runs a NoOp with the allreduces as control inputs (the result is computed, never
fetched: a fetch would copy it into a new numpy array every step). Imports TensorFlow;
perseus_legacy only when a step uses its op (a caller that does imports perseus_legacy before
this module, so that it selects legacy Keras first); mpi4py only in mpi4py_step() (a TCP launch
never initializes MPI).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import tensorflow as tf

INTER_OP_THREADS = 2  # async kernels never hold a thread; two keep the executor responsive
# A negative count makes a Session run every kernel on the thread that made it ready: session.run's
# own thread, then the thread that completes an async kernel (the collective runtime's background
# thread), with no hand-off to a thread pool. A measurement only: in training, the step's
# compute would then run on the background thread, between its collectives.
INLINE_INTER_OP_THREADS = -1


def session(graph: tf.Graph, native: bool = True, inline: bool = False) -> tf.compat.v1.Session:
    """A Session configured as the docs tell users to: through pl.session_config() (no spinning
    thread pools on more than one rank). `native=False` (another library's op, perseus_legacy not
    loaded): the same settings, set directly. `inline`: INLINE_INTER_OP_THREADS."""
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=1,
        inter_op_parallelism_threads=INLINE_INTER_OP_THREADS if inline else INTER_OP_THREADS)
    if native:
        import perseus_legacy as pl

        config = pl.session_config(config)
    else:
        config.experimental.disable_thread_spinning = True
        # Grappler's dependency optimizer removes a stateless op whose output only feeds control
        # edges, as the chain's do: Horovod's allreduce is not marked stateful (this one is).
        config.graph_options.rewrite_options.dependency_optimization = (
            config.graph_options.rewrite_options.OFF)
    return tf.compat.v1.Session(graph=graph, config=config)


def tf_allreduce_step(shapes: list, chain: int = 1, grouped: bool = False,
                      floor: bool = False, allreduce: Callable | None = None,
                      inline: bool = False):
    """A Session step running `chain` rounds of one Sum-allreduce per shape, nothing fetched.

    Rounds are serialized by control dependencies, so each allreduce runs alone (never fused
    with the next) and one session.run's fixed cost is shared by `chain` of them. `grouped`:
    each round is one grouped_allreduce op of all the shapes instead of one op per shape.
    `floor`: the same graph with `tf.identity` in place of each allreduce, TensorFlow's own cost
    of such a step (the variable read, the executor, session.run), which no collective can beat.
    `allreduce(tensor, name)`: another library's Sum-allreduce op in place of perseus_legacy's
    (not with `grouped`), which is then not imported (also for that library's `floor`).
    `inline`: a Session that runs every kernel without a thread pool (see session()).
    """
    native = allreduce is None
    if native:
        import perseus_legacy as pl

        def allreduce(tensor, name):
            return pl.allreduce(tensor, op=pl.Sum, name=name)
    assert native or not grouped, "grouped is perseus_legacy's grouped_allreduce"
    graph = tf.Graph()
    with graph.as_default():
        variables = [tf.compat.v1.Variable(tf.ones(s, tf.float32), name=f"input_{i}")
                     for i, s in enumerate(shapes)]
        previous = []
        for k in range(chain):
            with tf.control_dependencies(previous):
                if floor:
                    previous = [tf.identity(v.read_value(), name=f"floor_{i}_{k}")
                                for i, v in enumerate(variables)]
                elif grouped:
                    previous = pl.grouped_allreduce([v.read_value() for v in variables],
                                                    op=pl.Sum, name=f"bench_group_{k}")
                else:
                    previous = [allreduce(v.read_value(), f"bench_{i}_{k}")
                                for i, v in enumerate(variables)]
        target = tf.group(*previous)
        init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
    sess = session(graph, native, inline)
    sess.run(init)
    return lambda: sess.run(target)


def mpi4py_step(nbytes: int, buffers: int = 1):
    """One comm.Allreduce (Sum) of `nbytes` of float32 on numpy buffers. `buffers` > 1: each
    call takes the next of that many send/receive pairs, as a step's allreduces each have their
    own gradient: from a few MiB on, one pair stays in the CPU's caches between calls."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    pairs = itertools.cycle([(np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32))
                             for _ in range(buffers)])
    return lambda: comm.Allreduce(*next(pairs), op=MPI.SUM)

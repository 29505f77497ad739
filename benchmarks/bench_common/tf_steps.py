"""The TF allreduce op's Session steps and mpi4py's Allreduce, as the collective benchmarks time
them (benchmarks/allreduce.py, benchmarks/cluster.py).

How the op is measured: the input is a variable (no feed copied into the graph each step), and
the session runs a NoOp with the allreduces as control inputs (the result is computed, never
fetched: a fetch would copy it into a new numpy array every step). Imports perseus_legacy, then
TensorFlow; mpi4py only in mpi4py_step() (a TCP launch never initializes MPI).
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import itertools

import numpy as np
import tensorflow as tf

INTER_OP_THREADS = 2  # async kernels never hold a thread; two keep the executor responsive


def session(graph: tf.Graph) -> tf.compat.v1.Session:
    """A Session configured as the docs tell users to: through pl.session_config() (no spinning
    thread pools on more than one rank)."""
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=INTER_OP_THREADS)
    return tf.compat.v1.Session(graph=graph, config=pl.session_config(config))


def tf_allreduce_step(shapes: list, chain: int = 1, grouped: bool = False,
                      floor: bool = False):
    """A Session step running `chain` rounds of one Sum-allreduce per shape, nothing fetched.

    Rounds are serialized by control dependencies, so each allreduce runs alone (never fused
    with the next) and one session.run's fixed cost is shared by `chain` of them. `grouped`:
    each round is one grouped_allreduce op of all the shapes instead of one op per shape.
    `floor`: the same graph with `tf.identity` in place of each allreduce, TensorFlow's own cost
    of such a step (the variable read, the executor, session.run), which no collective can beat.
    """
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
                    previous = [pl.allreduce(v.read_value(), op=pl.Sum, name=f"bench_{i}_{k}")
                                for i, v in enumerate(variables)]
        target = tf.group(*previous)
        init = tf.compat.v1.global_variables_initializer()
    graph.finalize()
    sess = session(graph)
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

"""Runs on every rank (3 or 4): process sets against numpy and one-process training.

A = {0, 2} is registered at init (init(process_sets=...)), B = {1, 2} or {1, 2, 3} afterwards
(add_process_set). Rank 2 is in both. Checks: the ProcessSet queries and *_op queries; one
tf.function step with collectives of A, B and the global set in flight together (allreduce
Sum / Average with scale factors, grouped allreduce), whose fusion stays within a set
(runtime_stats); allgather with uneven rows, broadcast and broadcast_ with a root in the set,
alltoall with splits, reducescatter, the object collectives; a rank outside a set gets an error
naming itself and the set; members disagreeing on a shape all get the error naming the ranks;
add_process_set or remove_process_set calls that differ fail on every rank; remove_process_set; a
DistributedGradientTape step, a TF1 DistributedOptimizer step and a Keras Model.fit on a set
equal one process on the set's global batch; join() covers the global set only; "stall" (with
PERSEUS_STALL_SHUTDOWN_SECS, in a launch of its own) checks that a set's stalled collective fails
naming its missing members only. argv[1:]: the CASES to run (default: all but "stall"), in
CASES' order; each prints `[rank R] CASE name: OK` or `... FAILED: why` (worker_util.run_cases).
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as hvd

import sys

import numpy as np
import tensorflow as tf
from worker_util import (assert_close, expect_error, fail, launcher_rank, rank_data, run_cases,
                         wanted_cases)


def check_queries(rank: int, size: int, a: hvd.ProcessSet, b: hvd.ProcessSet) -> None:
    if (a.process_set_id, a.ranks) != (1, [0, 2]) or b.process_set_id != 2:
        fail(rank, f"unexpected sets {a}, {b}")
    g = hvd.global_process_set
    if (g.process_set_id, g.size(), g.rank(), g.included()) != (0, size, rank, True):
        fail(rank, f"global_process_set: {g}, size {g.size()}, rank {g.rank()}")
    for ps in (a, b):
        if ps.size() != len(ps.ranks) or ps.included() != (rank in ps.ranks):
            fail(rank, f"{ps}: size {ps.size()}, included {ps.included()}")
        if rank in ps.ranks:
            assert_close(rank, f"{ps}.rank()", ps.rank(), ps.ranks.index(rank))
        else:
            expect_error(rank, f"{ps}.rank()", ps.rank, ValueError, f"rank {rank} is not in")
        assert_close(rank, "size_op", hvd.size_op(process_set_id=ps.process_set_id).numpy(),
                     np.int32(len(ps.ranks)))
        assert_close(rank, "process_set_included_op",
                     hvd.process_set_included_op(process_set_id=ps.process_set_id).numpy(),
                     np.int32(rank in ps.ranks))
    if sorted(hvd.common.process_sets.registered()) != [0, 1, 2]:
        fail(rank, f"registered sets {hvd.common.process_sets.registered()}")


def check_concurrent_step(rank: int, size: int, a: hvd.ProcessSet, b: hvd.ProcessSet) -> None:
    """Collectives of A, B and the global set in flight together, repeated; fusion only within a
    set: B's grouped allreduce fuses, A's and the global Sum (same dtype and op) never do."""
    x = [rank_data(r, (5,), np.float32, seed=3) for r in range(size)]
    in_a, in_b = a.included(), b.included()

    @tf.function
    def step(value):
        out = {"g_sum": hvd.allreduce(value, op=hvd.Sum, name="g_sum")}
        if in_a:
            out["a_sum"] = hvd.allreduce(value, op=hvd.Sum, name="a_sum", process_set=a)
            out["a_scaled"] = hvd.allreduce(value, op=hvd.Average, prescale_factor=2.0,
                                            postscale_factor=0.25, name="a_scaled",
                                            process_set=a)
        if in_b:
            out["b_avg"] = hvd.allreduce(value, op=hvd.Average, name="b_avg", process_set=b)
            out["b_grouped"] = hvd.grouped_allreduce([value, 2 * value, 3 * value], op=hvd.Sum,
                                                     name="b_grouped", process_set=b)
        return out

    before = hvd.runtime_stats()
    steps = 3
    for _ in range(steps):
        out = step(tf.constant(x[rank]))
        assert_close(rank, "global Sum", out["g_sum"].numpy(), np.sum(x, axis=0), rtol=1e-5)
        xa = np.array([x[r] for r in a.ranks])
        xb = np.array([x[r] for r in b.ranks])
        if a.included():
            assert_close(rank, "A Sum", out["a_sum"].numpy(), xa.sum(0), rtol=1e-5)
            assert_close(rank, "A Average pre 2 post 0.25", out["a_scaled"].numpy(),
                         (2 * xa).mean(0) * 0.25, rtol=1e-5)
        if b.included():
            assert_close(rank, "B Average", out["b_avg"].numpy(), xb.mean(0), rtol=1e-5)
            for k, result in enumerate(out["b_grouped"]):
                assert_close(rank, f"B grouped {k}", result.numpy(), (k + 1) * xb.sum(0),
                             rtol=1e-5)
    after = hvd.runtime_stats()
    fused = after["tensors_fused"] - before["tensors_fused"]
    groups = after["fused_groups"] - before["fused_groups"]
    expected = (3 * steps, steps) if b.included() else (0, 0)
    if (fused, groups) != expected:
        fail(rank, f"fusion: {fused} tensors in {groups} fused groups, expected {expected}")
    print(f"[rank {rank}] concurrent sets: {fused} tensors fused in {groups} groups", flush=True)


def check_collectives(rank: int, size: int, a: hvd.ProcessSet, b: hvd.ProcessSet) -> None:
    if b.included():
        pos, n = b.rank(), b.size()
        # allgather: rank r contributes r + 1 rows, in the set's order.
        rows = {r: rank_data(r, (r + 1, 2), np.float64, seed=4) for r in b.ranks}
        assert_close(rank, "B allgather", hvd.allgather(rows[rank], process_set=b).numpy(),
                     np.concatenate([rows[r] for r in b.ranks]))
        got = hvd.grouped_allgather([rows[rank], 2 * rows[rank]], process_set=b)
        assert_close(rank, "B grouped_allgather", got[1].numpy(),
                     2 * np.concatenate([rows[r] for r in b.ranks]))
        # broadcast from the set's last rank (a global rank).
        root = b.ranks[-1]
        value = rank_data(rank, (4,), np.int32, seed=5)
        assert_close(rank, "B broadcast", hvd.broadcast(value, root, process_set=b).numpy(),
                     rank_data(root, (4,), np.int32, seed=5))
        expect_error(rank, "broadcast with a root outside the set",
                     lambda: hvd.broadcast(value, 0, process_set=b), ValueError,
                     "root_rank 0 is not in process set 2")
        # alltoall: position p sends (p + j) % 2 + 1 rows to position j.
        def sent(r):
            p = b.ranks.index(r)
            splits = [(p + j) % 2 + 1 for j in range(n)]
            data = np.repeat(np.arange(n, dtype=np.float32)[:, None] + 10 * r, splits, axis=0)
            return np.repeat(data, 2, axis=1), splits
        data, splits = sent(rank)
        received, received_splits = hvd.alltoall(data, splits=splits, process_set=b)
        expected = [sent(r)[0][sent(r)[0][:, 0] == pos + 10 * r] for r in b.ranks]
        assert_close(rank, "B alltoall", received.numpy(), np.concatenate(expected))
        assert_close(rank, "B alltoall splits", received_splits.numpy(),
                     np.array([sent(r)[1][pos] for r in b.ranks], np.int32))
        # reducescatter: 2n + 1 rows, the first position gets one row more.
        x = {r: rank_data(r, (2 * n + 1, 3), np.float64, seed=6) for r in b.ranks}
        total = sum(x.values())
        start = pos * 2 + min(pos, 1)
        part = total[start:start + 2 + (1 if pos < 1 else 0)]
        assert_close(rank, "B reducescatter Sum",
                     hvd.reducescatter(x[rank], op=hvd.Sum, process_set=b).numpy(), part)
        got = hvd.grouped_reducescatter([x[rank], x[rank]], op=hvd.Average, process_set=b)
        assert_close(rank, "B grouped_reducescatter Average", got[1].numpy(), part / n)
        # objects
        obj = hvd.broadcast_object({"from": rank}, root_rank=root, process_set=b)
        if obj != {"from": root}:
            fail(rank, f"B broadcast_object: {obj}")
        fn = hvd.broadcast_object_fn(root_rank=root, process_set=b)
        if fn([rank]) != [root]:
            fail(rank, "B broadcast_object_fn")
        gathered = hvd.allgather_object(("rank", rank), process_set=b)
        if gathered != [("rank", r) for r in b.ranks]:
            fail(rank, f"B allgather_object: {gathered}")
    if a.included():
        var = tf.Variable(rank_data(rank, (3,), np.float32, seed=7))
        hvd.broadcast_([var], root_rank=2, process_set=a)
        assert_close(rank, "A broadcast_", var.numpy(), rank_data(2, (3,), np.float32, seed=7))
    # Eager default names count per set: the global set's names still agree on every rank.
    assert_close(rank, "global allreduce after set collectives",
                 hvd.allreduce(np.float32([rank]), op=hvd.Sum).numpy(),
                 np.float32([size * (size - 1) / 2]))


def check_errors(rank: int, size: int, a: hvd.ProcessSet, b: hvd.ProcessSet) -> None:
    if not a.included():
        expect_error(rank, "allreduce outside the set",
                     lambda: hvd.allreduce(np.ones(2, np.float32), process_set=a), ValueError,
                     f"rank {rank} is not in process set 1 (ranks [0, 2])")
        # The runtime refuses it too (a graph built elsewhere, the numpy core).
        expect_error(rank, "core allreduce outside the set",
                     lambda: hvd.common.basics.core().allreduce(np.ones(2), "outside",
                                                         process_set_id=a.process_set_id),
                     RuntimeError, f"rank {rank}", "not in process set 1 (ranks [0, 2])")
    if b.included():
        first = b.ranks[0]
        shape = (2,) if rank == first else (3,)
        others = [r for r in b.ranks if r != first]
        expect_error(rank, "members disagreeing on a shape",
                     lambda: hvd.allreduce(np.ones(shape, np.float32), name="b_bad",
                                           process_set=b),
                     tf.errors.FailedPreconditionError,
                     f"shape mismatch: ranks [{first}] [2], ranks {others} [3]")
    # Every rank asks for a different set: the call fails everywhere, naming who asked what.
    mine = [0, 1] if rank < 2 else [0, size - 1]
    expect_error(rank, "add_process_set with different ranks",
                 lambda: hvd.add_process_set(mine), ValueError,
                 "ranks [0, 1] called add_process_set([0, 1])",
                 f"called add_process_set([0, {size - 1}])")
    expect_error(rank, "remove_process_set of different sets",
                 lambda: hvd.remove_process_set(a if rank < 2 else b), ValueError,
                 "ranks [0, 1] called remove_process_set(1)", "called remove_process_set(2)")
    if a.process_set_id != 1 or b.process_set_id != 2:
        fail(rank, f"a failed removal changed the sets: {a}, {b}")
    expect_error(rank, "add_process_set of an existing set",
                 lambda: hvd.add_process_set([2, 0]), ValueError,
                 "process set 1 already has ranks [0, 2]")
    # Nothing hangs after the failures: the global set still works.
    assert_close(rank, "global allreduce after errors",
                 hvd.allreduce(np.float32([1.0]), op=hvd.Sum, name="after_errors").numpy(),
                 np.float32([size]))


def check_tape(rank: int, size: int, ps: hvd.ProcessSet) -> None:
    """Three DistributedGradientTape steps on the set equal numpy on the set's global batch."""
    if not ps.included():
        return
    rng = np.random.RandomState(0)
    x_all = rng.rand(8 * ps.size(), 3).astype(np.float32)
    y_all = x_all @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    x, y = x_all[ps.rank()::ps.size()], y_all[ps.rank()::ps.size()]
    w = tf.Variable(np.full((3, 1), 0.1, np.float32))
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        tape = hvd.DistributedGradientTape(tape, process_set=ps)
        (grad,) = tape.gradient(loss, [w])
        w.assign_sub(0.1 * grad)
    w_np = np.full((3, 1), 0.1, np.float32)
    for _ in range(3):
        w_np = w_np - 0.1 * 2 * x_all.T @ (x_all @ w_np - y_all) / len(x_all)
    assert_close(rank, f"DistributedGradientTape on {ps}", w.numpy(), w_np, rtol=1e-4)


def check_keras_optimizer(rank: int, size: int, ps: hvd.ProcessSet) -> None:
    """Three steps of Model.fit with the Keras DistributedOptimizer on the set equal numpy on
    the set's global batch."""
    if not ps.included():
        return
    import perseus_legacy.keras as hvd_keras
    from perseus_legacy.keras.keras2 import keras

    rng = np.random.RandomState(2)
    x_all = rng.rand(4 * ps.size(), 3).astype(np.float32)
    y_all = x_all @ np.array([[0.5], [1.0], [-1.5]], np.float32)
    x, y = x_all[ps.rank()::ps.size()], y_all[ps.rank()::ps.size()]
    model = keras.Sequential([keras.layers.Dense(
        1, use_bias=False, kernel_initializer=keras.initializers.Constant(0.1),
        input_shape=(3,))])
    model.compile(hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=ps),
                  loss="mse")
    model.fit(x, y, batch_size=len(x), epochs=3, shuffle=False, verbose=0)
    w_np = np.full((3, 1), 0.1, np.float32)
    for _ in range(3):
        w_np = w_np - 0.1 * 2 * x_all.T @ (x_all @ w_np - y_all) / len(x_all)
    assert_close(rank, f"Keras DistributedOptimizer on {ps}", model.get_weights()[0], w_np,
                 rtol=1e-4)


def check_tf1_optimizer(rank: int, size: int, ps: hvd.ProcessSet) -> None:
    """Three TF1 DistributedOptimizer steps on the set equal numpy on the set's global batch."""
    if not ps.included():
        return
    rng = np.random.RandomState(1)
    x_all = rng.rand(6 * ps.size(), 2).astype(np.float32)
    y_all = x_all @ np.array([[3.0], [-1.0]], np.float32)
    x, y = x_all[ps.rank()::ps.size()], y_all[ps.rank()::ps.size()]
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=np.full((2, 1), 0.2, np.float32))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                       process_set=ps)
        train = opt.minimize(loss)
        hook = hvd.BroadcastGlobalVariablesHook(ps.ranks[-1], process_set=ps)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            for _ in range(3):
                sess.run(train)
            w_final = sess.run(w)
    w_np = np.full((2, 1), 0.2, np.float32)
    for _ in range(3):
        w_np = w_np - 0.1 * 2 * x_all.T @ (x_all @ w_np - y_all) / len(x_all)
    assert_close(rank, f"TF1 DistributedOptimizer on {ps}", w_final, w_np, rtol=1e-4)


def check_remove_and_join(rank: int, size: int, b: hvd.ProcessSet) -> None:
    if hvd.remove_process_set(hvd.global_process_set):
        fail(rank, "remove_process_set(global_process_set) returned True")
    if not hvd.remove_process_set(b) or b.process_set_id is not None:
        fail(rank, f"remove_process_set(B) failed: {b}")
    if 2 in hvd.common.process_sets.registered():
        fail(rank, f"set 2 still registered: {hvd.common.process_sets.registered()}")
    expect_error(rank, "a collective on a removed set",
                 lambda: hvd.allreduce(np.ones(1), process_set=b), ValueError, "not registered")
    c = hvd.add_process_set(hvd.ProcessSet(range(1, size)))
    if c.process_set_id != 3:  # failed calls take no id; removed ids are never reused
        fail(rank, f"re-added set got id {c.process_set_id}, expected 3")
    # join() covers the global set only: a collective of C waiting on a joined member fails.
    if rank in (0, 1):
        last = hvd.join()
    else:
        expect_error(rank, "a set collective while a member has joined",
                     lambda: hvd.allreduce(np.ones(2, np.float32), name="c_after_join",
                                           process_set=c),
                     tf.errors.FailedPreconditionError,
                     "ranks [1] of process set 3 (ranks", "have joined")
        last = hvd.join()
    if last not in range(2, size):  # ranks 0 and 1 joined first
        fail(rank, f"join() returned {last}")


def check_stall(rank: int, size: int) -> None:
    """B's collective submitted by two of its members fails after the stall limit, naming the
    member that never submitted it and no rank outside the set."""
    b = hvd.add_process_set(list(range(1, size)))
    if rank in (1, 2):
        expect_error(rank, "a stalled set collective",
                     lambda: hvd.allreduce(np.ones(2, np.float32), name="stalled",
                                           process_set=b),
                     tf.errors.FailedPreconditionError,
                     f"was submitted by ranks [1, 2] but not by ranks {list(range(3, size))}")
    # Every rank: returns once ranks 1 and 2 are past the failure (set changes never stall).
    hvd.add_process_set([0, size - 1])
    assert_close(rank, "global allreduce after the stall",
                 hvd.allreduce(np.float32([1.0]), op=hvd.Sum, name="after_stall").numpy(),
                 np.float32([size]))


def check_last_global_allreduce(rank: int, size: int) -> None:
    """A rank that exits shuts the runtime down for every rank, members of other sets too: the
    last collective is a global one (main() runs this case last, selected or not)."""
    assert_close(rank, "last global allreduce",
                 hvd.allreduce(np.float32([1.0]), op=hvd.Sum, name="last").numpy(),
                 np.float32([size]))


# The cases, in the order they run. "stall" runs alone (no set registered at init); the others
# share A and B, and the last is a global collective.
CASES = ("queries", "concurrent_step", "tape", "collectives", "errors", "tf1_optimizer",
         "keras_optimizer", "remove_and_join", "stall", "last_global_allreduce")


def named_cases(rank: int, size: int, a: hvd.ProcessSet, b: hvd.ProcessSet) -> dict:
    """The cases that run with A and B registered, by name."""
    return {
        "queries": lambda: check_queries(rank, size, a, b),
        "concurrent_step": lambda: check_concurrent_step(rank, size, a, b),
        "tape": lambda: check_tape(rank, size, b),
        "collectives": lambda: check_collectives(rank, size, a, b),
        "errors": lambda: check_errors(rank, size, a, b),
        "tf1_optimizer": lambda: check_tf1_optimizer(rank, size, a),
        "keras_optimizer": lambda: check_keras_optimizer(rank, size, b),
        "remove_and_join": lambda: check_remove_and_join(rank, size, b),
        "last_global_allreduce": lambda: check_last_global_allreduce(rank, size),
    }


def main() -> None:
    names = wanted_cases(CASES, sys.argv[1:], [name for name in CASES if name != "stall"])
    if names == ["stall"]:
        hvd.init()
        failed = run_cases(hvd.rank(), {"stall": lambda: check_stall(hvd.rank(), hvd.size())})
        sys.exit(1 if failed else 0)
    if "stall" in names:
        fail(launcher_rank(), "the stall case runs in a launch of its own")
    a = hvd.ProcessSet([2, 0])
    hvd.init(process_sets=[a])
    rank, size = hvd.rank(), hvd.size()
    b = hvd.add_process_set(list(range(1, size)) if size == 4 else [1, 2])
    if "last_global_allreduce" not in names:
        names.append("last_global_allreduce")
    failed = run_cases(rank, named_cases(rank, size, a, b), names)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

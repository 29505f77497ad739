"""The helpers of the scripts that run on every rank (tests/workers/*.py): checks that name the
rank, expected errors, seeded data and the reductions numpy expects of it, a barrier, agreement
across ranks, the files a rank wrote, the linear Estimator of the fault and restart workers and
its numpy trajectory.

The launching side's helpers are in tests/harness.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np


class CheckFailed(SystemExit):
    """What fail() raises: the worker exits 1, or run_cases() reports the case and goes on."""

    def __init__(self, message: str):
        super().__init__(1)
        self.message = message


def fail(rank: int, message: str) -> None:
    print(f"[rank {rank}] FAILED: {message}", file=sys.stderr, flush=True)
    raise CheckFailed(message)


def run_cases(rank: int, cases: dict[str, Callable[[], None]],
              names: Sequence[str] | None = None) -> list[str]:
    """Runs the cases `names` (every case if None) in order, printing `[rank R] CASE name: OK`
    or `... FAILED: why` for each (tests/harness.py's CaseLaunch reads them); a failed case does
    not stop the next. Returns the names of those that failed (exit non-zero if any did)."""
    names = list(cases) if names is None else list(names)
    unknown = sorted(set(names) - set(cases))
    if unknown:
        fail(rank, f"unknown cases {unknown}; known: {sorted(cases)}")
    failed = []
    for name in names:
        try:
            cases[name]()
            verdict = "OK"
        except CheckFailed as exc:
            verdict = f"FAILED: {exc.message}"
        except Exception as exc:  # an unexpected error fails this case only
            traceback.print_exc()
            verdict = f"FAILED: {type(exc).__name__}: {exc}"
        if verdict != "OK":
            failed.append(name)
        print(f"[rank {rank}] CASE {name}: {verdict}", flush=True)
    return failed


def launcher_rank() -> int:
    """This process's rank as its launcher set it (mpirun or perseusrun --tcp), for what runs
    before init(); 0 when no launcher set one."""
    return int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PERSEUS_TCP_RANK", "0")))


def wanted_cases(cases: Sequence[str], wanted: Sequence[str],
                 default: Sequence[str] | None = None) -> list[str]:
    """Of a worker's `cases`, those `wanted` (its argv; if none, `default`, else all) in the
    order of `cases`; fails naming the unknown ones."""
    wanted = list(wanted) or list(cases if default is None else default)
    unknown = sorted(set(wanted) - set(cases))
    if unknown:
        fail(launcher_rank(), f"unknown cases {unknown}; known: {list(cases)}")
    return [name for name in cases if name in wanted]


# The reduce ops' numbers (those of _core and perseus_legacy), the numeric dtypes, and what a
# reduction over ranks gives, by numpy from every rank's data.
AVERAGE, SUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4
OPS = {"average": AVERAGE, "sum": SUM, "min": MIN, "max": MAX, "product": PRODUCT}
NUMERIC = ["float16", ml_dtypes.bfloat16, "float32", "float64", "int32", "int64", "uint8", "int8",
           "int16", "uint16"]


def tolerance(dtype) -> dict:
    name = np.dtype(dtype).name
    return {"float16": {"rtol": 1e-2}, "bfloat16": {"rtol": 4e-2}}.get(name, {"rtol": 1e-6})


def expected_reduce(arrays: list, op: int, dtype, prescale: float = 1.0,
                    postscale: float = 1.0) -> np.ndarray:
    dtype = np.dtype(dtype)
    integer = dtype.kind in "iu"
    wide = [a.astype(np.int64 if integer else np.float64) for a in arrays]
    if prescale != 1.0:
        wide = [w * prescale for w in wide]
    stacked = np.stack(wide)
    if op in (AVERAGE, SUM):
        result = stacked.sum(axis=0)
    elif op == MIN:
        result = stacked.min(axis=0)
    elif op == MAX:
        result = stacked.max(axis=0)
    else:
        result = np.prod(stacked, axis=0)
    if op == AVERAGE:
        # Integer averages truncate toward zero after the sum (documented in reduce.h).
        result = np.trunc(result / len(arrays)) if integer else result / len(arrays)
    return (result * postscale).astype(dtype)


def assert_close(rank: int, what: str, got, expected, rtol: float = 1e-6, atol: float = 0.0):
    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        fail(rank, f"{what}: shape {got.shape}, expected {expected.shape}")
    if got.dtype != expected.dtype:
        fail(rank, f"{what}: dtype {got.dtype}, expected {expected.dtype}")
    g = got.astype(np.float64) if got.dtype != bool else got
    e = expected.astype(np.float64) if expected.dtype != bool else expected
    if not np.allclose(g, e, rtol=rtol, atol=atol):
        bad = np.argwhere(~np.isclose(g, e, rtol=rtol, atol=atol))[:5]
        fail(rank, f"{what}: mismatch at {bad.tolist()}: got {g[tuple(bad[0])]}, "
                   f"expected {e[tuple(bad[0])]}")


def rank_data(rank: int, shape, dtype, seed: int = 0) -> np.ndarray:
    """Deterministic per-rank data any rank can regenerate (for numpy expectations)."""
    rng = np.random.default_rng(1000 * seed + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(1, 5, size=shape).astype(dtype)  # small: products stay in range
    return rng.uniform(0.5, 1.5, size=shape).astype(dtype)


def expect_error(rank: int, what: str, call: Callable, error: type, *fragments: str) -> str:
    """Fails unless `call()` raises `error` saying every fragment; returns the message."""
    try:
        call()
    except error as exc:
        text = str(exc)
        for fragment in fragments:
            if fragment not in text:
                fail(rank, f"{what}: the {error.__name__} does not say {fragment!r}: {text}")
        print(f"[rank {rank}] {what}: got the expected error: {text}", flush=True)
        return text
    fail(rank, f"{what}: no {error.__name__} raised")
    return ""


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Polls `condition` (a file another process writes, ...) until it holds or `seconds` have
    passed; whether it held."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def barrier(name: str) -> None:
    """Returns once every rank has called barrier(name) (eager: a collective of its own name)."""
    import perseus_legacy

    perseus_legacy.allreduce(np.zeros(1, np.float32), name=f"barrier.{name}")


def agree(rank: int, what: str, value) -> None:
    """Fails unless every rank holds exactly rank 0's values of `value` (an array, or a list of
    arrays: flattened and joined)."""
    import perseus_legacy

    values = value if isinstance(value, (list, tuple)) else [value]
    mine = np.concatenate([np.ravel(np.asarray(v)) for v in values])
    everyone = np.asarray(perseus_legacy.allgather(mine[None, :], name=f"agree.{what}"))
    for r, theirs in enumerate(everyone):
        if not np.array_equal(theirs, everyone[0]):
            gap = np.abs(theirs.astype(np.float64) - everyone[0].astype(np.float64)).max()
            fail(rank, f"{what}: rank {r} differs from rank 0 by {gap}")


def write_resumed(out: str, rank: int, record: dict, values: dict, note: str = "") -> None:
    """A rerun's results, as harness.assert_resumed reads them: OUT/rank<R>.json (`record`: the
    global steps its session started and ended at) and OUT/rank<R>.npz (`values`: its final
    variables); prints where it resumed, then `note`."""
    np.savez(os.path.join(out, f"rank{rank}.npz"), **values)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    print(f"[rank {rank}] resumed at step {record['start_step']}, ended at "
          f"{record['end_step']}{note}", flush=True)


# ---- the linear Estimator of the fault and restart workers ---------------------------------------

def linear_momentum_spec(mode, x, labels, init: dict, learning_rate: float, momentum: float,
                         scaffold=None):
    """The EstimatorSpec of `x @ w + b` (w and b start at init["w"], init["b"]): its mean
    squared error minimized by Momentum, the global step counted."""
    import tensorflow as tf

    w = tf.compat.v1.get_variable("w", initializer=tf.constant(init["w"]))
    b = tf.compat.v1.get_variable("b", initializer=tf.constant(init["b"]))
    loss = tf.compat.v1.losses.mean_squared_error(labels, tf.matmul(x, w) + b)
    train_op = tf.compat.v1.train.MomentumOptimizer(learning_rate, momentum).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op, scaffold=scaffold)


def one_thread_estimator(model_fn, model_dir: str, checkpoint_every: int):
    """An unchanged tf.estimator.Estimator of `model_fn` with perseus_legacy.run_config(): a
    checkpoint every `checkpoint_every` steps, no summaries or step-rate logs, one thread."""
    import tensorflow as tf  # the workers imported perseus_legacy first (tf.estimator on 2.16+)

    import perseus_legacy as pl

    config = pl.run_config(
        model_dir=model_dir, save_checkpoints_steps=checkpoint_every, save_summary_steps=0,
        log_step_count_steps=None,
        session_config=tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                inter_op_parallelism_threads=1))
    return tf.estimator.Estimator(model_fn, config=config)


def momentum_trajectory(batches: list, init: dict, learning_rate: float,
                        momentum: float) -> list[dict]:
    """linear_momentum_spec()'s variables after each step 0..len(batches) of one process, in
    float64 numpy: step s trains on batches[s] = (x, y), its whole global batch."""
    w, b = init["w"].astype(np.float64), init["b"].astype(np.float64)
    w_slot, b_slot = np.zeros_like(w), np.zeros_like(b)
    states = []
    for step in range(len(batches) + 1):
        states.append({"w": w, "b": b, "w/Momentum": w_slot, "b/Momentum": b_slot,
                       "global_step": np.int64(step)})
        if step == len(batches):
            break
        x, y = (a.astype(np.float64) for a in batches[step])
        error = x @ w + b - y
        w_grad = 2 * x.T @ error / len(error)
        b_grad = 2 * error.sum(axis=0) / len(error)
        w_slot, b_slot = momentum * w_slot + w_grad, momentum * b_slot + b_grad
        w, b = w - learning_rate * w_slot, b - learning_rate * b_slot
    return states


def files_under(path: str) -> list:
    """Every file below `path`, relative to it, sorted (none when `path` does not exist)."""
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, names in os.walk(path) for f in names)


def load_core():
    """perseus_legacy._core alone, without importing the package (and so TensorFlow): for
    workers that test the native core in a fraction of a second."""
    import glob
    import importlib.util

    package = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "perseus_legacy")
    [path] = glob.glob(os.path.join(package, "_core*.so"))
    spec = importlib.util.spec_from_file_location("perseus_legacy._core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def init_core(core) -> int:
    """init() of `core` (load_core()) as perseus_legacy.init() would under perseusrun: over TCP
    from the PERSEUS_TCP_* variables `perseusrun --tcp` sets (the local and cross ranks by the
    addresses' hosts, rank order within each), else over MPI; returns the rank."""
    timeout = float(os.environ.get("PERSEUS_START_TIMEOUT", "120"))
    if "PERSEUS_TCP_RANK" not in os.environ:
        core.init_mpi(0, timeout)
        return core.rank()
    rank = int(os.environ["PERSEUS_TCP_RANK"])
    addresses = os.environ["PERSEUS_TCP_ADDRESSES"].split(",")
    host_of = [address.rsplit(":", 1)[0] for address in addresses]
    mine = [r for r in range(len(addresses)) if host_of[r] == host_of[rank]]
    local_rank = mine.index(rank)
    # One rank of each host has this local rank: the hosts' ranks with as many before them.
    same_local = [r for r in range(len(addresses))
                  if host_of[:r].count(host_of[r]) == local_rank]
    core.init_tcp(rank, addresses, local_rank, len(mine), same_local.index(rank),
                  len(same_local), os.environ["PERSEUS_SECRET"], timeout)
    return rank

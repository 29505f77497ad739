"""An unchanged Estimator with run_config() under `perseusrun --restarts` (tests/test_restarts.py).

Usage: restart_estimator.py MODEL_DIR OUT_DIR [KILLED_RANKS]

Run on FIRST_SIZE ranks, each rank of KILLED_RANKS (comma-separated, default 0: e.g. "0,1",
the two ranks of one host) kills itself (SIGKILL) once global step
FAULT_STEP is done, a step that is no checkpoint step (rank 0 checkpoints every EVERY steps),
unless OUT_DIR/killed says it did already. The survivors fail at their next step; the lowest of
them saves step FAULT_STEP into MODEL_DIR (perseus_legacy.tf1.survivor) and every survivor exits
with the error, unhandled, as any program would. perseusrun then starts it again on the other
ranks' hosts: it kills nothing, resumes from that checkpoint and trains to TOTAL_STEPS, and each
rank writes OUT_DIR/rank<R>.json (the global step its session started and ended at) and
OUT_DIR/rank<R>.npz (its final variables).

A rank's batch is PER_RANK rows of the step's pool of rows, chosen by the global step: on n
ranks a step's global batch is the pool's first n * PER_RANK rows (reference(): the same
sequence of global batches in numpy).
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import os
import signal
import sys

import numpy as np
import tensorflow as tf
from worker_util import (linear_momentum_spec, momentum_trajectory, one_thread_estimator,
                         write_resumed)

FIRST_SIZE, EVERY, TOTAL_STEPS, FAULT_STEP = 4, 4, 9, 5
PER_RANK, FEATURES = 2, 3
LEARNING_RATE, MOMENTUM = 0.05, 0.9


def pools() -> tuple:
    """(x, y): x[s] holds the FIRST_SIZE * PER_RANK rows step s draws its batches from."""
    rng = np.random.RandomState(11)
    x = rng.normal(size=(TOTAL_STEPS, FIRST_SIZE * PER_RANK, FEATURES)).astype(np.float32)
    true_w = np.array([[1.5], [-2.0], [0.5]], np.float32)
    y = (x @ true_w + 0.1 * rng.normal(size=(TOTAL_STEPS, FIRST_SIZE * PER_RANK, 1)))
    return x, y.astype(np.float32)


def initial_values(rank: int) -> dict:
    """Every rank starts elsewhere: only rank 0's restore and broadcast make them agree."""
    rng = np.random.RandomState(rank + 50)
    return {"w": rng.normal(size=(FEATURES, 1)).astype(np.float32),
            "b": rng.normal(size=(1,)).astype(np.float32)}


def reference(sizes: list) -> list:
    """The variables after each step 0..TOTAL_STEPS when step s runs on sizes[s] ranks:
    Momentum on the mean squared error of that step's global batch, in float64, from the first
    run's rank 0 values."""
    x, y = pools()
    rows = [slice(0, sizes[step] * PER_RANK) for step in range(TOTAL_STEPS)]
    return momentum_trajectory([(x[step, r], y[step, r]) for step, r in enumerate(rows)],
                               initial_values(0), LEARNING_RATE, MOMENTUM)


def input_fn(rank: int):
    x, y = pools()
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def fn():
        step = tf.compat.v1.train.get_global_step()
        return {"x": tf.gather(x[:, rows], step)}, tf.gather(y[:, rows], step)

    return fn


def model_fn(features, labels, mode):
    return linear_momentum_spec(mode, features["x"], labels, initial_values(pl.rank()),
                                LEARNING_RATE, MOMENTUM)


def check_updates_wait_for_whole_step(graph) -> None:
    """Every update op (run_config()'s SyncReplicasHook rewrote them before this hook's begin)
    depends on every gradient collective of the graph: none runs in a step some failed."""
    collectives = {op for op in graph.get_operations() if op.type == "PerseusAllreduce"
                   and op.name.startswith("PerseusSync/")}
    for update in (op for op in graph.get_operations() if op.type.startswith("ResourceApply")):
        seen, todo = set(), [update]
        while todo:
            op = todo.pop()
            for parent in [t.op for t in op.inputs] + list(op.control_inputs):
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        missing = sorted(c.name for c in collectives - seen)
        if len(collectives) < 2 or missing:
            sys.exit(f"[rank {pl.rank()}] FAILED: {update.name} does not wait for {missing} "
                     f"(of {len(collectives)} gradient collectives)")
    print(f"[rank {pl.rank()}] every update waits for the {len(collectives)} gradient "
          "collectives of its step", flush=True)


class Progress(tf.compat.v1.train.SessionRunHook):
    """The steps this session started and ended at, its final variables; the fault."""

    def __init__(self, killed_ranks: list, out: str) -> None:
        self._marker = os.path.join(out, "killed")  # the restart (as many ranks) kills nothing
        self._kill = (pl.size() == FIRST_SIZE and pl.rank() in killed_ranks
                      and not os.path.exists(self._marker))
        self.record: dict = {}
        self.values: dict = {}

    def begin(self) -> None:
        self._step = tf.compat.v1.train.get_global_step()
        self._variables = tf.compat.v1.global_variables()
        check_updates_wait_for_whole_step(tf.compat.v1.get_default_graph())

    def after_create_session(self, session, coord) -> None:
        self.record["start_step"] = int(session.run(self._step))

    def after_run(self, run_context, run_values) -> None:
        if self._kill and run_context.session.run(self._step) == FAULT_STEP:
            print(f"[rank {pl.rank()}] KILLED after step {FAULT_STEP}", flush=True)
            open(self._marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def end(self, session) -> None:
        values = session.run(self._variables)
        self.values = {v.op.name: value for v, value in zip(self._variables, values)}
        self.record["end_step"] = int(self.values["global_step"])


def main() -> None:
    model_dir, out = sys.argv[1:3]
    killed_ranks = [int(r) for r in (sys.argv[3] if len(sys.argv) > 3 else "0").split(",")]
    estimator = one_thread_estimator(model_fn, model_dir, EVERY)
    progress = Progress(killed_ranks, out)
    estimator.train(input_fn(pl.rank()), max_steps=TOTAL_STEPS, hooks=[progress])
    write_resumed(out, pl.rank(), progress.record, progress.values, f" on {pl.size()} ranks")


if __name__ == "__main__":
    main()

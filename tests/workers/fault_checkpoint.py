"""An Estimator with rank-0-only checkpoints hit by a fault mid-training, and the rerun that
resumes from rank 0's last whole checkpoint (tests/test_faults.py).

Usage: fault_checkpoint.py MODEL_DIR OUT_DIR PHASE    (every rank: perseusrun or a TF_CONFIG task)

PHASE:
  cut          once global step FAULT_STEP is done, rank 1 takes its host's link down
               (`ip link set eth0 down`, emulated hosts only)
  kill         once global step FAULT_STEP is done, rank 1 kills itself (SIGKILL)
  kill_saving  rank 0 kills itself (SIGKILL) while it writes the checkpoint of step
               SAVE_FAULT_STEP: its shard files are written into `model.ckpt-N_temp/`, not yet
               merged into `model.ckpt-N.*` nor named in the `checkpoint` file
  disk_full    MODEL_DIR is a small file system of its own (the test mounts a tmpfs): once
               global step SAVE_FAULT_STEP - 1 is done, rank 0 fills it, so that the save of
               step SAVE_FAULT_STEP fails with "No space left on device"
  resume       no fault: trains to TOTAL_STEPS from whatever rank 0's MODEL_DIR holds

The model is linear (MSE loss, Momentum, whose slots are checkpointed too), rank 0 checkpoints
every EVERY steps. The batch of a step is chosen by the global step, so the faulted run and its
rerun together read exactly the batches of one uninterrupted run (global_batches()).

In a faulted phase, every rank that sees the fault prints `[rank R] FAULT_SEEN after S s:
<error>` (S: seconds since its last completed step) and exits 1. In `resume`, every rank writes
OUT_DIR/rank<R>.json (the global step its session started at and ended at) and
OUT_DIR/rank<R>.npz (its final variables).
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.training.saver import BulkSaverBuilder
from worker_util import linear_momentum_spec, one_thread_estimator, write_resumed

EVERY, TOTAL_STEPS = 3, 12
FAULT_STEP = 7  # not a checkpoint step: the last checkpoint before the fault is step 6
SAVE_FAULT_STEP = 6  # rank 0 dies writing it: the last whole checkpoint is step 3
GLOBAL_BATCH, FEATURES = 8, 3
LEARNING_RATE, MOMENTUM = 0.05, 0.9
PHASES = ("cut", "kill", "kill_saving", "disk_full", "resume")


def global_batches() -> tuple:
    """(x, y) of every step: x[s] and y[s] are global batch s ([GLOBAL_BATCH, ...])."""
    rng = np.random.RandomState(5)
    x = rng.normal(size=(TOTAL_STEPS, GLOBAL_BATCH, FEATURES)).astype(np.float32)
    true_w = np.array([[1.5], [-2.0], [0.5]], np.float32)
    y = (x @ true_w + 0.1 * rng.normal(size=(TOTAL_STEPS, GLOBAL_BATCH, 1))).astype(np.float32)
    return x, y


def initial_values(rank: int, phase: str) -> dict:
    """Each rank, and each run, starts elsewhere: only rank 0's restore and broadcast make them
    agree. The first run's rank 0 values are where the uninterrupted reference starts."""
    rng = np.random.RandomState(rank + (100 if phase == "resume" else 0))
    return {"w": rng.normal(size=(FEATURES, 1)).astype(np.float32),
            "b": rng.normal(size=(1,)).astype(np.float32)}


def input_fn(rank: int, size: int):
    """This rank's rows of the global batch that the global step picks."""
    x, y = global_batches()
    local = GLOBAL_BATCH // size
    rows = slice(rank * local, (rank + 1) * local)

    def fn():
        # The Estimator creates the global step before it calls input_fn.
        step = tf.compat.v1.train.get_global_step()
        return {"x": tf.gather(x[:, rows], step)}, tf.gather(y[:, rows], step)

    return fn


class _DieAfterShardsWritten(BulkSaverBuilder):
    """Builds the usual sharded save, plus a step after the shard files are written and before
    they are merged: in the save of `step`, this process kills itself there."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self._temp_dir = re.compile(rf"model\.ckpt-{step}_temp\b")

    def save_op(self, filename_tensor, saveables):
        save = super().save_op(filename_tensor, saveables)
        with tf.control_dependencies([save]):
            return tf.numpy_function(self._after_shard, [filename_tensor], tf.int64,
                                     stateful=True)

    def _after_shard(self, filename: bytes) -> np.int64:
        shard = filename.decode()
        if self._temp_dir.search(shard):
            written = sorted(os.listdir(os.path.dirname(shard)))
            print(f"[rank 0] KILLED while saving: shards written {written}, not merged",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return np.int64(0)


def make_model_fn(phase: str):
    def model_fn(features, labels, mode):
        rank = pl.rank()  # run_config() has initialized perseus_legacy by now
        init = initial_values(rank, phase)
        scaffold = None
        if phase == "kill_saving" and rank == 0:
            # The Estimator's own saver, but for the builder (sharded, relative paths, 5 kept).
            scaffold = tf.compat.v1.train.Scaffold(saver=tf.compat.v1.train.Saver(
                sharded=True, max_to_keep=5, save_relative_paths=True, defer_build=True,
                builder=_DieAfterShardsWritten(SAVE_FAULT_STEP)))
        return linear_momentum_spec(mode, features["x"], labels, init, LEARNING_RATE, MOMENTUM,
                                    scaffold)

    return model_fn


def fill_disk(model_dir: str) -> None:
    """Writes into MODEL_DIR's file system until it has no space left."""
    written = 0
    with open(os.path.join(model_dir, "filler"), "wb", buffering=0) as filler:  # nothing held
        try:
            while True:
                written += filler.write(b"\0" * 4096)
        except OSError as exc:
            print(f"[rank 0] FAULT disk full after {written} bytes: {exc}", flush=True)


def fault(phase: str) -> None:
    print(f"[rank 1] FAULT {phase} after step {FAULT_STEP}", flush=True)
    if phase == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    subprocess.run(["ip", "link", "set", "eth0", "down"], check=True, timeout=30)


def collective_error(exc: Exception) -> str:
    """perseus_legacy's part of an error, on one line (TensorFlow adds the op's traceback)."""
    text = " ".join(str(exc).split())
    found = re.search(r"perseus_legacy: .*?(?= \[\[|$)", text)
    return found.group(0) if found else text


class Progress(tf.compat.v1.train.SessionRunHook):
    """When the last step ended, the steps this session started and ended at, its final
    variables; rank 1 brings about the `cut` and `kill` faults."""

    def __init__(self, rank: int, phase: str, model_dir: str = "") -> None:
        self._fault = phase if rank == 1 and phase in ("cut", "kill") else None
        self._fill = model_dir if rank == 0 and phase == "disk_full" else None
        self.last_step_end = time.monotonic()
        self.record: dict = {}
        self.values: dict = {}

    def begin(self) -> None:
        self._step = tf.compat.v1.train.get_global_step()
        self._variables = tf.compat.v1.global_variables()

    def after_create_session(self, session, coord) -> None:
        # run_config() puts its SyncReplicasHook first: rank 0's variables are restored and
        # broadcast by now.
        self.record["start_step"] = int(session.run(self._step))

    def after_run(self, run_context, run_values) -> None:
        self.last_step_end = time.monotonic()
        if self._fault and run_context.session.run(self._step) == FAULT_STEP:
            fault(self._fault)
        if self._fill and run_context.session.run(self._step) == SAVE_FAULT_STEP - 1:
            fill_disk(self._fill)

    def end(self, session) -> None:
        values = session.run(self._variables)
        self.values = {v.op.name: value for v, value in zip(self._variables, values)}
        self.record["end_step"] = int(self.values["global_step"])


def make_estimator(model_dir: str, phase: str) -> tf.estimator.Estimator:
    """This rank's Estimator: run_config(), a checkpoint every EVERY steps, one thread."""
    return one_thread_estimator(make_model_fn(phase), model_dir, EVERY)


def main() -> None:
    model_dir, out, phase = sys.argv[1:4]
    if phase not in PHASES:
        sys.exit(f"unknown phase {phase!r}; expected one of {PHASES}")
    estimator = make_estimator(model_dir, phase)
    rank, size = pl.rank(), pl.size()
    progress = Progress(rank, phase, model_dir)
    try:
        estimator.train(input_fn(rank, size), max_steps=TOTAL_STEPS, hooks=[progress])
    except (tf.errors.OpError, RuntimeError) as exc:  # a collective's error (a peer is lost),
        # or rank 0's own save with its disk full
        print(f"[rank {rank}] FAULT_SEEN after {time.monotonic() - progress.last_step_end:.1f} "
              f"s: {collective_error(exc)}", flush=True)
        sys.exit(1)
    if phase != "resume":
        print(f"[rank {rank}] UNEXPECTED: trained to step {TOTAL_STEPS} through the {phase} "
              "fault", flush=True)
        sys.exit(2)
    write_resumed(out, rank, progress.record, progress.values)


if __name__ == "__main__":
    main()

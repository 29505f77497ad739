"""Estimator training throughput: a plain RunConfig vs perseus_legacy.run_config() on 1 and 2 ranks.

    python benchmarks/estimator.py [--steps 60] [--repeats 3]

Launches every configuration itself with `perseusrun` (one intra-op thread per rank, so each
rank has one core's worth of compute on a 2-core host; ranks are not pinned, perseusrun's
default, so a rank's TensorFlow and perseus_legacy threads are not confined to one core) and
prints a markdown table: global examples/s,
time per step, and the scaling efficiency against the baseline measured in the same run, one
process with a plain tf.estimator.RunConfig (examples/s over ranks times the baseline's,
per-rank batch fixed). The model is bench_common/cnn.py's small CNN (as in
benchmarks/training.py) in a custom model_fn (plain Momentum optimizer); steps are timed by a
hook on rank 0 after a warm-up, with checkpoints and summaries off. The configurations take
turns within every repeat, and the median repeat is reported, so load from elsewhere on the host
hits them alike.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import argparse
import json
import shutil
import tempfile
import time

import numpy as np
import tensorflow as tf

from bench_common.cnn import BATCH, CLASSES, IMAGE, barrier, cnn, median_runs, share

WARMUP = 5
CONFIGS = (("plain", 1), ("run_config", 1), ("run_config", 2), ("lockstep", 2))
NAMES = {"plain": "plain RunConfig (baseline)", "run_config": "pl.run_config()",
         "lockstep": "lockstep, no gradients (plain RunConfig, a barrier after each step)"}


def model_fn(features, labels, mode):
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=cnn(features)))
    opt = tf.compat.v1.train.MomentumOptimizer(0.01, momentum=0.9)
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


class Timer(tf.compat.v1.train.SessionRunHook):
    """Seconds from the end of step WARMUP to the end of the last step."""

    def __init__(self) -> None:
        self.done, self.started, self.ended = 0, None, None

    def after_run(self, run_context, run_values) -> None:
        self.done += 1
        if self.done == WARMUP:
            self.started = time.perf_counter()
        self.ended = time.perf_counter()


class Lockstep(tf.compat.v1.train.SessionRunHook):
    """Makes the ranks wait for each other after every step, exchanging nothing else."""

    def after_run(self, run_context, run_values) -> None:
        barrier("lockstep")


def worker(kind: str, steps: int) -> None:
    """One rank: trains WARMUP + `steps` steps; rank 0 prints a RESULT line."""
    rank = 0
    model_dir = tempfile.mkdtemp(prefix="bench_estimator_")
    kwargs = {"model_dir": model_dir, "tf_random_seed": 1,
              "save_checkpoints_steps": None, "save_checkpoints_secs": None,
              "save_summary_steps": 0, "log_step_count_steps": None,
              "session_config": tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                         inter_op_parallelism_threads=2)}
    timer = Timer()
    hooks = [timer]
    if kind == "run_config":
        config = pl.run_config(**kwargs)
        rank = pl.rank()
    elif kind == "lockstep":
        pl.init()
        config, rank = tf.estimator.RunConfig(**kwargs), pl.rank()
        hooks.append(Lockstep())
    else:
        config = tf.estimator.RunConfig(**kwargs)
    rng = np.random.default_rng(rank)
    images = rng.uniform(size=(BATCH, IMAGE, IMAGE, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=BATCH).astype(np.int64)
    tf.estimator.Estimator(model_fn, config=config).train(
        lambda: tf.data.Dataset.from_tensors((images, labels)).repeat(),
        max_steps=WARMUP + steps, hooks=hooks)
    shutil.rmtree(model_dir, ignore_errors=True)
    if rank == 0:
        ranks = pl.size() if kind != "plain" else 1
        print("RESULT " + json.dumps({"seconds": timer.ended - timer.started,
                                      "steps": timer.done - WARMUP, "ranks": ranks}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(NAMES), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    best = median_runs(list(CONFIGS), args.steps, args.repeats, __file__, bind_to="none")
    baseline = best[("plain", 1)]["examples_per_s"]
    print(f"\nEstimator, small CNN, batch {BATCH} per rank, {args.steps} timed steps, median of "
          f"{args.repeats} runs, 1 intra-op thread per rank\n")
    print("| config | ranks | examples/s | ms/step | scaling efficiency |")
    print("|---|---:|---:|---:|---:|")
    for kind, ranks in CONFIGS:
        r = best[(kind, ranks)]
        efficiency = r["examples_per_s"] / (ranks * baseline)
        print(f"| {NAMES[kind]} | {ranks} | {r['examples_per_s']:.0f} | {r['step_ms']:.1f} | "
              f"{100 * efficiency:.1f}% |")
    ours, lockstep = best[("run_config", 2)], best[("lockstep", 2)]
    print(f"\nAt 2 ranks, pl.run_config() runs at {share(ours, lockstep)} of two ranks that "
          "only wait for each other after every step (what synchronous training can reach on "
          "this host).")


if __name__ == "__main__":
    main()

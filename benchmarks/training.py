"""Training throughput of a small CNN: 1 rank vs 2 ranks, hooks only vs DistributedOptimizer.

    python benchmarks/training.py [--steps 40] [--repeats 3]

Launches every configuration itself with `perseusrun` (one intra-op thread per rank, so each
rank has one core of its own on a 2-core host) and prints a markdown table: global examples/s,
time per step, and the scaling efficiency (2-rank examples/s over twice the 1-rank examples/s,
per-rank batch fixed). All paths run a MonitoredTrainingSession with a plain Momentum
optimizer; "hooks only" adds SyncReplicasHook and nothing else, "DistributedOptimizer" wraps the
optimizer and adds BroadcastGlobalVariablesHook, and "no communication" runs the same ranks with
neither (each rank trains its own model: the ceiling that the host's shared cores, caches and
memory bandwidth leave to two ranks). "lockstep" is "no communication" plus a one-float
allreduce after every step: the ranks exchange no gradients but wait for each other, so each
step takes as long as the slower rank's. That is the ceiling of any synchronous training on the
host; a host whose cores run at uneven speeds shows it as the gap between "lockstep" and "no
communication". With one rank all are plain TensorFlow. The
configurations take turns within every repeat, and the median repeat is reported, so load from
elsewhere on the host hits them alike.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import argparse
import json
import time

import numpy as np
import tensorflow as tf
from bench_common.cnn import BATCH, CLASSES, IMAGE, barrier, cnn, median_runs, share

PATHS = {"hooks": "hooks only (SyncReplicasHook)",
         "optimizer": "DistributedOptimizer + broadcast hook",
         "lockstep": "lockstep, no gradients (alone + a barrier after each step)",
         "alone": "no communication (each rank trains alone)"}


def worker(path: str, steps: int) -> None:
    """One rank: trains `steps` timed steps after a warm-up; rank 0 prints a RESULT line."""
    pl.init()
    rng = np.random.default_rng(pl.rank())
    images = rng.uniform(size=(BATCH, IMAGE, IMAGE, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=BATCH).astype(np.int64)
    with tf.Graph().as_default():
        x, y = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensors((images, labels)).repeat()).get_next()
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=cnn(x)))
        opt = tf.compat.v1.train.MomentumOptimizer(0.01, momentum=0.9)
        if path == "optimizer":
            opt, hooks = pl.DistributedOptimizer(opt), [pl.BroadcastGlobalVariablesHook(0)]
        elif path == "hooks":
            hooks = [pl.SyncReplicasHook()]
        else:
            hooks = []
        train = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                          inter_op_parallelism_threads=2)
        with tf.compat.v1.train.MonitoredTrainingSession(
                hooks=hooks, config=config, save_checkpoint_secs=None,
                save_summaries_steps=None, log_step_count_steps=None) as sess:
            for _ in range(5):
                sess.run(train)
            barrier("bench_start")
            start = time.perf_counter()
            for _ in range(steps):
                sess.run(train)
                if path == "lockstep":
                    barrier("lockstep")
            barrier("bench_end")
            seconds = time.perf_counter() - start
    if pl.rank() == 0:
        print("RESULT " + json.dumps({"seconds": seconds, "steps": steps, "ranks": pl.size()}),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(PATHS), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    configs = [(path, ranks) for path in PATHS for ranks in (1, 2)]
    best = median_runs(configs, args.steps, args.repeats, __file__)
    print(f"\nSmall CNN, batch {BATCH} per rank, {args.steps} steps, median of "
          f"{args.repeats} runs, 1 intra-op thread per rank\n")
    print("| path | ranks | examples/s | ms/step | scaling efficiency |")
    print("|---|---:|---:|---:|---:|")
    for path, ranks in configs:
        r = best[(path, ranks)]
        efficiency = r["examples_per_s"] / (ranks * best[(path, 1)]["examples_per_s"])
        print(f"| {PATHS[path]} | {ranks} | {r['examples_per_s']:.0f} | {r['step_ms']:.1f} | "
              f"{100 * efficiency:.1f}% |")
    hooks, optimizer = best[("hooks", 2)], best[("optimizer", 2)]
    lockstep, alone = best[("lockstep", 2)], best[("alone", 2)]
    print(f"\nAt 2 ranks, hooks only runs at {share(hooks, optimizer)} of DistributedOptimizer's "
          f"examples/s. Against two ranks that only wait for each other after every step (what "
          f"synchronous training can reach on this host: {share(lockstep, alone)} of two ranks "
          f"that train alone), hooks only reaches {share(hooks, lockstep)} and "
          f"DistributedOptimizer {share(optimizer, lockstep)}.")


if __name__ == "__main__":
    main()

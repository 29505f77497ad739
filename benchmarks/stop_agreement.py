"""What the per-step stop agreement costs: 2 ranks, MonitoredTrainingSession + SyncReplicasHook.

    python benchmarks/stop_agreement.py [--steps 1500] [--repeats 3]

Launches every configuration itself with `perseusrun -np 2` and prints a markdown table of
steps/s and time per step of a tiny linear model (a step of about a millisecond, so that a
per-step cost shows), with the stop agreement (the default) and without it (the baseline: the
hook's agreement never armed, so the session runs as TensorFlow's; everything else equal),
plus, without TensorFlow, the time of one agreement round (`GATE.agree`) against the smallest
allreduce the core does (one float, the same name every time). The configurations take turns
within every repeat and the median repeat is reported, so load from elsewhere on the host hits
them alike.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

import perseus_legacy as pl

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "baseline": "training without the agreement (baseline)",
    "agreement": "training with the stop agreement",
    "rounds": "agreement rounds alone (GATE.agree)",
    "allreduce": "one-float allreduce alone (the floor)",
}


def train(steps: int, agreement: bool) -> float:
    """Seconds per step after a warm-up, on this rank."""
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    pl.init()
    rng = np.random.RandomState(pl.rank())
    x = tf.constant(rng.normal(size=(16, 8)).astype(np.float32))
    y = tf.constant(rng.normal(size=(16, 1)).astype(np.float32))
    w = tf.compat.v1.get_variable("w", [8, 1])
    step = tf.compat.v1.train.get_or_create_global_step()
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss, global_step=step)
    sync = pl.SyncReplicasHook()
    if not agreement:
        sync.stop_agreement.begin = lambda: None  # never active
    hooks = [sync, tf.compat.v1.train.StopAtStepHook(last_step=steps + 100)]
    with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as session:
        for _ in range(100):
            session.run(train_op)
        start = time.perf_counter()
        while not session.should_stop():
            session.run(train_op)
        return (time.perf_counter() - start) / steps


def rounds(steps: int, agreement: bool) -> float:
    from perseus_legacy.common import basics
    from perseus_legacy.tf1.gate import GATE

    pl.init()
    one = np.zeros(1, np.float32)
    for i in range(steps + 100):
        if i == 100:
            start = time.perf_counter()
        if agreement:
            GATE.agree(0)
        else:
            basics.core().allreduce(one, "bench.floor", basics.Sum)
    return (time.perf_counter() - start) / steps


def rank_main(config: str, steps: int) -> None:
    if config in ("baseline", "agreement"):
        seconds = train(steps, config == "agreement")
    else:
        seconds = rounds(steps, config == "rounds")
    if pl.rank() == 0:
        print("RESULT " + json.dumps({"seconds": seconds}), flush=True)


def launch(config: str, steps: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    perseusrun = os.path.join(os.path.dirname(sys.executable), "perseusrun")
    out = subprocess.run([perseusrun, "-np", "2", "--timeout", "600", sys.executable, __file__,
                          "--rank", config, "--steps", str(steps)], env=env, text=True,
                         capture_output=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])["seconds"]
    raise RuntimeError(f"{config} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank, args.steps)
        return
    runs: dict = {c: [] for c in CONFIGS}
    for _ in range(args.repeats):
        for config in CONFIGS:
            runs[config].append(launch(config, args.steps))
    seconds = {c: statistics.median(v) for c, v in runs.items()}
    base = seconds["baseline"]
    print(f"2 ranks (perseusrun, MPI), {args.steps} timed steps, median of {args.repeats}\n")
    print("| configuration | steps/s | µs per step | vs baseline |")
    print("| --- | ---: | ---: | ---: |")
    for config, name in CONFIGS.items():
        s = seconds[config]
        delta = f"{(s - base) * 1e6:+.0f} µs" if config == "agreement" else ""
        print(f"| {name} | {1 / s:.0f} | {s * 1e6:.0f} | {delta} |")


if __name__ == "__main__":
    main()

"""What `run_config()` costs on one rank: the same Estimator with a plain RunConfig and with
`pl.run_config()`, taking turns in one process.

    python benchmarks/one_rank_cost.py [--rounds 3] [--steps 200]
    perseusrun -np 1 python benchmarks/one_rank_cost.py      (the same under mpirun)

The model is benchmarks/bench_common/training_model.py's (24 MiB of dense weights, batch 32, about
10 ms a step on one core). Each round trains a fresh Estimator of each kind for --steps steps;
the first 20 steps of each are not timed. Per kind: the median wall time of a step and the CPU
time (user + system, every thread of the process) per step, and run_config()'s over plain's.
Separate launches, as in benchmarks/cluster_training.py, also measure the machine's load as it
changes between them; here both kinds share the process, its imports and the load of the same
minutes, and the CPU column does not move with the load at all.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import argparse
import os
import statistics
import tempfile
import time

from bench_common import training_model as model
import tensorflow as tf

UNTIMED = 20  # steps: graph building, the session, first allocations
KINDS = ("plain", "run_config")


class StepClock(tf.compat.v1.train.SessionRunHook):
    """Wall seconds of each step after the first UNTIMED, and the process's CPU seconds over
    them."""

    def __init__(self) -> None:
        self.walls: list = []
        self.cpu_start = self.cpu = 0.0
        self._steps = 0

    def before_run(self, run_context) -> None:
        self._t0 = time.perf_counter()

    def after_run(self, run_context, run_values) -> None:
        self._steps += 1
        if self._steps > UNTIMED:
            self.walls.append(time.perf_counter() - self._t0)
        elif self._steps == UNTIMED:
            self.cpu_start = time.process_time()

    def end(self, session) -> None:
        self.cpu = time.process_time() - self.cpu_start


def train(kind: str, steps: int) -> tuple:
    """(median wall s, CPU s) per timed step of one fresh Estimator of `kind`."""
    kwargs = {"model_dir": tempfile.mkdtemp(prefix=f"one_rank_{kind}_"), "tf_random_seed": 1,
              "save_checkpoints_steps": None, "save_checkpoints_secs": None,
              "save_summary_steps": 0, "log_step_count_steps": None}
    threads = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                       inter_op_parallelism_threads=2)
    if kind == "plain":
        config = tf.estimator.RunConfig(session_config=threads, **kwargs)
    else:
        config = pl.run_config(session_config=threads, **kwargs)
    estimator = tf.estimator.Estimator(model.model_fn, config=config, params={})
    clock = StepClock()
    estimator.train(lambda: model.input_fn(32, 0), max_steps=steps + UNTIMED, hooks=[clock])
    return statistics.median(clock.walls), clock.cpu / len(clock.walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per Estimator")
    args = parser.parse_args()
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
    pl.init()
    if pl.size() != 1:
        raise SystemExit(f"one_rank_cost.py measures one rank; this launch has {pl.size()}")
    walls: dict = {kind: [] for kind in KINDS}
    cpus: dict = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            wall, cpu = train(kind, args.steps)
            walls[kind].append(wall)
            cpus[kind].append(cpu)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nOne process, TF {tf.__version__}, {pl._core.build_info()['controller']} controller, "
          f"{args.rounds} rounds of {args.steps} timed steps, load average {load}\n")
    print("| RunConfig | wall ms/step (median of rounds) | CPU ms/step (median of rounds) "
          "| speed vs plain (wall) | speed vs plain (CPU) |")
    print("|---|---:|---:|---:|---:|")
    base_wall, base_cpu = (statistics.median(x["plain"]) for x in (walls, cpus))
    for kind in KINDS:
        wall, cpu = statistics.median(walls[kind]), statistics.median(cpus[kind])
        print(f"| {kind} | {wall * 1e3:.2f} | {cpu * 1e3:.2f} | {base_wall / wall:.3f}x | "
              f"{base_cpu / cpu:.3f}x |")
    print("\nspeed vs plain: plain's time over this row's (target >= 0.98x). Each round: "
          + ", ".join(f"{kind} {w * 1e3:.1f}/{c * 1e3:.1f} ms"
                      for kind in KINDS for w, c in zip(walls[kind], cpus[kind])))
    pl.shutdown()


if __name__ == "__main__":
    main()

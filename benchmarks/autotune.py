"""What PERSEUS_AUTOTUNE finds and what it gains: steps of a model-like set of gradients (many
small tensors and a few large ones, grouped per step) at the default fusion threshold and cycle
time, then at the values the search chose, in the same run.

Run: perseusrun -np 2 [--tcp | --emulate-hosts 2:2 ...] python benchmarks/autotune.py
     [--steps 60] [--repeats 3]
Each repeat initializes the runtime three times: the defaults (the baseline), the search
(PERSEUS_AUTOTUNE=1, stepping until every rank has the final values), then the chosen values
set as PERSEUS_FUSION_THRESHOLD / PERSEUS_CYCLE_TIME, each timed over --steps steps; so load from
elsewhere on the machine hits the two timed variants alike. Rank 0 prints the median over
repeats of steps per second and allreduce MB/s, the chosen values, and the steps the search
took.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import perseus_legacy as hvd
from perseus_legacy import _core

# Elements of each gradient: 40 small tensors of a few KiB to 200 KiB (they fuse) and 3 of
# 1-4 MiB (each reduced on its own), float32.
RNG = np.random.default_rng(7)
GRADIENTS = [int(n) for n in RNG.integers(1 << 10, 50 << 10, size=40)] + [1 << 18, 1 << 19,
                                                                          1 << 20]
SUM, MAX = 1, 3


def step(arrays: list, names: list) -> None:
    _core.grouped_allreduce(arrays, names, op=SUM)


def timed(arrays: list, names: list, steps: int) -> float:
    """Seconds of the slowest rank for `steps` steps."""
    step(arrays, names)  # warm-up: negotiation, the response cache's entries
    start = time.perf_counter()
    for _ in range(steps):
        step(arrays, names)
    elapsed = np.array([time.perf_counter() - start])
    return float(_core.allreduce(elapsed, "autotune.bench.elapsed", op=MAX)[0])


def init(env: dict) -> None:
    for name in ("PERSEUS_AUTOTUNE", "PERSEUS_FUSION_THRESHOLD", "PERSEUS_CYCLE_TIME"):
        os.environ.pop(name, None)
    os.environ.update(env)  # the runtime reads its settings at each init()
    hvd.init()


def main() -> None:
    if "PERSEUS_TCP_RANK" not in os.environ:
        # MPI started by mpi4py outlives each shutdown(): the runtime can init again.
        from mpi4py import MPI  # noqa: F401
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    arrays = [np.ones(n, np.float32) for n in GRADIENTS]
    names = [f"grad.{i}" for i in range(len(GRADIENTS))]
    step_bytes = sum(a.nbytes for a in arrays)
    results = {"defaults": [], "autotuned": []}
    chosen, search_steps, rank = None, [], 0
    for _ in range(args.repeats):
        init({})
        rank = _core.rank()
        results["defaults"].append(timed(arrays, names, args.steps))
        _core.shutdown()
        init({"PERSEUS_AUTOTUNE": "1"})
        steps = 0
        while not _core.allreduce(np.array([_core.runtime_stats()["autotune"]["fixed"]]),
                                  f"autotune.bench.fixed.{steps}", op=MAX)[0]:
            step(arrays, names)
            steps += 1
        tuned = _core.runtime_stats()["autotune"]
        chosen = (tuned["fusion_threshold_bytes"], tuned["cycle_time_us"] / 1000)
        search_steps.append(steps)
        _core.shutdown()
        init({"PERSEUS_FUSION_THRESHOLD": str(chosen[0]), "PERSEUS_CYCLE_TIME": str(chosen[1])})
        results["autotuned"].append(timed(arrays, names, args.steps))
        _core.shutdown()
    if rank != 0:
        return
    print(f"{len(GRADIENTS)} gradients, {step_bytes / 1e6:.1f} MB a step, {args.steps} steps, "
          f"median of {args.repeats} repeats; the search took {search_steps} steps and chose "
          f"PERSEUS_FUSION_THRESHOLD={chosen[0]} PERSEUS_CYCLE_TIME={chosen[1]:g} (last repeat)")
    print()
    print("| values | steps/s | allreduce MB/s |")
    print("|---|---:|---:|")
    for variant, seconds in results.items():
        median = statistics.median(seconds)
        print(f"| {variant} | {args.steps / median:.1f} | "
              f"{args.steps * step_bytes / median / 1e6:.1f} |")


if __name__ == "__main__":
    main()

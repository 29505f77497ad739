"""timed(): the one way the collective benchmarks time several steps that take turns.

benchmarks/allreduce.py, benchmarks/cluster.py (the native op, mpi4py) and
benchmarks/cluster_mwms.py (TensorFlow's MultiWorkerMirroredStrategy) time their rows with it,
so their medians compare.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(steps: dict, barrier: Callable[[], None], agree: Callable[[int], int], repeats: int,
          budget_s: float, warmups: int = 1, most_calls: int = 200) -> dict:
    """Median seconds per call of each step function; the steps take turns within every repeat,
    so load from elsewhere on the machine hits them alike and their ratios stay meaningful.

    Each step is called `warmups` times first (negotiation, first allocations, page faults of
    fresh buffers), then timed in batches of calls that fill its share of `budget_s` (at most
    `most_calls`): every rank makes as many calls as rank 0 decides (`agree`: rank 0's value on
    every rank), and `barrier()` aligns the ranks before each batch."""
    batches = {}
    for name, step in steps.items():
        for _ in range(warmups):
            step()
        t0 = time.perf_counter()
        step()
        one = max(time.perf_counter() - t0, 1e-6)
        batches[name] = agree(max(1, min(most_calls, int(budget_s / len(steps) / repeats / one))))
    samples: dict = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            barrier()
            t0 = time.perf_counter()
            for _ in range(batches[name]):
                step()
            samples[name].append((time.perf_counter() - t0) / batches[name])
    return {name: statistics.median(values) for name, values in samples.items()}

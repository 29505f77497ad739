"""timed(): the one way the collective benchmarks time several steps that take turns.

benchmarks/cluster.py (the native op, mpi4py) and benchmarks/cluster_mwms.py (TensorFlow's
MultiWorkerMirroredStrategy) time their rows with it, so their medians compare.
"""

from __future__ import annotations

import statistics
import time


def timed(steps: dict, barrier, agree, repeats: int, budget_s: float) -> dict:
    """Median seconds per call of each step; the steps take turns within every repeat."""
    batches = {}
    for name, step in steps.items():
        step()  # warm-up: negotiation, first allocations
        t0 = time.perf_counter()
        step()
        one = max(time.perf_counter() - t0, 1e-6)
        batches[name] = agree(max(1, min(200, int(budget_s / len(steps) / repeats / one))))
    samples: dict = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            barrier()
            t0 = time.perf_counter()
            for _ in range(batches[name]):
                step()
            samples[name].append((time.perf_counter() - t0) / batches[name])
    return {name: statistics.median(values) for name, values in samples.items()}

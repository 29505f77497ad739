"""PERSEUS_AUTOTUNE on every rank of one launch: steps of allreduces of mixed sizes and dtypes
(small ones that fuse, more of them than the smallest fusion threshold holds, and one that runs on
its own), each result checked against numpy, while rank 0's search switches the fusion threshold,
the cycle time and the cost model's step latency (so the allreduce algorithms) under them, until
the search has ended on every rank; then a few more steps at the fixed values.

Each step ends with a Max allreduce of this rank's runtime_stats()["autotune"]["fixed"]: the
ranks stop together once one of them has applied the final values (every other rank applied
them in the same earlier round). Every rank then prints `[rank R] CHOSEN threshold cycle_us
latency_ns changes`, which the test compares across ranks and with rank 0's log. The native
core alone (worker_util.load_core): no TensorFlow to import on every rank.
"""

from __future__ import annotations

import numpy as np
from worker_util import (
    AVERAGE,
    MAX,
    SUM,
    assert_close,
    expected_reduce,
    fail,
    init_core,
    load_core,
    rank_data,
    tolerance,
)

_core = load_core()

# (elements, dtype, op): about 1.9 MB of small tensors (each below the 256 KiB that run on their
# own), so a 1 MiB threshold splits them where the others fuse them whole, and one of 1.2 MB.
TENSORS = [(1, "float32", SUM), (17, "int32", SUM), (1000, "float64", AVERAGE),
           (4099, "float32", SUM), (30000, "float32", SUM), (65000, "float32", SUM),
           (60000, "float32", AVERAGE), (50000, "float64", SUM),
           (60000, "float32", SUM), (40000, "int32", SUM), (64000, "float32", SUM),
           (300000, "float32", SUM)]
MAX_STEPS = 600   # the search takes about 40 steps of these with 3 cycles a sample
STEPS_AFTER = 5


def tuned() -> dict:
    return dict(_core.runtime_stats()["autotune"])


def step(rank: int, size: int, number: int) -> None:
    """One step: every tensor allreduced (submitted together), each checked against numpy."""
    arrays, names = [], []
    for i, (count, dtype, _) in enumerate(TENSORS):
        arrays.append(rank_data(rank, (count,), dtype, seed=number * len(TENSORS) + i))
        names.append(f"tune.{i}")
    # One grouped call per op: each submits its tensors at once, as a model's gradients come.
    for op in (SUM, AVERAGE):
        group = [i for i, (_, _, o) in enumerate(TENSORS) if o == op]
        results = _core.grouped_allreduce([arrays[i] for i in group], [names[i] for i in group],
                                          op=op)
        for i, got in zip(group, results):
            count, dtype, _ = TENSORS[i]
            data = [rank_data(r, (count,), dtype, seed=number * len(TENSORS) + i)
                    for r in range(size)]
            assert_close(rank, f"step {number}: {names[i]} ({count} x {dtype})", got,
                         expected_reduce(data, op, dtype), **tolerance(dtype))


def main() -> None:
    rank = init_core(_core)
    size = _core.size()
    for number in range(MAX_STEPS):
        step(rank, size, number)
        fixed = np.array([tuned()["fixed"]], np.int32)
        if _core.allreduce(fixed, f"tune.fixed.{number}", op=MAX)[0]:
            break
    else:
        fail(rank, f"the search had not ended after {MAX_STEPS} steps: {tuned()}")
    chosen = tuned()
    if not chosen["fixed"]:
        fail(rank, f"another rank has the final values, this one not yet: {chosen}")
    print(f"[rank {rank}] CHOSEN {chosen['fusion_threshold_bytes']} {chosen['cycle_time_us']} "
          f"{chosen['hop_latency_ns']} {chosen['changes']} after {number + 1} steps", flush=True)
    for extra in range(STEPS_AFTER):
        step(rank, size, MAX_STEPS + extra)
    if tuned() != chosen:
        fail(rank, f"the values moved after the search ended: {chosen} -> {tuned()}")
    print(f"[rank {rank}] autotune OK", flush=True)
    _core.shutdown()


if __name__ == "__main__":
    main()

"""Latency of perseus_legacy._core.allreduce, with and without the response cache, against mpi4py.

Run: perseusrun -np 2 python benchmarks/core_allreduce.py [--iters N] [--repeats R]
Each repeat measures mpi4py's Allreduce, then _core.allreduce with the response cache off
(PERSEUS_CACHE_CAPACITY=0: every call negotiates through the coordinator) and on (the default),
re-initializing the runtime between the two, so load from elsewhere on the machine hits all three
alike. All of them write into a reused output array. Rank 0 prints the median over repeats of
each repeat's median time per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

from perseus_legacy import _core

SIZES = [("4 KiB", 4 << 10), ("64 KiB", 64 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20)]
VARIANTS = {"cache off": "0", "cache on": "1024"}


def median_seconds(fn, iters: int) -> float:
    comm = MPI.COMM_WORLD
    fn()  # warm-up: negotiation (and, with the cache, its first entry), page faults
    times = []
    for _ in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # The slowest rank decides how long a collective took.
    return comm.allreduce(float(np.median(times)), op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    samples = {(label, what): [] for label, _ in SIZES for what in ["mpi4py", *VARIANTS]}
    for _ in range(args.repeats):
        for label, nbytes in SIZES:
            data = np.ones(nbytes // 4, np.float32)
            out = np.empty_like(data)
            iters = max(10, args.iters if nbytes <= 1 << 20 else args.iters // 10)
            samples[label, "mpi4py"].append(median_seconds(
                lambda d=data, o=out: comm.Allreduce(d, o, op=MPI.SUM), iters))
            for what, capacity in VARIANTS.items():
                os.environ["PERSEUS_CACHE_CAPACITY"] = capacity  # read by init()
                _core.init_mpi(MPI._handleof(comm))
                samples[label, what].append(median_seconds(
                    lambda d=data, o=out: _core.allreduce(d, "bench", op=1, out=o), iters))
                _core.shutdown()
    if comm.rank == 0:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{comm.size} ranks, {os.cpu_count()} cores, load average {load}; median over "
              f"{args.repeats} repeats of the median time per call")
        print("| size | mpi4py | _core, cache off | _core, cache on | cache on / off |")
        print("|---:|---:|---:|---:|---:|")
        for label, _ in SIZES:
            mpi, off, on = (statistics.median(samples[label, w]) * 1e6
                            for w in ("mpi4py", *VARIANTS))
            print(f"| {label} | {mpi:.1f} us | {off:.1f} us | {on:.1f} us | {on / off:.2f}x |")


if __name__ == "__main__":
    main()

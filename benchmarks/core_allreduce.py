"""Latency of perseus_legacy._core.allreduce against mpi4py's Allreduce, measured in one run.

Run: mpirun -np 2 python benchmarks/core_allreduce.py [--iters N]
Prints, on rank 0, the median time per call for float32 tensors of several sizes.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from perseus_legacy import _core

SIZES = [("4 KiB", 4 << 10), ("64 KiB", 64 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20)]


def median_seconds(fn, iters: int) -> float:
    comm = MPI.COMM_WORLD
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
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    _core.init(MPI._handleof(comm))
    rows = []
    for label, nbytes in SIZES:
        data = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(data)
        iters = max(10, args.iters if nbytes <= 1 << 20 else args.iters // 10)
        mpi = median_seconds(lambda d=data, o=out: comm.Allreduce(d, o, op=MPI.SUM), iters)
        ours = median_seconds(lambda d=data: _core.allreduce(d, "bench", op=1), iters)
        rows.append((label, mpi, ours))
    if comm.rank == 0:
        print(f"{comm.size} ranks, median of each call")
        print(f"{'size':>8} {'mpi4py Allreduce':>18} {'_core.allreduce':>17} {'ratio':>7}")
        for label, mpi, ours in rows:
            print(f"{label:>8} {mpi * 1e6:15.1f} us {ours * 1e6:14.1f} us {ours / mpi:7.2f}")
    _core.shutdown()


if __name__ == "__main__":
    main()

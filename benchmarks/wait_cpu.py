"""CPU a rank burns while it waits in collectives: MPI against TCP, with uneven compute per rank.

    perseusrun -np 4 python benchmarks/wait_cpu.py            (MPI)
    perseusrun --tcp -np 4 python benchmarks/wait_cpu.py      (TCP)

Each step, rank r computes for (r + 1) * --compute-ms of CPU (numpy on a small array, so that
every rank but the last waits for a slower one, as in a real step with stragglers), then
allreduces --tensors float32 tensors of --kib KiB each through perseus_legacy._core. Rank 0
prints the wall time per step, the CPU seconds every rank used per step (process time, every
thread: the background thread's waits included) and the cores busy (CPU / wall), against the
compute alone: the CPU the ranks would use if waiting cost nothing. On cores shared by more
ranks than they hold, a rank that polls while it waits takes CPU from the ranks still
computing, and every step gets longer.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from perseus_legacy import _core
from perseus_legacy.common import basics, tf_config

CONTROLLER = tf_config.controller_from_env()  # "mpi", or "tcp" under perseusrun --tcp


def burn(seconds: float, work: np.ndarray) -> None:
    """Computes for `seconds` of this process's CPU time."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        np.dot(work, work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--compute-ms", type=float, default=2.0)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--kib", type=int, default=64)
    args = parser.parse_args()
    basics.init()
    rank, size = _core.rank(), _core.size()
    work = np.ones((64, 64), dtype=np.float32)
    tensors = [np.ones(args.kib * 256, dtype=np.float32) for _ in range(args.tensors)]
    compute = (rank + 1) * args.compute_ms / 1e3

    def step(i: int) -> None:
        burn(compute, work)
        _core.grouped_allreduce(tensors, [f"w{k}.{i % 2}" for k in range(len(tensors))])

    for i in range(5):  # warm-up: negotiation, the response cache, page faults
        step(i)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(args.steps):
        step(i)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    stats = _core.allgather(np.array([[cpu, wall]]), "wait_cpu.stats")
    _core.shutdown()
    if rank == 0:
        cpu_all, wall_max = float(stats[:, 0].sum()), float(stats[:, 1].max())
        ideal = sum((r + 1) * args.compute_ms / 1e3 for r in range(size))
        print(f"\n{CONTROLLER}: {size} ranks, {os.cpu_count()} cores, {args.tensors} x "
              f"{args.kib} KiB per step, compute (r + 1) x {args.compute_ms} ms, load average "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
        print("| transport | wall per step (ms) | CPU per step, all ranks (ms) | compute per step "
              "(ms) | cores busy |")
        print("|---|---:|---:|---:|---:|")
        print(f"| {CONTROLLER} | {wall_max / args.steps * 1e3:.2f} | "
              f"{cpu_all / args.steps * 1e3:.2f} | {ideal * 1e3:.2f} | {cpu_all / wall_max:.2f} |")


if __name__ == "__main__":
    main()

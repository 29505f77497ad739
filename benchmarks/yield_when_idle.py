"""Does `mpi_yield_when_idle` help when ranks share few cores? Runs 2 ranks each way, alternating.

    python benchmarks/yield_when_idle.py [--repeats 3] [--np 2] [--steps 20]

Each rank runs TensorFlow matmuls (rank 1 does 50% more work, so rank 0 waits in MPI) and
4 MiB mpi4py allreduces, in three shapes:
  step     compute, then allreduce (the waiting rank polls while the other still computes)
  overlap  a background thread allreduces while the main thread computes (the runtime's shape)
  latency  1 KiB allreduces back to back (what yielding costs a latency-bound job)
Prints the median wall time of each shape with yielding off (baseline) and on, and the ratio
of the best runs (the least disturbed by other load on the machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

SHAPES = ("step", "overlap", "latency")


def rank_main(shapes: list[str], steps: int) -> None:
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    background_comm = comm.Dup()  # collectives of two threads never share a communicator
    rank = comm.Get_rank()
    a = tf.random.uniform((384, 384))

    def compute(n: int) -> None:
        x = a
        for _ in range(n):
            x = tf.matmul(x, a) * 1e-3
        x.numpy()

    grad, out = np.ones(1 << 20, np.float32), np.empty(1 << 20, np.float32)
    work = 20 if rank == 0 else 30
    compute(2)
    for shape in shapes:
        comm.Barrier()
        start = time.perf_counter()
        if shape == "step":
            for _ in range(steps):
                compute(work)
                comm.Allreduce(grad, out)
        elif shape == "overlap":
            def background() -> None:
                for _ in range(4 * steps):
                    background_comm.Allreduce(grad, out)

            thread = threading.Thread(target=background)
            thread.start()
            for _ in range(steps):
                compute(work)
            thread.join()
        else:
            small, small_out = np.ones(256, np.float32), np.empty(256, np.float32)
            for _ in range(steps * 200):
                comm.Allreduce(small, small_out)
        elapsed = comm.gather(time.perf_counter() - start, root=0)
        if rank == 0:
            print(f"RESULT {shape} {max(elapsed):.4f}", flush=True)


def run_once(np_: int, shapes: list[str], steps: int, yield_mode: str,
             threads: str) -> dict[str, float]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    if threads != "default":
        env.update(TF_NUM_INTRAOP_THREADS=threads, TF_NUM_INTEROP_THREADS=threads,
                   OMP_NUM_THREADS=threads)
    cmd = [sys.executable, "-m", "perseusrun", "-np", str(np_),
           "--timeout", "300", "--yield-when-idle", yield_mode, sys.executable,
           os.path.abspath(__file__), "--rank", ",".join(shapes), "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    results = {line.split()[1]: float(line.split()[2])
               for line in out.stdout.splitlines() if line.startswith("RESULT ")}
    if out.returncode != 0 or len(results) != len(shapes):
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", help=argparse.SUPPRESS)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="default", help="TF/OMP threads per rank, or default")
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    if args.rank:
        rank_main(args.rank.split(","), args.steps)
        return
    shapes = args.shapes.split(",")
    times: dict[str, dict[str, list[float]]] = {s: {"off": [], "on": []} for s in shapes}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            for shape, seconds in run_once(args.np, shapes, args.steps, mode,
                                           args.threads).items():
                times[shape][mode].append(seconds)
    print(f"{args.np} ranks on {os.cpu_count()} cores, TF threads per rank: {args.threads}, "
          f"median of {args.repeats} (alternating runs)")
    print(f"{'shape':<9}{'yield off (s)':>15}{'yield on (s)':>14}{'on/off':>8}{'min on/off':>12}"
          "   runs off | on")
    for shape in shapes:
        off, on = statistics.median(times[shape]["off"]), statistics.median(times[shape]["on"])
        runs = " ".join(f"{t:.2f}" for t in times[shape]["off"]) + " | " + " ".join(
            f"{t:.2f}" for t in times[shape]["on"])
        best = min(times[shape]["on"]) / min(times[shape]["off"])
        print(f"{shape:<9}{off:>15.3f}{on:>14.3f}{on / off:>8.2f}{best:>12.2f}   {runs}",
              flush=True)


if __name__ == "__main__":
    main()

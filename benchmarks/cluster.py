"""Allreduce across emulated hosts with rate-limited links: the TF op over MPI and over TCP,
against mpi4py's Allreduce measured in the same run.

    python benchmarks/cluster.py [--layouts 2x1,4x1,2x2] [--link-rates 1gbit,10gbit]  (as root)

For each layout HOSTSxSLOTS and link rate it launches `perseusrun --emulate-hosts HOSTS:SLOTS
--link-rate RATE` twice: over MPI (the TF op `perseus_legacy.allreduce` in a Session, and
mpi4py's `comm.Allreduce` on numpy buffers, taking turns) and with `--tcp` (the TF op over the
TCP controller). Columns: median ms per allreduce (Sum, float32), bus bandwidth
2(N-1)/N * S / t over the N ranks (what each link carries in a ring), and that bandwidth over
the link rate. With several ranks per host, a host's ranks share its one link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1024 * 1024
SIZES = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
ROWS = {"op_mpi": "TF op, MPI", "op_tcp": "TF op, TCP", "mpi4py": "mpi4py Allreduce"}
HERE = os.path.dirname(os.path.abspath(__file__))


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


def worker(controller: str, sizes: list, repeats: int, budget_s: float) -> None:
    """One rank: rank 0 prints `CLUSTER_SECONDS {row: {bytes: seconds}}`."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = controller == "mpi"  # --tcp: MPI never starts
    sys.path.insert(0, HERE)
    import allreduce as bench  # noqa: I001 (benchmarks/allreduce.py: the op's Session step)
    import numpy as np

    from perseus_legacy import _core

    pl = bench.pl
    pl.init()
    if controller == "mpi":
        comm = bench.MPI.COMM_WORLD
        barrier, agree = comm.Barrier, lambda value: comm.bcast(value, root=0)
    else:
        def agree(value: int) -> int:  # rank 0's value everywhere; also a barrier
            return int(_core.broadcast(np.array([value], np.int64), 0, "agree")[0])

        def barrier() -> None:
            agree(0)
    results: dict = {}
    for nbytes in sizes:
        steps = {f"op_{controller}": bench.tf_allreduce_step([(nbytes // 4,)])}
        if controller == "mpi":
            steps["mpi4py"] = bench.mpi4py_step(nbytes)
        for name, seconds in timed(steps, barrier, agree, repeats, budget_s).items():
            results.setdefault(name, {})[nbytes] = seconds
    if pl.rank() == 0:
        print("CLUSTER_SECONDS " + json.dumps(results), flush=True)
    pl.shutdown()


def launch(hosts: int, slots: int, link_rate: str, controller: str,
           args: argparse.Namespace) -> dict:
    perseusrun = os.path.join(os.path.dirname(sys.executable), "perseusrun")
    cmd = [perseusrun, "--emulate-hosts", f"{hosts}:{slots}", "--link-rate", link_rate,
           *(["--tcp"] if controller == "tcp" else []), "--timeout", str(args.timeout),
           sys.executable, os.path.abspath(__file__), "--worker", controller,
           "--sizes", ",".join(map(str, args.sizes)), "--repeats", str(args.repeats),
           "--budget", str(args.budget)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=args.timeout + 120)
    for line in proc.stdout.splitlines():
        if line.startswith("CLUSTER_SECONDS "):
            return {row: {int(k): v for k, v in by_size.items()}
                    for row, by_size in json.loads(line.split(" ", 1)[1]).items()}
    raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout}\n"
                       f"{proc.stderr}")


def print_table(hosts: int, slots: int, link_rate: str, results: dict,
                link_bytes_s: float) -> None:
    ranks = hosts * slots
    print(f"\n{hosts} emulated hosts x {slots} rank(s), links {link_rate} each way "
          "(bus bandwidth = 2(n-1)/n * S / t; mpi4py is the baseline)\n")
    print("| size | row | ms | bus GB/s | bus bw / link | vs mpi4py |")
    print("|---:|---|---:|---:|---:|---:|")
    for nbytes in sorted(results["mpi4py"]):
        base = results["mpi4py"][nbytes]
        for row in ROWS:
            seconds = results[row][nbytes]
            bus = 2 * (ranks - 1) / ranks * nbytes / seconds
            print(f"| {nbytes // MIB} MiB | {ROWS[row]} | {seconds * 1e3:.1f} | "
                  f"{bus / 1e9:.3f} | {bus / link_bytes_s:.2f} | {base / seconds:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="2x1,4x1,2x2",
                        help="comma-separated HOSTSxSLOTS (ranks per host)")
    parser.add_argument("--link-rates", default="1gbit,10gbit",
                        help="comma-separated, tc syntax; a 2-core host cannot fill 10gbit, so "
                             "there it measures the host, not the link")
    parser.add_argument("--sizes", type=lambda text: [int(x) for x in text.split(",")],
                        default=SIZES, help="comma-separated byte counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per size and row")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--worker", choices=("mpi", "tcp"), help="internal: one rank")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.sizes, args.repeats, args.budget)
        return
    from perseusrun import emulate

    for link_rate in args.link_rates.split(","):
        link_bytes_s = emulate.rate_bytes_per_second(link_rate)
        for layout in args.layouts.split(","):
            hosts, slots = (int(x) for x in layout.split("x"))
            results = {**launch(hosts, slots, link_rate, "mpi", args),
                       **launch(hosts, slots, link_rate, "tcp", args)}
            print_table(hosts, slots, link_rate, results, link_bytes_s)


if __name__ == "__main__":
    main()

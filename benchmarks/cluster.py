"""Allreduce across emulated hosts with rate-limited links: the TF op over MPI and over TCP,
against mpi4py's Allreduce and TensorFlow's MultiWorkerMirroredStrategy measured in the same run.

    python benchmarks/cluster.py [--layouts 2x1,4x1,2x2] [--link-rates 1gbit,10gbit]
                                 [--rows op_mpi,op_tcp,mpi4py,mwms] [--link-delays 0,1,2]
                                 [--link-queue MS]
                                 (as root)

For each layout HOSTSxSLOTS and link rate it launches `perseusrun --emulate-hosts HOSTS:SLOTS
--link-rate RATE` twice: over MPI (the TF op `perseus_legacy.allreduce` in a Session, and
mpi4py's `comm.Allreduce` on numpy buffers, taking turns) and with `--tcp` (the TF op over the
TCP controller); then HOSTS x SLOTS MultiWorkerMirroredStrategy workers (RING, CPU, one per
rank, on a network built the same way: benchmarks/cluster_mwms.py). Columns: median ms per
allreduce (Sum, float32), bus bandwidth 2(N-1)/N * S / t over the N ranks (what each link
carries in a ring), that bandwidth over the link rate and speed relative to mpi4py. With
several ranks per host, a host's ranks share its one link. Under each table: how much faster
the TF op is than MultiWorkerMirroredStrategy (its time over the op's) from 4 MiB.
With --link-delays (one-way ms per link, perseusrun --link-delay), every layout and rate is
measured at each delay in turn: the first (0 by default) is the baseline of the others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MIB = 1024 * 1024
SIZES = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
ROWS = {"op_mpi": "TF op, MPI", "op_tcp": "TF op, TCP", "mpi4py": "mpi4py Allreduce",
        "mwms": "TF MultiWorkerMirrored, RING"}
MPI_ROWS = ("op_mpi", "mpi4py")  # timed, taking turns, in the one launch over MPI
RATIO_FROM_BYTES = 4 * MIB  # below it the per-call overheads, not the links, decide
HERE = os.path.dirname(os.path.abspath(__file__))


def worker(controller: str, rows: list, sizes: list, repeats: int, budget_s: float) -> None:
    """One rank: rank 0 prints `CLUSTER_SECONDS {row: {bytes: seconds}}`."""
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = controller == "mpi"  # --tcp: MPI never starts
    # perseus_legacy before tf_steps (TensorFlow): it selects legacy Keras first.
    import perseus_legacy as pl  # noqa: I001
    from perseus_legacy import _core
    import numpy as np
    from bench_common.tf_steps import mpi4py_step, tf_allreduce_step
    from bench_common.timing import timed

    pl.init()
    if controller == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        barrier, agree = comm.Barrier, lambda value: comm.bcast(value, root=0)
    else:
        def agree(value: int) -> int:  # rank 0's value everywhere; also a barrier
            return int(_core.broadcast(np.array([value], np.int64), 0, "agree")[0])

        def barrier() -> None:
            agree(0)
    results: dict = {}
    for nbytes in sizes:
        steps = {}
        if f"op_{controller}" in rows:
            steps[f"op_{controller}"] = tf_allreduce_step([(nbytes // 4,)])
        if controller == "mpi" and "mpi4py" in rows:
            steps["mpi4py"] = mpi4py_step(nbytes)
        for name, seconds in timed(steps, barrier, agree, repeats, budget_s).items():
            results.setdefault(name, {})[nbytes] = seconds
    if pl.rank() == 0:
        print("CLUSTER_SECONDS " + json.dumps(results), flush=True)
    pl.shutdown()


def launch(hosts: int, slots: int, link_rate: str, controller: str,
           args: argparse.Namespace, delay_ms: float = 0.0) -> dict:
    perseusrun = os.path.join(os.path.dirname(sys.executable), "perseusrun")
    cmd = [perseusrun, "--emulate-hosts", f"{hosts}:{slots}", "--link-rate", link_rate,
           *(["--link-delay", f"{delay_ms:g}"] if delay_ms else []),
           *(["--link-queue", f"{args.link_queue:g}"] if args.link_queue else []),
           *(["--tcp"] if controller == "tcp" else []), "--timeout", str(args.timeout),
           sys.executable, os.path.abspath(__file__), "--worker", controller,
           "--rows", ",".join(args.rows), "--sizes", ",".join(map(str, args.sizes)),
           "--repeats", str(args.repeats), "--budget", str(args.budget)]
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


def size_text(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def print_table(hosts: int, slots: int, link_rate: str, results: dict,
                link_bytes_s: float, delay_ms: float = 0.0) -> None:
    ranks = hosts * slots
    rows = [row for row in ROWS if row in results]
    baseline = results.get("mpi4py")
    delay = f", {delay_ms:g} ms one-way delay" if delay_ms else ""
    print(f"\n{hosts} emulated hosts x {slots} rank(s), links {link_rate} each way{delay} "
          "(bus bandwidth = 2(n-1)/n * S / t" + ("; mpi4py is the baseline)\n" if baseline
                                                 else ")\n"))
    print("| size | row | ms | bus GB/s | bus bw / link |" + (" vs mpi4py |" if baseline else ""))
    print("|---:|---|---:|---:|---:|" + ("---:|" if baseline else ""))
    for nbytes in sorted(results[rows[0]]):
        for row in rows:
            seconds = results[row][nbytes]
            bus = 2 * (ranks - 1) / ranks * nbytes / seconds
            versus = f" {baseline[nbytes] / seconds:.2f}x |" if baseline else ""
            print(f"| {size_text(nbytes)} | {ROWS[row]} | {seconds * 1e3:.1f} | "
                  f"{bus / 1e9:.3f} | {bus / link_bytes_s:.2f} |{versus}")
    ops = [row for row in ("op_mpi", "op_tcp") if row in results]
    sizes = [nbytes for nbytes in sorted(results.get("mwms", {})) if nbytes >= RATIO_FROM_BYTES]
    if ops and sizes:
        print("\nTF op speed over MultiWorkerMirrored (its ms / the op's ms): " + "; ".join(
            f"{nbytes // MIB} MiB " + ", ".join(
                f"{ROWS[op].split(', ')[1]} {results['mwms'][nbytes] / results[op][nbytes]:.2f}x"
                for op in ops) for nbytes in sizes))


def measure(hosts: int, slots: int, link_rate: str, args: argparse.Namespace,
            delay_ms: float = 0.0) -> dict:
    """{row: {bytes: seconds}} of the rows in args.rows, one launch after the other."""
    results: dict = {}
    if any(row in args.rows for row in MPI_ROWS):
        results.update(launch(hosts, slots, link_rate, "mpi", args, delay_ms))
    if "op_tcp" in args.rows:
        results.update(launch(hosts, slots, link_rate, "tcp", args, delay_ms))
    if "mwms" in args.rows:
        from bench_common import mwms

        results.update(mwms.launch(hosts, slots, link_rate, args, delay_ms))
    return results


def parse_rows(text: str) -> list:
    rows = [row.strip() for row in text.split(",") if row.strip()]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        raise argparse.ArgumentTypeError(f"unknown row(s) {', '.join(unknown) or '(none)'}: "
                                         f"choose from {', '.join(ROWS)}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="2x1,4x1,2x2",
                        help="comma-separated HOSTSxSLOTS (ranks per host)")
    parser.add_argument("--link-rates", default="1gbit,10gbit",
                        help="comma-separated, tc syntax; a 2-core host cannot fill 10gbit, so "
                             "there it measures the host, not the link")
    parser.add_argument("--rows", type=parse_rows, default=list(ROWS),
                        help=f"comma-separated rows to measure, of {','.join(ROWS)}")
    parser.add_argument("--sizes", type=lambda text: [int(x) for x in text.split(",")],
                        default=SIZES, help="comma-separated byte counts")
    parser.add_argument("--link-delays", type=lambda text: [float(x) for x in text.split(",")],
                        default=[0.0], help="comma-separated one-way delays per link, ms")
    parser.add_argument("--link-queue", type=float, metavar="MS",
                        help="ms of traffic a link holds before it drops (perseusrun's "
                             "--link-queue; default 10)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per size and launch")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--worker", choices=("mpi", "tcp"), help="internal: one rank")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rows, args.sizes, args.repeats, args.budget)
        return
    from perseusrun import emulate

    for link_rate in args.link_rates.split(","):
        link_bytes_s = emulate.rate_bytes_per_second(link_rate)
        for layout in args.layouts.split(","):
            hosts, slots = (int(x) for x in layout.split("x"))
            for delay_ms in args.link_delays:
                print_table(hosts, slots, link_rate,
                            measure(hosts, slots, link_rate, args, delay_ms), link_bytes_s,
                            delay_ms)


if __name__ == "__main__":
    main()

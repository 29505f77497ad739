"""Allreduce throughput of the TF graph op in a Session, against mpi4py in the same run.

    perseusrun -np 2 python benchmarks/allreduce.py      (or: mpirun -np 2 python ...)

For each float32 size: median time per allreduce (Sum) and algorithm bandwidth (bytes / time) of
(a) `perseus_legacy.allreduce` run by a `tf.compat.v1.Session` and (b) `comm.Allreduce` of
mpi4py on numpy buffers, and the bandwidth ratio a/b; and (c) mpi4py taking 4 buffer pairs in
turn (a step's gradients are different buffers; one pair stays in the CPU's caches between
calls, which from a few MiB on makes (b) faster than any step's allreduce). Then 100 x 16 KiB
tensors in one session.run against one 1.6 MiB tensor: what fusion costs over a single
collective.

TCP column (unless --no-tcp): after the MPI tables, rank 0 starts a separate
`perseusrun --tcp -np N` launch of this script (`--tcp-worker`), which times
`perseus_legacy._core.allreduce` on numpy arrays over the TCP controller (no MPI), into a reused
output array like mpi4py's receive buffer, and prints it next to this run's mpi4py times (target:
TCP >= 0.7x mpi4py's bandwidth at >= 16 MiB), with the TF op's chain and floor over TCP.

How the op is measured:
- The input is a variable, so no feed is copied into the graph each step.
- The session runs a NoOp that has the allreduce as a control input: the result is computed but
  never fetched. A fetch would copy the result into a new numpy array every step (a 64 MiB
  memcpy), which measures the Session fetch path rather than the collective.
- Each session.run runs CHAIN allreduces one after the other (control dependencies keep them
  from being fused), so session.run's fixed Python and executor cost (~0.1-0.3 ms) is shared
  as in a real training step with many ops; a column shows one allreduce per run.
- TensorFlow's floor: the same chain with tf.identity in place of each allreduce, timed in the
  same turns; "TF op over floor" is what one allreduce adds to the step (also for the TF op
  over TCP, in the TCP launch).
- Without a thread pool: the same chain in a Session with inter_op_parallelism_threads=-1, which
  runs each kernel on the thread that made it ready. An async op otherwise costs two thread
  hand-offs (TensorFlow's pool thread submits it to the background thread, whose completion
  callback schedules the next kernel back on the pool); this column is the op without them,
  what the runtime itself does. Not a setting for training: the step's compute would then run
  on the background thread, between collectives.
Horovod table (--horovod): rank 0 then starts Horovod 0.28.1's TF op in the same steps
(benchmarks/allreduce_horovod.py, TF 2.15.1 in the peers venv, `make peers`, under that venv's
mpirun) and prints it against this run's mpi4py times: the reference library's async op on the
same host, beside this one.
Rank 0 prints markdown tables.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: it selects legacy Keras before TensorFlow binds tf.keras.
import perseus_legacy as pl

import argparse
import json
import os
import subprocess
import sys
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from bench_common.tf_steps import mpi4py_step, tf_allreduce_step
from bench_common.timing import timed

if "--tcp-worker" not in sys.argv:  # the TCP launch must not initialize MPI
    from mpi4py import MPI

KIB, MIB = 1024, 1024 * 1024
SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 64 * MIB]
CHAIN = 4  # allreduces per session.run in the main table


class Row(NamedTuple):
    """One size of the main table: seconds per allreduce (`op`, `floor`: per op of the chain)."""

    nbytes: int
    op: float  # the TF op, chain of CHAIN
    single: float  # one op per session.run
    mpi4py: float  # one warm buffer pair
    floor: float  # the chain with tf.identity
    mpi4py_turns: float  # CHAIN buffer pairs in turn
    inline: float  # the TF op, chain of CHAIN, a Session without an inter-op thread pool


def launched_seconds(proc: subprocess.CompletedProcess, marker: str, what: str) -> dict:
    """{bytes: value} from the `marker {json}` line a separate launch's rank 0 printed."""
    for line in proc.stdout.splitlines():
        if line.startswith(marker + " "):
            return {int(k): v for k, v in json.loads(line.split(" ", 1)[1]).items()}
    raise RuntimeError(f"the {what} launch failed (exit {proc.returncode}):\n{proc.stdout}\n"
                       f"{proc.stderr}")


def label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def mpi_agree(value: int) -> int:
    """Rank 0's `value` on every rank, over MPI; also a barrier."""
    return MPI.COMM_WORLD.bcast(value, root=0)


def median_seconds(steps: dict, repeats: int, budget_s: float, agree=mpi_agree) -> dict:
    """timed() with this script's warm-up (3 calls) and batches (up to 500 calls), `agree(0)`
    aligning the ranks."""
    return timed(steps, lambda: agree(0), agree, repeats, budget_s, warmups=3, most_calls=500)


# ---- TCP column: perseus_legacy._core.allreduce over the TCP controller, its own launch -------

def tcp_worker(sizes: list, repeats: int, budget_s: float) -> None:
    """--tcp-worker: under perseusrun --tcp; rank 0 prints `TCP_SECONDS {bytes: {step: s}}`.

    Steps: `core` (_core.allreduce on numpy), `op` and `floor` (the TF chain and its floor, as in
    the MPI table).
    """
    from perseus_legacy import _core

    pl.init()
    assert pl.size() > 1 and _core.build_info()["controller"] == "tcp", _core.build_info()

    def agree(value: int) -> int:  # rank 0's value on every rank; also a barrier
        return int(_core.broadcast(np.array([value], np.int64), 0, "tcp_agree")[0])

    def core_step(nbytes: int):
        data = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(data)
        return lambda: _core.allreduce(data, "tcp_bench", op=pl.Sum, out=out)

    seconds = {}
    for nbytes in sizes:
        times = median_seconds({"core": core_step(nbytes),
                                "op": tf_allreduce_step([[nbytes // 4]], CHAIN),
                                "floor": tf_allreduce_step([[nbytes // 4]], CHAIN, floor=True)},
                               repeats, budget_s, agree)
        seconds[nbytes] = {"core": times["core"], "op": times["op"] / CHAIN,
                           "floor": times["floor"] / CHAIN}
    if pl.rank() == 0:
        print("TCP_SECONDS " + json.dumps(seconds), flush=True)
    pl.shutdown()


def tcp_seconds(size: int, sizes: list, repeats: int, budget_s: float) -> dict:
    """Seconds per allreduce by size, from a separate `perseusrun --tcp -np size` launch."""
    perseusrun = os.path.join(os.path.dirname(sys.executable), "perseusrun")
    cmd = [perseusrun, "--tcp", "-np", str(size), "--timeout", "900", sys.executable,
           os.path.abspath(__file__), "--tcp-worker", "--sizes", ",".join(map(str, sizes)),
           "--repeats", str(repeats), "--budget", str(budget_s)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return launched_seconds(proc, "TCP_SECONDS", "TCP")


# ---- Horovod table: Horovod's TF op in the same steps, a launch in the peers venv -------------
PEERS_BIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         ".venv-peers", "bin")


def horovod_seconds(size: int, sizes: list, repeats: int, budget_s: float,
                    cycle_ms: str | None) -> dict:
    """Seconds per allreduce by size of Horovod's op, from a separate launch under
    the peers venv's mpirun; `cycle_ms`: HOROVOD_CYCLE_TIME, or Horovod's default."""
    # Not this launch's MPI environment (the peers' mpirun starts a job of its own), nor the
    # legacy Keras that perseus_legacy selects (TF 2.15 has its own Keras).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HOROVOD_", "TF_USE_LEGACY_KERAS"))}
    env.update(HOROVOD_CONTROLLER="mpi", HOROVOD_CPU_OPERATIONS="mpi")
    if cycle_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = cycle_ms
    cmd = [os.path.join(PEERS_BIN, "mpirun"), "-np", str(size), "--allow-run-as-root",
           "--oversubscribe", "--bind-to", "none", os.path.join(PEERS_BIN, "python"),
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "allreduce_horovod.py"),
           "--sizes", ",".join(map(str, sizes)), "--chain", str(CHAIN), "--repeats", str(repeats),
           "--budget", str(budget_s)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    return launched_seconds(proc, "HOROVOD_SECONDS", "Horovod")


def print_horovod_table(size: int, rows: list[Row], runs: dict) -> None:
    """`runs`: {HOROVOD_CYCLE_TIME label: horovod_seconds()}."""
    print(f"\nHorovod 0.28.1's TF op ({size} ranks, MPI, TF 2.15.1, a separate launch; the same "
          f"chain of {CHAIN} and Session settings) against this run's mpi4py, beside this op: "
          "ms per allreduce (op / mpi4py)\n")
    print("| size | mpi4py (ms) | this op | " + " | ".join(
        f"Horovod, HOROVOD_CYCLE_TIME={cycle}" for cycle in runs) + " |")
    print("|---:|---:|---:|" + "---:|" * len(runs))
    for row in rows:
        cells = [f"{row.op * 1e3:.3f} ({row.mpi4py / row.op:.2f}x)"] + [
            f"{seconds[row.nbytes] * 1e3:.3f} ({row.mpi4py / seconds[row.nbytes]:.2f}x)"
            for seconds in runs.values()]
        print(f"| {label(row.nbytes)} | {row.mpi4py * 1e3:.3f} | " + " | ".join(cells) + " |")
    print("\nHOROVOD_CYCLE_TIME (ms): default, 0.1, and 0 (its background thread never sleeps). "
          "Horovod's op is not marked stateful, so its Session keeps Grappler's dependency "
          "optimizer off (which would otherwise drop a chain that only feeds control edges). "
          "Horovod's columns are separate launches from this op's: on a host whose speed drifts "
          "between launches, one run's ratios are rough.")


def print_tcp_table(size: int, rows: list[Row], tcp: dict) -> None:
    print(f"\nTCP controller ({size} ranks, perseusrun --tcp, a separate launch): _core.allreduce "
          "on numpy against this run's mpi4py over MPI, and the TF op against its floor\n")
    print("| size | mpi4py (ms) | mpi4py (GB/s) | TCP (ms) | TCP (GB/s) | TCP / mpi4py "
          f"| TF op over TCP, chain of {CHAIN} (ms/op) | TF op over floor (us) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        nbytes, mpi_s = row.nbytes, row.mpi4py
        tcp_s, op_s, floor_s = (tcp[nbytes][k] for k in ("core", "op", "floor"))
        print(f"| {label(nbytes)} | {mpi_s * 1e3:.3f} | {nbytes / mpi_s / 1e9:.2f} | "
              f"{tcp_s * 1e3:.3f} | {nbytes / tcp_s / 1e9:.2f} | {mpi_s / tcp_s:.2f}x | "
              f"{op_s * 1e3:.3f} | {(op_s - floor_s) * 1e6:.0f} |")
    print("\nTCP / mpi4py: bandwidth ratio (target >= 0.7x at >= 16 MiB). TF op over floor: as in "
          "the MPI table (target <= 50 us at 4 KiB).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", type=lambda text: [int(x) for x in text.split(",")],
                        default=SIZES, help="comma-separated byte counts")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per comparison")
    parser.add_argument("--no-tcp", action="store_true", help="skip the TCP column's launch")
    parser.add_argument("--horovod", action="store_true",
                        help="also Horovod's TF op (needs .venv-peers: make peers)")
    parser.add_argument("--tcp-worker", action="store_true",
                        help="internal: one rank of the TCP column's perseusrun --tcp launch")
    args = parser.parse_args()
    if args.horovod and not os.access(os.path.join(PEERS_BIN, "python"), os.X_OK):
        parser.error(f"--horovod: {PEERS_BIN}/python is missing (`make peers` builds it)")
    if args.tcp_worker:
        tcp_worker(args.sizes, args.repeats, args.budget)
        return

    pl.init()
    rank, size = pl.rank(), pl.size()
    rows = []
    for nbytes in args.sizes:
        times = median_seconds({"op": tf_allreduce_step([[nbytes // 4]], CHAIN),
                                "single": tf_allreduce_step([[nbytes // 4]]),
                                "floor": tf_allreduce_step([[nbytes // 4]], CHAIN, floor=True),
                                "mpi4py": mpi4py_step(nbytes),
                                "mpi4py_turns": mpi4py_step(nbytes, CHAIN),
                                "inline": tf_allreduce_step([[nbytes // 4]], CHAIN, inline=True)},
                               args.repeats, args.budget)
        rows.append(Row(nbytes, times["op"] / CHAIN, times["single"], times["mpi4py"],
                        times["floor"] / CHAIN, times["mpi4py_turns"], times["inline"] / CHAIN))

    many_bytes = 100 * 16 * KIB
    times = median_seconds({"many": tf_allreduce_step([[16 * KIB // 4]] * 100),
                            "grouped": tf_allreduce_step([[16 * KIB // 4]] * 100, grouped=True),
                            "one": tf_allreduce_step([[many_bytes // 4]])},
                           args.repeats, args.budget)
    many_s, grouped_s, one_s = times["many"], times["grouped"], times["one"]

    if rank == 0:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        bfc = os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "unset")
        print(f"\nfloat32 Sum allreduce, {size} ranks, TF {tf.__version__}, "
              f"{MPI.Get_library_version().splitlines()[0].split(',')[0]}, "
              f"{os.cpu_count()} cores, load average {load}, TF_CPU_ALLOCATOR_USE_BFC={bfc}\n")
        print(f"| size | TF op, chain of {CHAIN} (ms/op) | TF op (GB/s) | mpi4py (ms) "
              "| mpi4py (GB/s) | TF op / mpi4py | TF op, 1 per session.run (ms) "
              f"| TF floor (ms/op) | TF op over floor (us) | mpi4py, {CHAIN} buffers (ms) "
              f"| TF op / mpi4py, {CHAIN} buffers | TF op / (mpi4py + TF floor) "
              "| TF op, no thread pool (ms/op) | no thread pool / mpi4py |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for nbytes, op_s, single_s, mpi_s, floor_s, turns_s, inline_s in rows:
            print(f"| {label(nbytes)} | {op_s * 1e3:.3f} | {nbytes / op_s / 1e9:.2f} | "
                  f"{mpi_s * 1e3:.3f} | {nbytes / mpi_s / 1e9:.2f} | {mpi_s / op_s:.2f}x | "
                  f"{single_s * 1e3:.3f} | {floor_s * 1e3:.3f} | "
                  f"{(op_s - floor_s) * 1e6:.0f} | {turns_s * 1e3:.3f} | "
                  f"{turns_s / op_s:.2f}x | {(mpi_s + floor_s) / op_s:.2f}x | "
                  f"{inline_s * 1e3:.3f} | {mpi_s / inline_s:.2f}x |")
        print("\n| one session.run | time (ms) | GB/s |")
        print("|---|---:|---:|")
        print(f"| 100 x 16 KiB tensors, 100 allreduce ops | {many_s * 1e3:.3f} | "
              f"{many_bytes / many_s / 1e9:.2f} |")
        print(f"| 100 x 16 KiB tensors, one grouped_allreduce op | {grouped_s * 1e3:.3f} | "
              f"{many_bytes / grouped_s / 1e9:.2f} |")
        print(f"| 1 x 1.6 MiB tensor | {one_s * 1e3:.3f} | {many_bytes / one_s / 1e9:.2f} |")
        print(f"\nTF op, chain of {CHAIN}: {CHAIN} dependent allreduces per session.run, time per "
              "allreduce (shares session.run's fixed cost). TF op / mpi4py: bandwidth ratio of "
              "that column (target >= 0.95x at >= 1 MiB). 1 per session.run: the whole call. "
              "TF floor: the same chain with tf.identity for each allreduce; TF op over floor: "
              "what one allreduce adds to TensorFlow's own step, transfer included (target "
              f"<= 50 us at 4 KiB). mpi4py, {CHAIN} buffers: each call on the next of {CHAIN} "
              "send/receive pairs, as a step's gradients are different buffers (one pair stays "
              "in the CPU's caches from call to call). TF op / (mpi4py + TF floor): against "
              "the fastest a TF op could be on this host, MPI's own transfer plus TensorFlow's "
              "own cost of the op in the step. No thread pool: the chain in a Session with "
              "inter_op_parallelism_threads=-1, which runs each kernel on the thread that made "
              "it ready (the collective's own background thread after the first), without the "
              "two thread hand-offs an async op costs otherwise: what this op's runtime does "
              "without TensorFlow's thread pool (not a training setting).\n"
              f"100 small tensors / one fused tensor: {many_s / one_s:.2f}x as 100 ops, "
              f"{grouped_s / one_s:.2f}x as one grouped op (target <= 1.5x).")

    # Rank 0 alone starts the TCP launch; the other MPI ranks have nothing left to do.
    pl.shutdown()
    if rank == 0 and not args.no_tcp and size > 1:
        print_tcp_table(size, rows, tcp_seconds(size, args.sizes, args.repeats, args.budget))
    if rank == 0 and args.horovod and size > 1:
        runs = {cycle or "default": horovod_seconds(size, args.sizes, args.repeats, args.budget,
                                                    cycle) for cycle in (None, "0.1", "0")}
        print_horovod_table(size, rows, runs)

if __name__ == "__main__":
    main()

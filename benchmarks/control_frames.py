"""What authenticating the TCP control frames costs: small-allreduce latency over the TCP
controller with this tree's build against a baseline tree's build, in the same run.

    python benchmarks/control_frames.py --baseline /path/to/other/checkout [--ranks 2]

Each tree must hold a built perseus_legacy (`setup.py build_ext --inplace`). The launches take
turns (ROUNDS each), every one a `perseusrun --tcp` job whose ranks load only the native core
and time ITERS allreduces of one float64 (every one a negotiation round over the control plane
plus a tiny ring); rank 0 reports the median per allreduce. The table shows each tree's median
over its launches and the difference.

`--worker` is the rank side (set by the driver).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent.parent
ITERS = 3000
ROUNDS = 5


def load_core(tree: Path):
    [path] = glob.glob(str(tree / "perseus_legacy" / "_core*.so"))
    spec = importlib.util.spec_from_file_location("perseus_legacy._core", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(tree: Path) -> None:
    core = load_core(tree)
    rank = int(os.environ["PERSEUS_TCP_RANK"])
    addresses = os.environ["PERSEUS_TCP_ADDRESSES"].split(",")
    core.init_tcp(rank, addresses, rank, len(addresses), 0, 1, os.environ["PERSEUS_SECRET"],
                  60.0)
    one = np.ones(1)
    for _ in range(200):  # warm-up: the response cache, first allocations
        core.allreduce(one, "latency", op=1)
    times = []
    for _ in range(ITERS):
        t0 = time.perf_counter()
        core.allreduce(one, "latency", op=1)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        print(f"MEDIAN_US {statistics.median(times) * 1e6:.2f}", flush=True)
    core.shutdown()


def launch(tree: Path, ranks: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSEUS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "perseusrun"), "--tcp", "-np", str(ranks), "--timeout",
         "300", sys.executable, __file__, "--worker", str(tree)],
        env=env, capture_output=True, text=True, timeout=360, check=True).stdout
    return float(re.search(r"MEDIAN_US ([0-9.]+)", out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout, built in place")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    trees = {"baseline": args.baseline.resolve(), "this tree": HERE}
    medians: dict = {name: [] for name in trees}
    for _ in range(ROUNDS):
        for name, tree in trees.items():
            medians[name].append(launch(tree, args.ranks))
    base = statistics.median(medians["baseline"])
    print(f"| {args.ranks} TCP ranks, 1-element allreduce | median us per op | vs baseline |")
    print("| --- | --- | --- |")
    for name, tree in trees.items():
        value = statistics.median(medians[name])
        change = f"{value - base:+.1f} us ({value / base - 1:+.1%})"
        print(f"| {name} ({tree}) | {value:.1f} | {change} |")


if __name__ == "__main__":
    main()

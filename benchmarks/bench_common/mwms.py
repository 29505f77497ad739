"""TensorFlow's own MultiWorkerMirroredStrategy on emulated hosts: the comparison row of
benchmarks/cluster.py and benchmarks/scaling.py.

`launch()` builds the emulated hosts (the same `perseusrun.emulate` network and link rate as
the other rows), starts one TF worker (benchmarks/cluster_mwms.py) per rank with a TF_CONFIG
that lists every worker's namespace address, host-major like perseusrun's ranks (so the ring
crosses each host link once each way), and returns worker 0's median seconds per allreduce by
size. worker_env() is such a worker's environment (scaling.py starts its own workers with it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

WORKER = Path(__file__).resolve().parents[1] / "cluster_mwms.py"
# Each emulated host has its own network namespace, so ports only differ between the workers
# that share a host.
BASE_PORT = 23450
# gRPC would route worker-to-worker traffic through a proxy named in these.
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")
LOG_TAIL_CHARS = 3000


def worker_env(addresses: list, index: int) -> dict:
    env = {key: value for key, value in os.environ.items()
           if key.lower() not in PROXY_VARIABLES}
    env.update(TF_CONFIG=json.dumps({"cluster": {"worker": addresses},
                                     "task": {"type": "worker", "index": index}}),
               OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    return env


def _wait_all(procs: list, timeout_s: float) -> str | None:
    """Waits for every worker; None when all exit 0, else what went wrong first."""
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(len(procs)) as pool:
        pending = {pool.submit(proc.wait): index for index, proc in enumerate(procs)}
        try:
            while pending:
                done, _ = wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=FIRST_COMPLETED)
                if not done:
                    return f"timed out after {timeout_s:.0f} s"
                for future in done:
                    index = pending.pop(future)
                    if future.result() != 0:
                        return f"worker {index} exited with {future.result()}"
            return None
        finally:
            for proc in procs:  # only those still running: the others are waited for
                if proc.poll() is None:
                    proc.kill()


def launch(hosts: int, slots: int, link_rate: str, args: argparse.Namespace,
           delay_ms: float = 0.0) -> dict:
    """{"mwms": {bytes: seconds}} from hosts x slots MWMS workers on emulated hosts."""
    from perseusrun import emulate

    argv = [sys.executable, str(WORKER), "--sizes", ",".join(map(str, args.sizes)),
            "--repeats", str(args.repeats), "--budget", str(args.budget)]
    with emulate.emulated_hosts(hosts, link_rate=link_rate, delay_ms=delay_ms) as cluster, \
            tempfile.TemporaryDirectory(prefix="cluster-mwms-") as log_dir:
        addresses = [f"{host.address}:{BASE_PORT + slot}" for host in cluster
                     for slot in range(slots)]
        logs = [os.path.join(log_dir, f"worker{index}.log") for index in range(len(addresses))]
        procs = []
        try:
            for index, log in enumerate(logs):
                with open(log, "w") as out:
                    procs.append(cluster[index // slots].popen(
                        argv, env=worker_env(addresses, index), stdout=out,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        except BaseException:
            for proc in procs:
                proc.kill()
                proc.wait()
            raise
        failure = _wait_all(procs, args.timeout)
        outputs = []
        for log in logs:
            with open(log) as text:
                outputs.append(text.read())
    for line in outputs[0].splitlines():
        if failure is None and line.startswith("CLUSTER_SECONDS "):
            return {row: {int(k): v for k, v in by_size.items()}
                    for row, by_size in json.loads(line.split(" ", 1)[1]).items()}
    tails = "".join(f"\n--- worker {index} ({addresses[index]}), last output:\n"
                    f"{output[-LOG_TAIL_CHARS:]}" for index, output in enumerate(outputs))
    raise RuntimeError(f"MultiWorkerMirroredStrategy on {hosts}x{slots} emulated hosts, "
                       f"{link_rate}: {failure or 'worker 0 printed no result'}{tails}")

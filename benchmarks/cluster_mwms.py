"""TensorFlow's own MultiWorkerMirroredStrategy on emulated hosts: the comparison row of
benchmarks/cluster.py.

`launch()` builds the emulated hosts (the same `perseusrun.emulate` network and link rate as
the other rows), starts one TF worker per rank with a TF_CONFIG that lists every worker's
namespace address, host-major like perseusrun's ranks (so the ring crosses each host link once
each way), and returns worker 0's median seconds per allreduce by size.

What a worker times is the collective the strategy runs for gradients: a tf.function calling
`strategy.run` of `get_replica_context().all_reduce(SUM, t)` with
CommunicationImplementation.RING on the CPU. The function returns the reduced tensor's first
and last elements, which cannot exist before the whole reduction is done and cost nothing to
fetch; the warm-up call checks them against the sum the workers' inputs must give.
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

# Each emulated host has its own network namespace, so ports only differ between the workers
# that share a host.
BASE_PORT = 23450
INTER_OP_THREADS = 2  # as the Session of the TF op rows (benchmarks/allreduce.py)
# gRPC would route worker-to-worker traffic through a proxy named in these.
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")
LOG_TAIL_CHARS = 3000


def worker(sizes: list, repeats: int, budget_s: float) -> None:
    """One MWMS worker (TF_CONFIG set); worker 0 prints `CLUSTER_SECONDS {"mwms": {...}}`."""
    import numpy as np
    import tensorflow as tf
    from timing import timed  # benchmarks/timing.py: this script's directory is on sys.path

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    ring = tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=ring))
    task = strategy.cluster_resolver.task_id
    workers = strategy.num_replicas_in_sync
    sum_op = tf.distribute.ReduceOp.SUM

    def all_reduce_ends(tensor: tf.Tensor):
        """A tf.function: SUM-allreduce of `tensor` across workers, returns [first, last]."""
        @tf.function
        def step() -> tf.Tensor:
            def replica_fn() -> tf.Tensor:
                # A tensor, not the variable itself: a variable would be taken as the
                # reduction's destination.
                return tf.distribute.get_replica_context().all_reduce(
                    sum_op, tf.identity(tensor))
            reduced = strategy.experimental_local_results(strategy.run(replica_fn))[0]
            return tf.stack([reduced[0], reduced[-1]])
        return step

    # Worker 0's value on every worker (the others add 0); a collective, so also a barrier.
    agree_value = tf.Variable([0.0])
    agree_fn = all_reduce_ends(agree_value)

    def agree(value: int) -> int:
        agree_value.assign([float(value) if task == 0 else 0.0])
        return int(agree_fn().numpy()[0])

    def barrier() -> None:
        agree(0)

    expected = workers * (workers + 1) / 2  # worker i contributes i + 1 everywhere
    seconds = {}
    for nbytes in sizes:
        step = all_reduce_ends(tf.fill([nbytes // 4], tf.constant(task + 1, tf.float32)))
        ends = step().numpy()  # traces; the group's first collective waits for every worker
        if not np.allclose(ends, expected):
            raise RuntimeError(f"MWMS worker {task}: allreduce of {nbytes} bytes gave "
                               f"{ends.tolist()} at its ends, expected {expected}")
        seconds[nbytes] = timed({"mwms": lambda step=step: step().numpy()}, barrier, agree,
                                repeats, budget_s)["mwms"]
    barrier()  # no worker leaves while another may still pull its last chunk
    if task == 0:
        print("CLUSTER_SECONDS " + json.dumps({"mwms": seconds}), flush=True)


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

    argv = [sys.executable, os.path.abspath(__file__), "--sizes", ",".join(map(str, args.sizes)),
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


def main() -> None:
    parser = argparse.ArgumentParser(description="one MultiWorkerMirroredStrategy worker "
                                                 "of benchmarks/cluster.py (TF_CONFIG set)")
    parser.add_argument("--sizes", type=lambda text: [int(x) for x in text.split(",")],
                        required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--budget", type=float, required=True)
    args = parser.parse_args()
    worker(args.sizes, args.repeats, args.budget)


if __name__ == "__main__":
    main()

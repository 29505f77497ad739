"""One worker of TensorFlow's own MultiWorkerMirroredStrategy on emulated hosts: the comparison
row of benchmarks/cluster.py, started by bench_common/mwms.py's launch() (not by hand).

What a worker times is the collective the strategy runs for gradients: a tf.function calling
`strategy.run` of `get_replica_context().all_reduce(SUM, t)` with
CommunicationImplementation.RING on the CPU. The function returns the reduced tensor's first
and last elements, which cannot exist before the whole reduction is done and cost nothing to
fetch; the warm-up call checks them against the sum the workers' inputs must give.
"""

from __future__ import annotations

import argparse
import json

INTER_OP_THREADS = 2  # as the Session of the TF op rows (bench_common/tf_steps.py)


def worker(sizes: list, repeats: int, budget_s: float) -> None:
    """One MWMS worker (TF_CONFIG set); worker 0 prints `CLUSTER_SECONDS {"mwms": {...}}`."""
    import numpy as np
    import tensorflow as tf
    from bench_common.timing import timed  # benchmarks/ (this script's directory)

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

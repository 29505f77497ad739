"""One rank of benchmarks/allreduce.py's Horovod table (its `--horovod`): Horovod 0.28.1's own TF
allreduce op on TF 2.15.1 (the peers venv, `make peers`) in the same chained Session steps as
the main table's op (bench_common/tf_steps.py: the same Session settings, with Grappler's
dependency optimizer off, which would drop Horovod's stateless op from the chain).
allreduce.py starts it under the peers venv's mpirun (MPI controller and operations); rank 0
prints `HOROVOD_SECONDS {bytes: seconds per allreduce}`.
"""

from __future__ import annotations

import argparse
import json

import horovod.tensorflow as hvd
import tensorflow as tf
from bench_common.tf_steps import tf_allreduce_step
from bench_common.timing import timed


def horovod_allreduce(tensor, name):
    return hvd.allreduce(tensor, op=hvd.Sum, name=name)


def agree(value: int) -> int:
    """Rank 0's `value` on every rank (an eager Horovod broadcast); also a barrier."""
    return int(hvd.broadcast(tf.constant([value], tf.int64), 0, name="agree").numpy()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda text: [int(x) for x in text.split(",")],
                        required=True)
    parser.add_argument("--chain", type=int, required=True)
    parser.add_argument("--repeats", type=int, required=True)
    parser.add_argument("--budget", type=float, required=True)
    args = parser.parse_args()
    hvd.init()
    seconds = {}
    for nbytes in args.sizes:
        step = tf_allreduce_step([[nbytes // 4]], args.chain, allreduce=horovod_allreduce)
        times = timed({"op": step}, lambda: agree(0), agree, args.repeats, args.budget,
                      warmups=3, most_calls=500)
        seconds[nbytes] = times["op"] / args.chain
    if hvd.rank() == 0:
        print("HOROVOD_SECONDS " + json.dumps(seconds), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

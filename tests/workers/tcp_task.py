"""One hand-started TF_CONFIG task (no launcher) for tests/test_tcp.py.

    tcp_task.py group   ranks allreduce against numpy; the evaluator checks it is no rank;
                        then rank 2 is killed while the others wait in an allreduce, and they
                        print the error and when it came
    tcp_task.py init    init() only (for failures at start-up); prints the error and exits 3
    tcp_task.py sum     one allreduce against numpy (also with PERSEUS_TCP_* instead of
                        TF_CONFIG, for tests/test_tcp_rendezvous.py)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
from worker_util import assert_close, fail, rank_data

from perseus_legacy import _core
from perseus_legacy.common import basics, tf_config


def allreduce_sum(rank: int, size: int) -> None:
    data = [rank_data(r, (1000, 3), "float32", seed=7) for r in range(size)]
    got = _core.allreduce(data[rank], "tf_config.sum", op=basics.Sum)
    assert_close(rank, "tf_config.sum", got, np.sum(data, axis=0), rtol=1e-6)


def group(rank: int, size: int) -> None:
    allreduce_sum(rank, size)
    # Larger than a ring segment per rank times the reduce chunk: the pipelined path.
    big = [rank_data(r, (3 << 20,), "float64", seed=8) for r in range(size)]
    got = _core.allreduce(big[rank], "tf_config.big", op=basics.Average)
    assert_close(rank, "tf_config.big", got, np.mean(big, axis=0), rtol=1e-12)
    import mpi4py

    mpi4py.rc.initialize = mpi4py.rc.finalize = False  # only ask; Is_initialized needs no init
    from mpi4py import MPI

    if MPI.Is_initialized():
        fail(rank, "MPI was initialized in a TCP job")
    print(f"[rank {rank}] tf_config group OK size={size} local_rank={_core.local_rank()} "
          f"local_size={_core.local_size()} controller={_core.build_info()['controller']}",
          flush=True)


def dead(rank: int) -> None:
    _core.allreduce(np.ones(2), "before", op=basics.Sum)
    if rank == 2:
        # Dies with a large allreduce just submitted, so the others may be inside the ring.
        threading.Thread(target=_core.allreduce, args=(np.ones(1 << 22), "never"),
                         daemon=True).start()
        print(f"[rank 2] KILLED_AT {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        _core.allreduce(np.ones(1 << 22), "never")
    except RuntimeError as exc:
        print(f"[rank {rank}] FAILED_AT {time.time():.3f}: {exc}", flush=True)
        return
    fail(rank, "UNEXPECTED: the allreduce completed without rank 2")


def main() -> None:
    mode = sys.argv[1]
    cluster = tf_config.cluster_from_env()
    if cluster is None:
        sys.exit("tcp_task.py needs TF_CONFIG")
    if not cluster.is_rank:
        try:
            basics.init()
        except tf_config.TFConfigError as exc:
            print(f"[{cluster.task_type}] not a rank; init() refused: {exc}", flush=True)
            return
        sys.exit(f"[{cluster.task_type}] UNEXPECTED: init() accepted a task that is no rank")
    try:
        basics.init()
    except RuntimeError as exc:
        print(f"[rank {cluster.rank}] INIT FAILED: {exc}", flush=True)
        sys.exit(3)
    if mode == "group":
        group(_core.rank(), _core.size())
        dead(_core.rank())
    elif mode == "sum":
        allreduce_sum(_core.rank(), _core.size())
        print(f"[rank {_core.rank()}] sum OK size={_core.size()}", flush=True)
    _core.shutdown()


if __name__ == "__main__":
    main()

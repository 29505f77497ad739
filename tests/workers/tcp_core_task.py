"""One rank of a TCP job started by hand, through the native core alone (no TensorFlow import,
so it starts in a fraction of a second), for tests/test_tcp_rendezvous.py.

    tcp_core_task.py init   init only; prints `[rank r] INIT OK` or the error and exits 3
    tcp_core_task.py sum    then one allreduce against numpy: `[rank r] sum OK size=n`

Reads the variables `perseusrun --tcp` sets (PERSEUS_TCP_RANK, PERSEUS_TCP_ADDRESSES,
PERSEUS_SECRET, PERSEUS_START_TIMEOUT).
"""

from __future__ import annotations

import os
import sys

import numpy as np
from worker_util import assert_close, init_core, load_core, rank_data


def main() -> None:
    core = load_core()
    rank = int(os.environ["PERSEUS_TCP_RANK"])
    addresses = os.environ["PERSEUS_TCP_ADDRESSES"].split(",")
    try:
        init_core(core)
    except RuntimeError as exc:
        print(f"[rank {rank}] INIT FAILED: {exc}", flush=True)
        sys.exit(3)
    print(f"[rank {rank}] INIT OK", flush=True)
    if sys.argv[1] == "sum":
        data = [rank_data(r, (1000, 3), "float32", seed=7) for r in range(len(addresses))]
        got = core.allreduce(data[rank], "core_task.sum", op=1)
        assert_close(rank, "core_task.sum", got, np.sum(data, axis=0), rtol=1e-6)
        print(f"[rank {rank}] sum OK size={len(addresses)}", flush=True)
    core.shutdown()


if __name__ == "__main__":
    main()

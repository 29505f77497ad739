"""Rank 1 is killed (SIGKILL) while rank 0 waits in an allreduce: the launcher must end the job
with a non-zero status instead of leaving rank 0 waiting forever."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from perseus_legacy import _core
from perseus_legacy.common import basics


def main() -> None:
    basics.init()
    rank = _core.rank()
    _core.allreduce(np.ones(2), "before", op=1)
    if rank == 1:
        print(f"[rank 1] KILLED_AT {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"[rank {rank}] waiting for the killed rank", flush=True)
    _core.allreduce(np.ones(2), "never")
    print(f"[rank {rank}] UNEXPECTED: allreduce completed without rank 1", flush=True)


if __name__ == "__main__":
    main()

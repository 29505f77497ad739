"""Steps of allreduces (fused), an allgather and a broadcast under PERSEUS_TIMELINE.

`run`: every rank finishes and shuts down (which closes its timeline file).
`kill`: the last rank kills itself with SIGKILL once its file holds an allreduce event; the
others fail (the test expects the job to fail and reads the killed rank's file).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from worker_util import assert_close, fail

import perseus_legacy as hvd
from perseus_legacy import _core

SUM = 1
NAMES = ["tl.a", "tl.b", "tl.c"]
STEPS = 3


def step(rank: int, size: int, s: int) -> None:
    got = _core.grouped_allreduce([np.full(4, float(rank + s + i)) for i in range(len(NAMES))],
                                  NAMES, op=SUM)
    for i, out in enumerate(got):
        assert_close(rank, NAMES[i], out, np.full(4, float(sum(range(size)) + size * (s + i))))


def wait_for_event(path: str, needle: str, limit: float = 30.0) -> None:
    """Until the writer thread has flushed an event containing `needle` (a bounded wait)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with open(path) as f:
            if needle in f.read():
                return
        time.sleep(0.05)  # the poll interval of a condition on the file, bounded by `limit`
    fail(hvd.rank(), f"{path} never showed {needle}")


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mode = sys.argv[1]
    for s in range(STEPS):
        step(rank, size, s)
    gathered = _core.allgather(np.full((rank + 1, 2), rank, np.int32), "tl.gather")
    assert_close(rank, "tl.gather", gathered,
                 np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(size)]))
    got = _core.broadcast(np.full(3, rank, np.int64), 0, "tl.bcast")
    assert_close(rank, "tl.bcast", got, np.zeros(3, np.int64))
    if mode == "kill":
        if rank == size - 1:
            base, ext = os.path.splitext(os.environ["PERSEUS_TIMELINE"])
            wait_for_event(f"{base}.rank{rank}{ext}", "_BROADCAST")
            os.kill(os.getpid(), signal.SIGKILL)
        for s in range(STEPS, STEPS + 1000):  # fails once the killed rank is noticed
            step(rank, size, s)
        fail(rank, "the other rank was killed, yet every step succeeded")
    print(f"[rank {rank}] timeline {mode} OK", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()

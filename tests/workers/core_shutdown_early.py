"""Rank 1 leaves early (returns from main: the atexit hook shuts it down) while the other ranks
wait in an allreduce it never joins: they must get an error naming rank 1, not hang."""

from __future__ import annotations

import numpy as np
from worker_util import assert_close, fail

from perseus_legacy import _core
from perseus_legacy.common import basics


def main() -> None:
    basics.init()
    rank, size = _core.rank(), _core.size()
    got = _core.allreduce(np.ones(2), "before", op=1)
    assert_close(rank, "before", got, np.full(2, float(size)))
    if rank == 1:
        print("[rank 1] leaving without joining late.x", flush=True)
        return
    for attempt in ("late.x", "later.y"):
        try:
            _core.allreduce(np.ones(2), attempt)
        except RuntimeError as exc:
            # "late.x" was usually pending when rank 1 left; had rank 1's exit been negotiated
            # first, the submission itself is refused. Both must name rank 1. Over TCP the
            # closed connection may be seen before rank 1's goodbye is read.
            if not any(f"rank 1{how}" in str(exc)
                       for how in (" shut down", " (127.0.0.1:")):
                fail(rank, f"{attempt}: the error does not name rank 1: {exc}")
            print(f"[rank {rank}] {attempt}: {exc}", flush=True)
        else:
            fail(rank, f"{attempt} succeeded although rank 1 left")
    _core.shutdown()


if __name__ == "__main__":
    main()

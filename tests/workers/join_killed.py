"""The last rank is killed (SIGKILL) while the others wait in join(): the job must end with a
non-zero status naming it, instead of leaving the others waiting forever."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import perseus_legacy as pl
from perseus_legacy import _core


def main() -> None:
    pl.init()
    rank, size = pl.rank(), pl.size()
    _core.allreduce(np.ones(2), "before", op=pl.Sum)
    if rank == size - 1:
        # Killed only once the others have joined: "while_joined" completes only then.
        _core.allreduce(np.ones(2), "while_joined", op=pl.Sum)
        print(f"[rank {rank}] KILLED_AT {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"[rank {rank}] joining", flush=True)
    try:
        pl.join()
    except RuntimeError as exc:
        print(f"[rank {rank}] join failed: {exc}", flush=True)
        raise SystemExit(1) from exc
    print(f"[rank {rank}] UNEXPECTED: join completed without rank {size - 1}", flush=True)


if __name__ == "__main__":
    main()

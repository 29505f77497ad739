"""Rank 0 stays busy (inside ChiefGate.busy()) far longer than PERSEUS_CHIEF_WAIT_SECS: the
other ranks must give up at the sync point with an error saying so, not wait forever.

Each rank that gives up prints `[rank R] CHIEF_WAIT_FAILED after S s: <error>` and exits 1;
rank 0 exits 1 once it notices the others are gone (or after its busy time).
"""

from __future__ import annotations

import sys
import time

from perseus_legacy import _core
from perseus_legacy.common import basics
from perseus_legacy.tf1.gate import ChiefGate


def main() -> None:
    basics.init()
    rank = _core.rank()
    gate = ChiefGate("fault_chief")
    start = time.monotonic()
    if rank == 0:
        with gate.busy():
            time.sleep(30)  # the stuck evaluation, 10 times the limit
        sys.exit(1)
    try:
        gate.sync()
    except RuntimeError as exc:
        print(f"[rank {rank}] CHIEF_WAIT_FAILED after {time.monotonic() - start:.1f} s: {exc}",
              flush=True)
        sys.exit(1)
    print(f"[rank {rank}] UNEXPECTED: the sync point passed", flush=True)


if __name__ == "__main__":
    main()

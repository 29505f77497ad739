"""A 4 KiB allreduce loop in which rank 1 (or the rank given as a second argument) fails
silently after 20 steps; the others must fail with an error naming it instead of waiting forever.

    fault_rank.py stop [R [ELEMENTS]]   rank R stops itself (SIGSTOP): a frozen process, sockets
                                        still open
    fault_rank.py cut [R [ELEMENTS]]    rank R takes its host's link down (`ip link set eth0
                                        down`, emulated hosts only): an unreachable host

ELEMENTS: float32 elements of each allreduce instead of 1024.

Every surviving rank prints how many of its allreduces ran pipelined (runtime_stats), then
`[rank R] FAULT_SEEN after S s: <error>` (S: seconds since its last completed step) and exits 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

from perseus_legacy import _core
from perseus_legacy.common import basics

FAULT_STEP = 20


def fault(mode: str, rank: int) -> None:
    print(f"[rank {rank}] FAULT {mode} at step {FAULT_STEP}", flush=True)
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif mode == "cut":
        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True, timeout=30)
    else:
        sys.exit(f"unknown mode {mode!r}")


def main() -> None:
    mode = sys.argv[1]
    victim = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    elements = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    basics.init()
    rank = _core.rank()
    data = np.ones(elements, np.float32)
    last = time.monotonic()
    step = 0
    while True:
        if rank == victim and step == FAULT_STEP:
            fault(mode, rank)
        try:
            out = _core.allreduce(data, f"step.{step}", op=1)
        except RuntimeError as exc:
            pipelined = _core.runtime_stats()["pipelined_hierarchical_allreduces"]
            print(f"[rank {rank}] pipelined hierarchical allreduces: {pipelined}", flush=True)
            print(f"[rank {rank}] FAULT_SEEN after {time.monotonic() - last:.1f} s: {exc}",
                  flush=True)
            sys.exit(1)
        assert out[0] == _core.size() and out[-1] == _core.size(), (out[:4], out[-4:])
        last = time.monotonic()
        step += 1


if __name__ == "__main__":
    main()

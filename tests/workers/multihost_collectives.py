"""tests/workers/core_collectives.py on emulated hosts: the same numpy checks (every case), with
the rank layout of HOSTS hosts x SLOTS ranks (mpirun's by-slot placement) instead of one host
in the case `topology`.

Usage: multihost_collectives.py HOSTS SLOTS
"""

from __future__ import annotations

import socket
import sys

import core_collectives
from worker_util import fail

from perseus_legacy import _core

HOSTS, SLOTS = (int(a) for a in sys.argv[1:3])


def check_layout(rank: int, size: int) -> None:
    """Rank r sits on host r // SLOTS as its local rank r % SLOTS."""
    got = (_core.local_rank(), _core.local_size(), _core.cross_rank(), _core.cross_size())
    expected = (rank % SLOTS, SLOTS, rank // SLOTS, HOSTS)
    print(f"[rank {rank}] layout host={socket.gethostname()} local_rank={got[0]} "
          f"local_size={got[1]} cross_rank={got[2]} cross_size={got[3]}", flush=True)
    if size != HOSTS * SLOTS or got != expected:
        fail(rank, f"size {size}, (local_rank, local_size, cross_rank, cross_size) {got}; "
                   f"expected size {HOSTS * SLOTS} and {expected}")


if __name__ == "__main__":
    core_collectives.check_topology = check_layout
    core_collectives.main([])

"""Rank 1 of a TCP job writes a forged control frame into its connection to rank 0 (as a party
on the path could inject one).

    perseusrun --tcp -np 2 python tcp_forge.py abort|length

`abort`: an abort notice whose MAC is not the connection's. `length`: the header of a message
frame announcing 1 GiB (within the old 2 GiB bound), and nothing after it. After one allreduce,
rank 1 writes the frame into the first socket it holds to rank 0 (its control connection,
dialed before the data one) and both ranks allreduce again: each prints
`[rank r] REFUSED: <error>`, or `[rank r] UNEXPECTED: ...`.
"""

from __future__ import annotations

import os
import socket
import struct
import sys

import numpy as np
from worker_util import load_core

FORGED_TEXT = b"perseus_legacy: INJECTED abort notice"


def sockets_to(host: str, port: int) -> list[int]:
    """This process's descriptors of TCP connections to host:port, lowest first."""
    found = []
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        fd = int(name)
        try:
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if probe.type == socket.SOCK_STREAM and probe.getpeername()[:2] == (host, port):
                found.append(fd)
        except OSError:
            pass
        finally:
            probe.close()
    return found


def write_forged_frame(kind: str, address: str) -> None:
    """Writes a forged frame (`abort` or `length`, as above) into this process's first
    connection to `address` (rank 0's): its control connection."""
    host, port = address.rsplit(":", 1)
    control = sockets_to(host, int(port))[0]
    if kind == "abort":
        frame = struct.pack("<IIQ", 2, 0, len(FORGED_TEXT)) + FORGED_TEXT + os.urandom(32)
    else:
        frame = struct.pack("<IIQ", 1, 0, 1 << 30)
    os.write(control, frame)


def main() -> None:
    core = load_core()
    rank = int(os.environ["PERSEUS_TCP_RANK"])
    addresses = os.environ["PERSEUS_TCP_ADDRESSES"].split(",")
    core.init_tcp(rank, addresses, rank, len(addresses), 0, 1, os.environ["PERSEUS_SECRET"],
                  60.0)
    try:
        # Rank 0 may still be finishing "before" when rank 1 writes the frame: either of its
        # collectives is refused then.
        core.allreduce(np.ones(4), "before", op=1)
        if rank == 1:
            write_forged_frame(sys.argv[1], addresses[0])
        core.allreduce(np.ones(4), "after", op=1)
    except RuntimeError as exc:
        print(f"[rank {rank}] REFUSED: {exc}", flush=True)
        return
    print(f"[rank {rank}] UNEXPECTED: the allreduce after the forged frame completed", flush=True)


if __name__ == "__main__":
    main()

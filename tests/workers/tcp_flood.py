"""Strangers flooding a rank's TCP port during its rendezvous.

    tcp_flood.py HOST:PORT HOLD KINDS

Opens connections to HOST:PORT as fast as it can until its stdin closes, keeping at most HOLD
of them open (the oldest is closed first). KINDS is a comma-separated cycle of what each new
connection does once accepted: `idle` (nothing), `garbage` (4 KiB of noise), `claim` (a
handshake claiming rank 1 with a wrong secret). Prints `FLOODING` once the rank has accepted
one, and `FLOODED <connections>` at the end.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import sys

from tcp_impostor import claim


def stdin_closed() -> bool:
    readable, _, _ = select.select([sys.stdin], [], [], 0)
    return bool(readable) and not sys.stdin.buffer.read1(4096)


def main() -> None:
    address, hold, kinds = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    host, port = address.rsplit(":", 1)
    held: collections.deque = collections.deque()
    opened = 0
    announced = False
    while not stdin_closed():
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            select.select([sys.stdin], [], [], 0.05)  # a bounded wait while the rank starts
            continue
        kind = kinds[opened % len(kinds)]
        opened += 1
        try:
            sock.setblocking(False)
            if kind == "garbage":
                sock.send(os.urandom(4096))
            elif kind == "claim":
                sock.setblocking(True)
                sock.settimeout(5)
                hello = sock.recv(4096)
                sock.send(claim(hello, 1, 0, 2, b"not-the-secret-of-this-job"))
        except OSError:
            pass
        if not announced:
            print("FLOODING", flush=True)
            announced = True
        held.append(sock)
        while len(held) > hold:
            held.popleft().close()
    for sock in held:
        sock.close()
    print(f"FLOODED {opened}", flush=True)


if __name__ == "__main__":
    main()

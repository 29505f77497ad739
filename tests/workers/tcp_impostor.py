"""A process that is no rank of the job dials a rank's TCP address and claims to be one.

    tcp_impostor.py HOST:PORT CLAIMED_RANK CHANNEL JOB_SIZE SECRET TIMEOUT

It follows the rendezvous protocol (ops/transport/tcp_rendezvous.cc) with the given secret,
dialing until the rank listens (at most TIMEOUT seconds), and prints `VERDICT <byte> FROM
<its own address>`: byte 0 is a refusal, 1 an acceptance.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import time

MAGIC = b"PERSEUS1"
NONCE_BYTES = 32
DIGEST_BYTES = 32
HELLO_BYTES = len(MAGIC) + 4 + DIGEST_BYTES + NONCE_BYTES  # magic, rank, job digest, nonce


def job_digest(hello: bytes) -> bytes:
    """The digest of the job's address list that the listening rank's `hello` carries."""
    return hello[len(MAGIC) + 4:len(MAGIC) + 4 + DIGEST_BYTES]


def hello_nonce(hello: bytes) -> bytes:
    """The listening rank's challenge in its `hello`."""
    return hello[len(MAGIC) + 4 + DIGEST_BYTES:]


def read_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {count} bytes")
        data += chunk
    return data


def claim(hello: bytes, rank: int, channel: int, size: int, secret: bytes) -> bytes:
    """The dialer's answer to a rank's `hello`: its claimed rank, channel and job size, a
    nonce and the HMAC that proves (or, with a wrong secret, fails to prove) the secret."""
    listener_rank = hello[len(MAGIC):len(MAGIC) + 4]
    header = struct.pack("<III", rank, channel, size)
    nonce = os.urandom(NONCE_BYTES)
    mac = hmac.new(secret, b"perseus-claim" + hello_nonce(hello) + nonce + header +
                   listener_rank + job_digest(hello), hashlib.sha256).digest()
    return header + nonce + mac


def connect_when_listening(address: str, timeout: float) -> tuple[socket.socket, bytes]:
    """A connection to `address` and the hello read from it (the rank has accepted it)."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout)
            return sock, read_exactly(sock, HELLO_BYTES)
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)  # a bounded retry while the rank starts to listen


def main() -> None:
    address, rank, channel, size, secret, timeout = sys.argv[1:]
    sock, hello = connect_when_listening(address, float(timeout))
    with sock:
        sock.sendall(claim(hello, int(rank), int(channel), int(size), secret.encode()))
        verdict = sock.recv(1)
        print(f"VERDICT {verdict[0] if verdict else 'none'} FROM "
              f"{sock.getsockname()[0]}:{sock.getsockname()[1]}", flush=True)


if __name__ == "__main__":
    main()

"""Measures an emulated link from inside two emulated hosts; plain sockets, nothing else.

    link_probe.py serve ADDRESS             UDP echo on port 7000 (`count N` answers how many
                                            datagrams port 7002 took), a TCP sink on 7001
    link_probe.py measure ADDRESS WHAT...   against a server at ADDRESS; WHAT is any of
                                            rtt, loss, stream; prints one JSON line:
        rtt     round trips of 200 small datagrams, after the first answered one: min, median (ms)
        loss    2000 numbered datagrams to port 7002: the fraction that did not arrive
        stream  one TCP stream, 1 s to open its window, then bytes over 2 s (bits/s)
"""

import itertools
import json
import socket
import statistics
import sys
import threading
import time

ECHO, SINK, COUNTED = 7000, 7001, 7002
LOSS_DATAGRAMS = 2000
SO_RCVBUFFORCE = 33  # Linux's; the socket module does not name it


def serve(address: str) -> None:
    counted: set[int] = set()

    def count() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        # Room for every datagram at once (root may pass rmem_max): a counting thread slowed by
        # a busy machine must not drop any.
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        sock.bind((address, COUNTED))
        while True:
            counted.add(int(sock.recv(64)))

    def sink() -> None:
        listener = socket.create_server((address, SINK))
        while True:
            conn, _ = listener.accept()
            buffer = bytearray(1 << 20)
            while conn.recv_into(buffer):
                pass
            conn.close()

    for target in (count, sink):
        threading.Thread(target=target, daemon=True).start()
    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.bind((address, ECHO))
    print("serving", flush=True)
    while True:
        data, peer = echo.recvfrom(64)
        if data.startswith(b"count "):
            data += b" " + str(len(counted)).encode()
        echo.sendto(data, peer)


_questions = itertools.count()


def ask(sock: socket.socket, address: str, message: bytes) -> tuple[bytes, float]:
    """The answer to `message` and its round trip in ms, sending again after each lost one. Each
    question carries a number of its own: a late answer to an earlier one (sent again after 0.2
    s, then both answered) is skipped, never taken for this one's."""
    question = message + b" " + str(next(_questions)).encode()
    for _ in range(100):
        start = time.perf_counter()
        sock.sendto(question, (address, ECHO))
        while (left := 0.2 - (time.perf_counter() - start)) > 0:
            sock.settimeout(left)
            try:
                answer = sock.recv(64)
            except socket.timeout:
                break
            if answer.startswith(question):
                return answer[len(question):].strip(), (time.perf_counter() - start) * 1000
    raise SystemExit(f"no answer from {address} to 100 datagrams")


def measure(address: str, what: list[str]) -> dict:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    ask(sock, address, b"hello")  # both hosts' neighbour entries are resolved from here on
    result = {}
    if "rtt" in what:
        rtts = [ask(sock, address, b"x")[1] for _ in range(200)]
        result.update(rtt_min_ms=min(rtts), rtt_median_ms=statistics.median(rtts))
    if "loss" in what:
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for i in range(LOSS_DATAGRAMS):
            sender.sendto(str(i).encode(), (address, COUNTED))
            if i % 100 == 99:
                time.sleep(0.005)  # no queue in the sender's or receiver's kernel overflows
        counted, deadline = -1, time.monotonic() + 10
        while time.monotonic() < deadline:  # until the count stops growing: all have arrived
            time.sleep(0.3)  # the polling interval of a bounded wait
            now = int(ask(sock, address, b"count")[0])
            if now == counted:
                break
            counted = now
        result["loss"] = 1 - counted / LOSS_DATAGRAMS
    if "stream" in what:
        stream = socket.create_connection((address, SINK))
        chunk = memoryview(bytearray(1 << 20))
        for seconds, key in ((1.0, None), (2.0, "stream_bits_per_second")):
            sent, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                stream.sendall(chunk)
                sent += len(chunk)
            if key:
                result[key] = sent * 8 / (time.perf_counter() - start)
        stream.close()
    return result


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        print(json.dumps(measure(sys.argv[2], sys.argv[3:])), flush=True)

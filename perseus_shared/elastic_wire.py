"""The elastic driver's wire: perseusrun/elastic_driver.py <-> common/elastic_client.py.

One request per connection, each message one JSON line. The driver opens with a nonce; the
worker's request carries HMAC-SHA-256(secret, driver nonce + request) and a nonce of its own,
which the answer's HMAC covers: both sides prove the job secret, no message can be replayed.
"""

from __future__ import annotations

import hmac
import json
import socket

ELASTIC_MAX_LINE = 1 << 20  # an answer (its addresses grow with the ranks)
ELASTIC_MAX_REQUEST = 1 << 14  # a worker's request: a few names and numbers
# What the driver sends every KEEPALIVE_SECONDS while a worker waits for its round: an empty line.
KEEPALIVE = b"\n"
KEEPALIVE_SECONDS = 1.0


def elastic_mac(secret: str, nonce: str, body: str) -> str:
    """HMAC-SHA-256 of `nonce + body` under the job secret, hex."""
    return hmac.new(secret.encode(), (nonce + body).encode(), "sha256").hexdigest()


def elastic_send(sock: socket.socket, secret: str, nonce: str, message: dict) -> None:
    """Sends `message` as one JSON line with its MAC over `nonce`."""
    body = json.dumps(message, sort_keys=True)
    line = json.dumps({"body": body, "mac": elastic_mac(secret, nonce, body)}) + "\n"
    sock.sendall(line.encode())


def elastic_receive(reader, secret: str, nonce: str, what: str) -> dict:
    """Reads one JSON line from the file `reader`, skipping the empty lines the driver sends
    while a worker waits (KEEPALIVE); ValueError naming `what` when it is missing, malformed or
    its MAC is not the job secret's over `nonce`."""
    line = KEEPALIVE.decode()
    while line == KEEPALIVE.decode():
        line = reader.readline(ELASTIC_MAX_LINE)
    if not line:
        raise ValueError(f"{what}: the connection closed before a message")
    return elastic_open(line, secret, nonce, what)


def elastic_open(line: str | bytes, secret: str, nonce: str, what: str) -> dict:
    """The message of one received line; ValueError naming `what` when it is malformed (deeply
    nested JSON included) or its MAC is not the job secret's over `nonce`."""
    try:
        outer = json.loads(line)
        body, mac = outer["body"], outer["mac"]
        if not isinstance(body, str):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ValueError(f"{what}: not a message of the elastic driver's protocol") from None
    if not hmac.compare_digest(str(mac), elastic_mac(secret, nonce, body)):
        raise ValueError(f"{what}: the message does not prove the job secret (PERSEUS_SECRET)")
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        message = None
    if not isinstance(message, dict):
        raise ValueError(f"{what}: its body is not a JSON object")
    return message

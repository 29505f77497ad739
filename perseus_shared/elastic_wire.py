"""The elastic driver's wire: perseusrun/elastic_driver.py <-> common/elastic_client.py.

One request per connection, each message one JSON line. The driver opens with a nonce; the
worker's request carries HMAC-SHA-256(secret, driver nonce + request) and a nonce of its own,
which the answer's HMAC covers: both sides prove the job secret, no message can be replayed.
"""

from __future__ import annotations

import hmac
import json
import socket

ELASTIC_MAX_LINE = 1 << 20


def elastic_mac(secret: str, nonce: str, body: str) -> str:
    """HMAC-SHA-256 of `nonce + body` under the job secret, hex."""
    return hmac.new(secret.encode(), (nonce + body).encode(), "sha256").hexdigest()


def elastic_send(sock: socket.socket, secret: str, nonce: str, message: dict) -> None:
    """Sends `message` as one JSON line with its MAC over `nonce`."""
    body = json.dumps(message, sort_keys=True)
    line = json.dumps({"body": body, "mac": elastic_mac(secret, nonce, body)}) + "\n"
    sock.sendall(line.encode())


def elastic_receive(reader, secret: str, nonce: str, what: str) -> dict:
    """Reads one JSON line from the file `reader`; ValueError naming `what` when it is missing,
    malformed or its MAC is not the job secret's over `nonce`."""
    line = reader.readline(ELASTIC_MAX_LINE)
    if not line:
        raise ValueError(f"{what}: the connection closed before a message")
    try:
        outer = json.loads(line)
        body, mac = outer["body"], outer["mac"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{what}: not a message of the elastic driver's protocol") from None
    if not hmac.compare_digest(str(mac), elastic_mac(secret, nonce, str(body))):
        raise ValueError(f"{what}: the message does not prove the job secret (PERSEUS_SECRET)")
    return json.loads(body)

"""A worker's side of perseusrun's elastic driver (perseusrun.elastic_driver): each round's rank,
size and addresses, whether hosts changed, and the heartbeat that tells the driver this process
still runs. Framework-free: basics.init() asks it for the group to join.

The driver runs in the launcher when `perseusrun --tcp` is elastic (--min-np, --max-np or
--host-discovery-script); it sets PERSEUS_ELASTIC_DRIVER and PERSEUS_ELASTIC_WORKER on every
worker it starts. Every message proves the job secret (perseus_shared/elastic_wire.py).
"""

from __future__ import annotations

import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass

import perseus_env
from perseus_env import ELASTIC_DRIVER_VARIABLE, ELASTIC_WORKER_VARIABLE
from perseus_shared import elastic_wire

# A worker sends a heartbeat this often; the driver counts a worker silent for a few as lost.
HEARTBEAT_SECONDS = 0.5
CONNECT_SECONDS = 10.0


class ElasticExit(SystemExit):
    """The driver ended this worker: the job finished without it, its host was removed, or too
    few ranks remain. SystemExit, so that the process ends with `code` and the driver's reason."""


@dataclass(frozen=True)
class Assignment:
    """This worker's place in one round of the group."""

    round: int
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    addresses: tuple[str, ...]


_state: dict = {"round": 0, "heartbeat": None}


def enabled() -> bool:
    """Whether this process was started by perseusrun in elastic mode."""
    return bool(perseus_env.read(ELASTIC_DRIVER_VARIABLE))


def current_round() -> int:
    """The round this worker joined last (0: none yet)."""
    return int(_state["round"])


def _driver() -> tuple[str, int]:
    text = perseus_env.read(ELASTIC_DRIVER_VARIABLE) or ""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ELASTIC_DRIVER_VARIABLE}={text!r}: expected host:port")
    return host, int(port)


def _worker() -> str:
    name = perseus_env.read(ELASTIC_WORKER_VARIABLE)
    if not name:
        raise ValueError(f"{ELASTIC_WORKER_VARIABLE} is unset: perseusrun sets it on each worker")
    return name


def _connect(timeout: float | None) -> tuple[socket.socket, object, str]:
    sock = socket.create_connection(_driver(), timeout=CONNECT_SECONDS)
    sock.settimeout(timeout)
    reader = sock.makefile("r", encoding="utf-8")
    nonce = reader.readline(256).strip()
    return sock, reader, nonce


def request(message: dict, secret: str, timeout: float | None = None) -> dict:
    """Sends one request to the driver and returns its answer (blocks until it comes)."""
    sock, reader, nonce = _connect(timeout)
    try:
        mine = secrets.token_hex(16)
        elastic_wire.elastic_send(sock, secret, nonce, {**message, "worker": _worker(),
                                                       "nonce": mine})
        return elastic_wire.elastic_receive(reader, secret, mine, "the elastic driver's answer")
    finally:
        reader.close()
        sock.close()


def _heartbeat(secret: str) -> None:
    while True:
        try:
            sock, reader, nonce = _connect(None)
            elastic_wire.elastic_send(sock, secret, nonce, {"op": "heartbeat",
                                                           "worker": _worker(), "nonce": ""})
            while True:
                sock.sendall(b".")
                time.sleep(HEARTBEAT_SECONDS)
        except OSError:
            time.sleep(HEARTBEAT_SECONDS)  # the driver is unreachable: try again


def _start_heartbeat(secret: str) -> None:
    if _state["heartbeat"] is None:
        thread = threading.Thread(target=_heartbeat, args=(secret,), daemon=True,
                                  name="perseus-elastic-heartbeat")
        thread.start()
        _state["heartbeat"] = thread


def join(secret: str) -> Assignment:
    """Waits for the driver's next round (after the one this worker joined last) and returns
    this worker's place in it. ElasticExit when the driver ends this worker instead."""
    _start_heartbeat(secret)
    answer = request({"op": "rendezvous", "round": current_round()}, secret)
    if "exit" in answer:
        print(f"perseus_legacy elastic worker {_worker()}: {answer['exit']}", file=sys.stderr,
              flush=True)
        raise ElasticExit(int(answer.get("code", 1)))
    _state["round"] = int(answer["round"])
    return Assignment(round=int(answer["round"]), rank=int(answer["rank"]),
                      size=int(answer["size"]), local_rank=int(answer["local_rank"]),
                      local_size=int(answer["local_size"]), cross_rank=int(answer["cross_rank"]),
                      cross_size=int(answer["cross_size"]),
                      addresses=tuple(answer["addresses"]))


def hosts_updated(secret: str) -> bool:
    """Whether the driver has workers to add or remove since this worker's round."""
    return bool(request({"op": "poll", "round": current_round()}, secret,
                        timeout=CONNECT_SECONDS)["updated"])


def describe() -> str:
    """This worker's name and round, for messages."""
    return f"worker {perseus_env.read(ELASTIC_WORKER_VARIABLE) or '?'} (round {current_round()})"

"""A worker's side of perseusrun's elastic driver (perseusrun.elastic_driver): each round's rank,
size and addresses, whether hosts changed, and the heartbeat that tells the driver this process
still runs. Framework-free: basics.init() asks it for the group to join.

The driver runs in the launcher when `perseusrun --tcp` is elastic (--min-np, --max-np or
--host-discovery-script); it sets PERSEUS_ELASTIC_DRIVER and PERSEUS_ELASTIC_WORKER on every
worker it starts. Every message proves the job secret (perseus_shared/elastic_wire.py).
"""

from __future__ import annotations

import os
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
# A worker waiting for its round hears from the driver every KEEPALIVE_SECONDS; silence this long
# means the driver is gone or cut off.
SILENT_DRIVER_SECONDS = 10.0
# The driver refusing connections this long (its perseusrun ended, even by SIGKILL), or silent
# this long, ends the worker: nothing else would.
DRIVER_REFUSED_SECONDS = 2.0
DRIVER_GONE_EXIT_CODE = 1


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


def _connect(timeout: float) -> tuple[socket.socket, object, str]:
    sock = socket.create_connection(_driver(), timeout=CONNECT_SECONDS)
    try:
        reader = sock.makefile("r", encoding="utf-8")
        nonce = reader.readline(256).strip()
        if not nonce:
            raise ConnectionResetError(f"the elastic driver at {_address()} closed the "
                                       "connection before its nonce")
        sock.settimeout(timeout)
        return sock, reader, nonce
    except BaseException:
        sock.close()
        raise


def _address() -> str:
    return perseus_env.read(ELASTIC_DRIVER_VARIABLE) or "?"


def request(message: dict, secret: str, timeout: float = SILENT_DRIVER_SECONDS) -> dict:
    """Sends one request to the driver and returns its answer. Blocks while the driver forms
    the round (it says so every KEEPALIVE_SECONDS); TimeoutError when it is silent for
    `timeout` seconds."""
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
    """Tells the driver every HEARTBEAT_SECONDS that this process runs; ends the process when the
    driver is gone (perseusrun ended, even by SIGKILL: its workers run in sessions of their own
    and would otherwise train on, or wait, forever)."""
    heard = refused_since = time.monotonic()
    while True:
        try:
            sock, reader, nonce = _connect(SILENT_DRIVER_SECONDS)
            with sock:
                elastic_wire.elastic_send(sock, secret, nonce, {"op": "heartbeat",
                                                               "worker": _worker(), "nonce": ""})
                while True:
                    sock.sendall(b".")
                    if not sock.recv(1):
                        raise ConnectionResetError("the driver closed the heartbeat")
                    heard = refused_since = time.monotonic()
                    time.sleep(HEARTBEAT_SECONDS)
        except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError) as exc:
            if time.monotonic() - refused_since > DRIVER_REFUSED_SECONDS:
                _driver_gone(f"it refuses connections ({exc})")
        except OSError:
            refused_since = time.monotonic()
            if time.monotonic() - heard > SILENT_DRIVER_SECONDS * 3:
                _driver_gone(f"it has not answered for {SILENT_DRIVER_SECONDS * 3:g} s")
        time.sleep(HEARTBEAT_SECONDS)  # the driver is unreachable: try again


def _driver_gone(why: str) -> None:
    try:  # the launcher that read this worker's output may be gone too
        print(f"perseus_legacy elastic worker {_worker()}: the elastic driver at {_address()} is "
              f"gone ({why}): its perseusrun has ended; this worker exits", file=sys.stderr,
              flush=True)
    finally:
        os._exit(DRIVER_GONE_EXIT_CODE)


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

"""The TCP rendezvous among strangers: idle, garbage-sending and wrong-secret connections to a
rank's port during start-up are refused and logged by that rank, and the job still forms.

Ranks are started by hand with the variables `perseusrun --tcp` sets (PERSEUS_TCP_RANK,
PERSEUS_TCP_ADDRESSES, PERSEUS_SECRET), so that the test knows their ports and can connect to
them before the last rank starts. Every process has a timeout.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

from harness import (
    ROOT,
    WORKERS,
    finish,
    launch_env,
    needs_emulation,
    rank_env,
    worker_module,
)

from perseusrun import emulate, launch

TIMEOUT = 150
IMPOSTOR = worker_module("tcp_impostor")  # the handshake as a stranger speaks it


def start_rank(rank: int, addresses: list[str], mode: str = "sum",
               host: emulate.EmulatedHost | None = None, **env) -> subprocess.Popen:
    """tcp_task.py MODE as `rank` of the job at `addresses` (on `host` when given)."""
    argv = [sys.executable, str(WORKERS / "tcp_task.py"), mode]
    return subprocess.Popen(host.command(argv) if host else argv, cwd=ROOT,
                            env=rank_env(rank, addresses, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def accepted_connection(address: str, rank: subprocess.Popen) -> socket.socket:
    """A connection that `rank` (listening at `address`) has accepted: its hello has arrived."""
    host, port = address.rsplit(":", 1)
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=30)
            IMPOSTOR.read_exactly(sock, IMPOSTOR.HELLO_BYTES)
            return sock
        except ConnectionRefusedError:
            pass
        try:  # a bounded wait while the rank starts to listen; its exit fails the test
            rank.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(f"the rank at {address} exited before listening:\n"
                             f"{rank.communicate()[0]}")


def refusal_lines(rank: int, out: str) -> list[tuple[str, str]]:
    """(address, reason) of each connection `rank`'s log says it refused."""
    return re.findall(rf"perseus_legacy\[rank {rank}\]: refused a connection from (\S+): (.*)",
                      out)


def test_job_forms_despite_idle_and_garbage_connections_and_the_ranks_log_them():
    """30 idle and 30 garbage-sending connections (an HTTP request, 4 KiB of noise, a claim
    without the secret) to rank 0 and to rank 1 while they wait for the other ranks: more than
    the 32 handshakes a rank lets wait, so the oldest idle ones are dropped for newer ones."""
    addresses = [f"127.0.0.1:{port}" for port in launch.free_local_ports(3)]
    ranks = []
    strangers: dict[int, list[socket.socket]] = {0: [], 1: []}
    names: dict[int, set[str]] = {0: set(), 1: set()}
    try:
        # Rank 1 starts after rank 0's flood (so none of its own handshakes can be dropped
        # among the strangers' and counted with them) and rank 2 after rank 1's.
        for target in (0, 1):
            ranks.append(start_rank(target, addresses))
            idle = [accepted_connection(addresses[target], ranks[target]) for _ in range(30)]
            garbage = [accepted_connection(addresses[target], ranks[target]) for _ in range(30)]
            for i, sock in enumerate(garbage):
                noise = (b"GET / HTTP/1.1\r\nHost: rank\r\n\r\n", os.urandom(4096),
                         IMPOSTOR.claim(bytes(IMPOSTOR.HELLO_BYTES), 2, 0, 3, b"x" * 32))[i % 3]
                sock.sendall(noise)
            strangers[target] = idle + garbage
            names[target] = {"{}:{}".format(*sock.getsockname()) for sock in idle + garbage}
        ranks.append(start_rank(2, addresses))
        results = finish(ranks, TIMEOUT)
    finally:
        for sock in strangers[0] + strangers[1]:
            sock.close()
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
    everything = "\n".join(out for _, out in results)
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"[rank {rank}] sum OK size=3" in out, everything
    for target in (0, 1):
        out = results[target][1]
        logged = refusal_lines(target, out)
        # One line each for the first 4 of each kind, then a count by kind.
        assert len(logged) == 12, out
        assert {address for address, _ in logged} <= names[target], out
        reasons = "\n".join(reason for _, reason in logged)
        for reason in ("dropped to make room for a newer connection (at most 32",
                       "it sent more than a handshake (76 bytes)",
                       "it sent bytes that are not a handshake of this job (a job of",
                       "authentication failed: it does not know this job's secret"):
            assert reason in reasons, out
        assert re.search(rf"perseus_legacy\[rank {target}\]: start-up refused 60 connections "
                         r"\(30 idle or closed before finishing the handshake, 20 sent bytes "
                         r"that are not a handshake of this job, 10 did not prove the job "
                         r"secret\); only the first 4 of each kind were logged one by one",
                         out), out
    assert refusal_lines(2, results[2][1]) == [], results[2][1]


def test_a_rank_with_a_wrong_secret_fails_the_job_on_every_rank_naming_it():
    """Rank 1 of 3 has another secret: rank 1 fails at once, refused by rank 0; ranks 0 and
    2 fail when the start timeout ends, each naming rank 1 as the one that did not prove the
    secret (rank 2 was refused by it, or could not reach it)."""
    addresses = [f"127.0.0.1:{port}" for port in launch.free_local_ports(3)]
    ranks = [start_rank(0, addresses, "init", start_timeout=15),
             start_rank(1, addresses, "init", start_timeout=15, secret="a-secret-of-another-job"),
             start_rank(2, addresses, "init", start_timeout=15)]
    results = finish(ranks, timeout=60)
    everything = "\n".join(out for _, out in results)
    assert [code for code, _ in results] == [3, 3, 3], everything
    (_, zero), (_, wrong), (_, two) = results
    assert "rank 0 (127.0.0.1:" in wrong and "refused the connection of rank 1: authentication " \
        "failed (PERSEUS_SECRET must be the same on every rank" in wrong, wrong
    assert re.search(r"ranks? \[?1\]? never arrived at rank 0 .* within PERSEUS_START_TIMEOUT=15 "
                     r"s; rank 1 at 127\.0\.0\.1:\d+: a connection from 127\.0\.0\.1:\d+ claiming "
                     r"to be rank 1 did not prove the job secret \(PERSEUS_SECRET differs\)",
                     zero), zero
    assert re.search(r"perseus_legacy\[rank 0\]: refused a connection from 127\.0\.0\.1:\d+: "
                     r"authentication failed: .* \(it claims to be rank 1\)", zero), zero
    assert "rank 1" in two and ("refused the connection of rank 2" in two or
                                "rank 1 never arrived" in two), two


@needs_emulation
def test_a_wrong_secret_from_another_host_is_refused_logged_with_its_address_and_the_job_forms():
    """Ranks 0 and 1 on emulated hosts A and B; from host C, before rank 1 starts, a process
    claims to be rank 1 with another secret: rank 0 refuses it, logs C's address, and the job
    forms when the real rank 1 arrives."""
    with emulate.emulated_hosts(3) as hosts:
        addresses = [f"{hosts[i].address}:{launch.EMULATED_TCP_PORT}" for i in range(2)]
        zero = start_rank(0, addresses, host=hosts[0])
        ranks = [zero]
        try:
            impostor = subprocess.run(
                hosts[2].command([sys.executable, str(WORKERS / "tcp_impostor.py"), addresses[0],
                                  "1", "1", "2", "not-the-secret-of-this-job-at-all", "60"]),
                cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=90)
            ranks.append(start_rank(1, addresses, host=hosts[1]))
            results = finish(ranks, TIMEOUT)
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
    everything = "\n".join(out for _, out in results)
    verdict = re.search(r"VERDICT (\S+) FROM (\S+)", impostor.stdout)
    assert verdict and verdict.group(1) == "0", impostor.stdout + impostor.stderr
    assert verdict.group(2).startswith(hosts[2].address + ":"), impostor.stdout
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"[rank {rank}] sum OK size=2" in out, everything
    assert refusal_lines(0, results[0][1]) == [
        (verdict.group(2), "authentication failed: it does not know this job's secret "
                           "(PERSEUS_SECRET differs) (it claims to be rank 1)")], everything

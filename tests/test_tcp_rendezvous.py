"""The TCP rendezvous among strangers: idle, garbage-sending and wrong-secret connections to a
rank's port during start-up are refused and logged by that rank, and the job still forms, even
when a real rank's claims arrive late under a flood; a stranger's refused claim never becomes the
job's failure; a peer that trickles bytes cannot hold a dialer past the start timeout; two jobs
sharing a secret cannot connect to each other.

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
import threading
import time

from harness import (
    ROOT,
    WORKERS,
    drain,
    end_processes,
    finish,
    launch_env,
    needs_emulation,
    rank_env,
    stream_lines,
    wait_for_line,
    worker_module,
)

from perseusrun import emulate, emulated_run, tcp_run

TIMEOUT = 150
IMPOSTOR = worker_module("tcp_impostor")  # the handshake as a stranger speaks it
# tcp_rendezvous.cc's kAnswerGraceSecs (1 s) and a margin: a handshake younger than that is never
# dropped for a newer connection.
ANSWER_GRACE_SECS = 1.2
CORE_TASK = "tcp_core_task.py"  # a rank without TensorFlow: starts in a fraction of a second


def start_rank(rank: int, addresses: list[str], mode: str = "sum",
               host: emulate.EmulatedHost | None = None, worker: str = "tcp_task.py",
               **env) -> subprocess.Popen:
    """`worker` MODE (tcp_task.py, or tcp_core_task.py without TensorFlow) as `rank` of the job
    at `addresses` (on `host` when given)."""
    argv = [sys.executable, str(WORKERS / worker), mode]
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
    the handshakes a rank lets wait from one address, so the oldest idle ones, older than
    ANSWER_GRACE_SECS, are dropped for newer ones."""
    addresses = [f"127.0.0.1:{port}" for port in tcp_run.free_local_ports(3)]
    ranks = []
    strangers: dict[int, list[socket.socket]] = {0: [], 1: []}
    names: dict[int, set[str]] = {0: set(), 1: set()}
    try:
        # Rank 1 starts after rank 0's flood (so none of its own handshakes can be dropped
        # among the strangers' and counted with them) and rank 2 after rank 1's.
        for target in (0, 1):
            ranks.append(start_rank(target, addresses, worker=CORE_TASK))
            idle = [accepted_connection(addresses[target], ranks[target]) for _ in range(30)]
            # A handshake younger than ANSWER_GRACE_SECS is never dropped (a newer connection is
            # refused instead): the idle ones must have had their time before the newer come.
            time.sleep(ANSWER_GRACE_SECS)  # a rule of time, not a wait for another process
            garbage = [accepted_connection(addresses[target], ranks[target]) for _ in range(30)]
            for i, sock in enumerate(garbage):
                noise = (b"GET / HTTP/1.1\r\nHost: rank\r\n\r\n", os.urandom(4096),
                         IMPOSTOR.claim(bytes(IMPOSTOR.HELLO_BYTES), 2, 0, 3, b"x" * 32))[i % 3]
                sock.sendall(noise)
            strangers[target] = idle + garbage
            names[target] = {"{}:{}".format(*sock.getsockname()) for sock in idle + garbage}
        ranks.append(start_rank(2, addresses, worker=CORE_TASK))
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
    # Pending handshakes from 127.0.0.1 (the ranks' own address) wait 32 at once beyond the
    # connections the ranks dialing the target make (rank 0: 2 x 2, rank 1: 1): of the 60 opened
    # before any sends, the oldest idle ones were dropped for the newer ones.
    dropped = {0: 60 - 36, 1: 60 - 33}
    for target in (0, 1):
        out = results[target][1]
        logged = refusal_lines(target, out)
        # One line each for the first 4 of each kind, then a count by kind.
        assert len(logged) == 12 + min(4, 30 - dropped[target]), out
        assert {address for address, _ in logged} <= names[target], out
        reasons = "\n".join(reason for _, reason in logged)
        for reason in ("dropped to make room for a newer connection from the same address "
                       "(at most ",
                       "it sent more than a handshake (76 bytes)",
                       "it sent bytes that are not a handshake of this job (a job of",
                       "authentication failed: it does not know this job's secret"):
            assert reason in reasons, out
        assert (f"perseus_legacy[rank {target}]: start-up refused 60 connections "
                f"({30 - dropped[target]} idle or closed before finishing the handshake, "
                f"{dropped[target]} dropped for newer connections from the same address, 20 sent "
                "bytes that are not a handshake of this job, 10 did not prove the job secret); "
                "only the first 4 of each kind were logged one by one") in out, out
    assert refusal_lines(2, results[2][1]) == [], results[2][1]


def test_a_rank_with_a_wrong_secret_fails_the_job_on_every_rank_naming_it():
    """Rank 1 of 3 has another secret: rank 1 fails at once, refused by rank 0; ranks 0 and
    2 fail when the start timeout ends, each naming rank 1 as the one that did not prove the
    secret (rank 2 was refused by it, or could not reach it)."""
    addresses = [f"127.0.0.1:{port}" for port in tcp_run.free_local_ports(3)]
    ranks = [start_rank(0, addresses, "init", worker=CORE_TASK, start_timeout=15),
             start_rank(1, addresses, "init", worker=CORE_TASK, start_timeout=15,
                        secret="a-secret-of-another-job"),
             start_rank(2, addresses, "init", worker=CORE_TASK, start_timeout=15)]
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
        addresses = [f"{hosts[i].address}:{emulated_run.EMULATED_TCP_PORT}" for i in range(2)]
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


# ---- claims that arrive late, strangers' claims, trickling peers, other jobs --------------------

def name_host(host: emulate.EmulatedHost, name: str, address: str) -> None:
    """Inside emulated `host`, `name` resolves to `address` (its /etc/hosts)."""
    with open(emulate.NETNS_ETC / host.namespace / "hosts", "a") as hosts:
        hosts.write(f"{address} {name}\n")


@needs_emulation
def test_a_rank_whose_claims_arrive_late_joins_through_a_flood_from_strangers_and_its_host():
    """Rank 0 on host A; rank 1 on host B reaches it through a proxy that delays everything
    rank 1 sends by 0.5 s, so each of its claims arrives half a second after rank 0 accepted the
    connection. Meanwhile host C floods rank 0 (hundreds of connections, idle, garbage and
    wrong-secret claims, far more than 32 per half second) and host B, rank 1's own address,
    sends garbage and wrong-secret claims and holds a few idle connections. Pending handshakes
    are counted per source, so the strangers of C only drop each other and the job forms."""
    port = emulated_run.EMULATED_TCP_PORT
    with emulate.emulated_hosts(3) as hosts:
        zero, one, stranger = hosts
        # The same address list on both ranks: rank0host is rank 0 on A, and on B the proxy.
        addresses = [f"rank0host:{port}", f"{one.address}:{port + 1}"]
        name_host(zero, "rank0host", zero.address)
        name_host(one, "rank0host", one.address)
        target = f"{zero.address}:{port}"
        procs = []

        def start(host: emulate.EmulatedHost, argv: list, env: dict | None = None):
            procs.append(subprocess.Popen(host.command([sys.executable, *map(str, argv)]),
                                          cwd=ROOT, env=env or launch_env(),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
            return procs[-1]

        try:
            rank0 = start(zero, [WORKERS / CORE_TASK, "sum"], rank_env(0, addresses))
            flood = start(stranger, [WORKERS / "tcp_flood.py", target, 400,
                                     "idle,idle,garbage,claim"])
            own = start(one, [WORKERS / "tcp_flood.py", target, 8, "garbage,claim,idle"])
            flooders = [(stream_lines(proc.stdout), []) for proc in (flood, own)]
            for lines, seen in flooders:
                wait_for_line(lines, "FLOODING", 60, seen)
            proxy = start(one, [WORKERS / "delay_proxy.py", f"{one.address}:{port}", target,
                                0.5])
            wait_for_line(stream_lines(proxy.stdout), "PROXY READY", 60, [])
            rank1 = start(one, [WORKERS / CORE_TASK, "sum"], rank_env(1, addresses))
            results = finish([rank0, rank1], TIMEOUT)
            for proc in (flood, own, proxy):
                proc.stdin.close()
            # They end with their stdin.
            floods = ["".join(seen + drain(lines)) for lines, seen in flooders]
        finally:
            end_processes(procs)
    everything = "\n".join(out for _, out in results)
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"[rank {rank}] sum OK size=2" in out, everything
    opened = [int(re.search(r"FLOODED (\d+)", out).group(1)) for out in floods]
    assert opened[0] > 100 and opened[1] > 10, floods
    # C's flood turned the strangers' slots over many times while rank 1's handshakes waited:
    # newer connections dropped the older ones, or were refused while those were younger than
    # 1 s (either, as the flood's pace and the load make it).
    assert re.search(r"(dropped to make room for a newer connection|refused: 32 handshakes) "
                     r"from (the same address \(at most 32 handshakes wait at once from )?"
                     r"addresses of no rank", results[0][1]), everything
    turned = sum(int(count) for count in re.findall(
        r"(\d+) (?:dropped for newer connections|refused while the handshakes) from the same "
        r"address", results[0][1]))
    assert turned > 100, everything


def test_a_job_on_one_host_forms_through_a_flood_of_100_connections_from_its_own_address():
    """Every rank of a one-host job dials from 127.0.0.1, which a local flood shares: 100
    connections held open and replaced as fast as they can be while ranks 1 and 2 join rank 0.
    A handshake younger than 1 s is never dropped for a newer connection (the newer one is
    refused), so a rank's handshake waits for its claim however fast the flood comes; before,
    32 newer connections pushed it out before its claim was read, on every try, until the start
    timeout."""
    addresses = [f"127.0.0.1:{port}" for port in tcp_run.free_local_ports(3)]
    procs = []
    try:
        procs.append(start_rank(0, addresses, worker=CORE_TASK))
        flood = subprocess.Popen([sys.executable, str(WORKERS / "tcp_flood.py"), addresses[0],
                                  "100", "idle"], cwd=ROOT, env=launch_env(),
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        procs.append(flood)
        flood_lines = stream_lines(flood.stdout)
        wait_for_line(flood_lines, "FLOODING", 60, [])
        procs += [start_rank(rank, addresses, worker=CORE_TASK) for rank in (1, 2)]
        results = finish(procs[:1] + procs[2:], TIMEOUT)
        flood.stdin.close()
        flooded = wait_for_line(flood_lines, "FLOODED", 60, [])  # it ends with its stdin
    finally:
        end_processes(procs)
    everything = "\n".join(out for _, out in results)
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"[rank {rank}] sum OK size=3" in out, everything
    opened = re.search(r"FLOODED (\d+)", flooded)
    assert opened and int(opened.group(1)) > 100, flooded
    refusals = re.search(r"start-up refused (\d+) connections", results[0][1])
    assert refusals and int(refusals.group(1)) > 0, everything
    print(f"the flood opened {opened.group(1)} connections; rank 0 refused "
          f"{refusals.group(1)}")


def test_64_ranks_behind_a_resolver_that_answers_in_1_s_form_well_within_the_start_timeout():
    """64 ranks on 127.0.0.1 whose every name lookup answers 1 s late
    (PERSEUS_DEBUG_RESOLVE_SECS=1), with a 60 s start timeout. Each process looks each distinct
    name up once, the accept loop all of them at once: before, rank 0 looked up each higher
    rank's name in turn (1 + 63 s: past the timeout) and every rank looked up each rank it
    dialed (up to 64 s)."""
    addresses = [f"127.0.0.1:{port}" for port in tcp_run.free_local_ports(64)]
    ranks = []
    try:
        for rank in range(64):
            env = {**rank_env(rank, addresses, start_timeout=60),
                   "PERSEUS_DEBUG_RESOLVE_SECS": "1"}
            ranks.append(subprocess.Popen(
                [sys.executable, str(WORKERS / CORE_TASK), "init"], cwd=ROOT, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        start = time.monotonic()
        results = finish(ranks, TIMEOUT)
        print(f"64 ranks formed in {time.monotonic() - start:.1f} s behind a 1 s resolver")
    finally:
        end_processes(ranks)
    everything = "\n".join(out for _, out in results)
    for rank, (code, out) in enumerate(results):
        assert code == 0 and f"[rank {rank}] INIT OK" in out, everything


def test_a_strangers_failed_claim_is_logged_but_never_the_jobs_failure():
    """Rank 1 (127.0.0.2) never starts; a stranger from 127.0.0.1 claims to be rank 1 with
    another secret. Rank 0 logs the refusal, and its start-up failure names rank 1 as never
    arrived, not the stranger's claim."""
    ports = tcp_run.free_local_ports(2)
    addresses = [f"127.0.0.1:{ports[0]}", f"127.0.0.2:{ports[1]}"]
    rank0 = start_rank(0, addresses, "init", worker=CORE_TASK, start_timeout=4)
    try:
        sock, hello = IMPOSTOR.connect_when_listening(addresses[0], timeout=60)
        with sock:
            sock.sendall(IMPOSTOR.claim(hello, 1, 0, 2, b"not-the-secret-of-this-job-at-all"))
            verdict = IMPOSTOR.read_exactly(sock, 1)
        [(code, out)] = finish([rank0], 60)
    finally:
        end_processes([rank0])
    assert verdict == b"\0", out
    assert re.search(r"perseus_legacy\[rank 0\]: refused a connection from 127\.0\.0\.1:\d+: "
                     r"authentication failed: .* \(it claims to be rank 1\)", out), out
    failure = re.search(r"\[rank 0\] INIT FAILED: (.*)", out)
    assert code == 3 and failure, out
    assert re.search(r"ranks \[1\] never arrived at rank 0 .* within PERSEUS_START_TIMEOUT=4 s; "
                     r"rank 1 at 127\.0\.0\.2:\d+$", failure.group(1)), out
    assert "did not prove" not in failure.group(1), out


def test_a_peer_trickling_its_hello_cannot_hold_the_dialer_past_the_start_timeout():
    """A fake rank 0 accepts rank 1 and sends its hello one byte every 0.25 s (19 s in all):
    rank 1 gives up when its 3 s start timeout ends, not when the trickle does."""
    ports = tcp_run.free_local_ports(2)
    addresses = [f"127.0.0.1:{port}" for port in ports]
    fake = socket.create_server(("127.0.0.1", ports[0]))
    rank1 = start_rank(1, addresses, "init", worker=CORE_TASK, start_timeout=3)
    stop = threading.Event()
    accepted_at = []

    def trickle() -> None:
        fake.settimeout(60)
        conn, _ = fake.accept()
        accepted_at.append(time.monotonic())
        with conn:
            for byte in IMPOSTOR.MAGIC + bytes(IMPOSTOR.HELLO_BYTES - len(IMPOSTOR.MAGIC)):
                if stop.wait(0.25):  # the peer's pace, not a synchronisation
                    return
                try:
                    conn.send(bytes([byte]))
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        [(code, out)] = finish([rank1], 60)
        ended_at = time.monotonic()
    finally:
        stop.set()
        end_processes([rank1])
        thread.join(timeout=30)
        fake.close()
    assert code == 3 and "INIT FAILED" in out, out
    assert "rank 0 never arrived" in out and "PERSEUS_START_TIMEOUT=3 s" in out, out
    assert "timed out" in out, out
    assert accepted_at and ended_at - accepted_at[0] < 3 + 4, (ended_at - accepted_at[0], out)


def test_two_jobs_sharing_a_secret_cannot_cross_connect():
    """Job A's rank 0 and a rank 1 given another job's address list (job B's, with job A's
    address for rank 0), the same secret: rank 1 fails at once saying the process there is of
    another job; rank 0 does not take it for its rank 1."""
    ports = tcp_run.free_local_ports(3)
    job_a = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"]
    job_b = [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[2]}"]
    ranks = [start_rank(0, job_a, "init", worker=CORE_TASK, start_timeout=3),
             start_rank(1, job_b, "init", worker=CORE_TASK, start_timeout=3)]
    try:
        (zero_code, zero), (one_code, one) = finish(ranks, 60)
    finally:
        end_processes(ranks)
    assert one_code == 3, one
    assert (f"the process at {job_a[0]} is rank 0 of another job: its list of the ranks' "
            "addresses differs from this rank's") in one, one
    assert zero_code == 3 and re.search(r"ranks \[1\] never arrived at rank 0", zero), zero


def test_a_secret_shorter_than_16_bytes_is_refused_by_the_native_core_too():
    code = ("import worker_util\n"
            "core = worker_util.load_core()\n"
            "try:\n"
            "    core.init_tcp(0, ['127.0.0.1:1'], 0, 1, 0, 1, 'x' * 15, 5.0)\n"
            "except RuntimeError as exc:\n"
            "    print('REFUSED', exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(),
                          capture_output=True, text=True, timeout=60)
    assert ("REFUSED perseus_legacy: the TCP controller needs a job secret (PERSEUS_SECRET) of at "
            "least 16 bytes, the same on every rank; this one has 15") in proc.stdout, (
        proc.stdout + proc.stderr)

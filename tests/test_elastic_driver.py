"""The elastic driver (perseusrun/elastic_driver.py) against hostile and slow clients, and the
lifetime of its workers: a slow client is closed at the handshake limit, idle connections take
neither threads nor workers' turns, garbage and deeply nested JSON are refused, descriptors
exhausted then freed leave the service working, round forming survives a failing port choice,
a waiting worker fails when its driver goes silent, and the workers of a SIGKILLed launcher exit
within a bound. The driver runs for real (in this process, or in a subprocess with a low
descriptor limit); the workers are real processes under `perseusrun --tcp --min-np`.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import ROOT, WORKERS, launch_env

from perseus_shared import elastic_wire
from perseusrun import elastic_driver
from perseusrun.elastic_driver import Driver, Worker

sys.path.insert(0, str(WORKERS))
import elastic_waiter  # noqa: E402 (tests/workers is on sys.path only now)

SECRET = "elastic-driver-test-secret-0123456789"
ANSWER_SECONDS = 5.0  # a request of a worker that proves the secret is answered within this
WORKERS_EXIT_BOUND = 10.0  # a SIGKILLed launcher's workers are gone within this


def _driver(**kwargs) -> Driver:
    kwargs.setdefault("ports", lambda _round, workers: [0] * len(workers))
    driver = Driver(SECRET, "127.0.0.1", min_np=1, max_np=1, on_lost=lambda w, why: None,
                    **kwargs)
    driver.add_worker(Worker(name="h/0", host="h", slot=0, address="127.0.0.1", order=0))
    return driver


def _endpoint(driver_address: str) -> tuple[str, int]:
    host, port = driver_address.rsplit(":", 1)
    return host, int(port)


def _ask(address: str, message: dict, timeout: float = ANSWER_SECONDS) -> dict:
    """One request of worker h/0 that proves the secret; its answer."""
    with socket.create_connection(_endpoint(address), timeout=timeout) as sock:
        reader = sock.makefile("r", encoding="utf-8")
        nonce = reader.readline().strip()
        elastic_wire.elastic_send(sock, SECRET, nonce, {"worker": "h/0", "nonce": "n" * 32,
                                                        **message})
        return elastic_wire.elastic_receive(reader, SECRET, "n" * 32, "answer")


def _poll(address: str) -> float:
    """Seconds until the driver answers a poll (AssertionError when it does not)."""
    start = time.monotonic()
    assert _ask(address, {"op": "poll", "round": 0}) == {"updated": False}
    return time.monotonic() - start


def test_each_heartbeat_is_echoed_even_one_sent_with_the_request():
    driver = _driver()
    try:
        with socket.create_connection(_endpoint(driver.address), timeout=ANSWER_SECONDS) as sock:
            nonce = sock.makefile("r", encoding="utf-8").readline().strip()
            body = json.dumps({"op": "heartbeat", "worker": "h/0", "nonce": ""}, sort_keys=True)
            line = json.dumps({"body": body, "mac": elastic_wire.elastic_mac(SECRET, nonce, body)})
            sock.sendall(line.encode() + b"\n.")  # the request and a beat in one segment
            assert sock.recv(1) == b"."
            sock.sendall(b"..")
            echoed = b""
            while len(echoed) < 2:
                echoed += sock.recv(2 - len(echoed))
            assert echoed == b".."
    finally:
        driver.stop()


def test_a_client_sending_a_byte_at_a_time_is_closed_at_the_handshake_limit():
    driver = _driver(handshake_seconds=1.5)
    try:
        with socket.create_connection(_endpoint(driver.address), timeout=10) as sock:
            start = time.monotonic()
            sock.recv(64)  # the nonce
            closed = None
            while closed is None and time.monotonic() - start < 6:
                try:
                    sock.sendall(b"{")
                    sock.settimeout(0.3)
                    closed = sock.recv(64) == b"" and time.monotonic() - start
                except TimeoutError:
                    pass
                except OSError:
                    closed = time.monotonic() - start
            assert closed and closed < 1.5 + 1.0, f"still open after {closed or 6} s"
            assert _poll(driver.address) < ANSWER_SECONDS
    finally:
        driver.stop()


def test_a_thousand_idle_connections_take_no_threads_and_lock_no_worker_out(capsys):
    driver = _driver()
    threads = threading.active_count()
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection(_endpoint(driver.address), timeout=10))
        seconds = _poll(driver.address)
        print(f"a poll with 1000 idle connections open: answered in {seconds:.3f} s; "
              f"{threading.active_count() - threads} more thread(s)")
        assert seconds < ANSWER_SECONDS
        assert threading.active_count() <= threads + 2
    finally:
        for sock in idle:
            sock.close()
        driver.stop()
    assert "connections wait to authenticate" in capsys.readouterr().err


@pytest.mark.parametrize("payload, message", [
    (b"[" * 10_000 + b"\n", "not a message of the elastic driver's protocol"),
    (bytes(range(256)) * 4 + b"\n", "not a message of the elastic driver's protocol"),
    (b'{"body": 1, "mac": 2}\n', "not a message of the elastic driver's protocol"),
    (b"x" * (elastic_wire.ELASTIC_MAX_REQUEST + 10), "a request longer than"),
], ids=["deeply_nested_json", "binary_garbage", "wrong_types", "endless_line"])
def test_garbage_is_refused_with_a_reason_and_the_driver_serves_on(capfd, payload, message):
    driver = _driver()
    try:
        with socket.create_connection(_endpoint(driver.address), timeout=10) as sock:
            sock.recv(64)
            sock.sendall(payload)
            sock.settimeout(ANSWER_SECONDS)
            try:
                assert sock.recv(64) == b""  # closed without an answer
            except ConnectionResetError:
                pass
        assert _poll(driver.address) < ANSWER_SECONDS
    finally:
        driver.stop()
    err = capfd.readouterr().err
    assert message in err and "Traceback" not in err, err


_DRIVER_WITH_FEW_DESCRIPTORS = """
import os, resource, sys, time
from perseusrun.elastic_driver import Driver, Worker
driver = Driver(sys.argv[1], "127.0.0.1", min_np=1, max_np=1,
                ports=lambda r, w: [0] * len(w), on_lost=lambda w, why: None)
driver.add_worker(Worker(name="h/0", host="h", slot=0, address="127.0.0.1", order=0))
used = len(os.listdir("/proc/self/fd"))
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 12, hard))
print(driver.address, flush=True)
sys.stdin.read()
driver.stop()
"""


def test_descriptors_exhausted_then_freed_leave_the_service_working():
    # The driver's process may hold 12 more descriptors; 60 idle connections exhaust them.
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER_WITH_FEW_DESCRIPTORS, SECRET],
                            cwd=ROOT, env=launch_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    idle = []
    try:
        address = proc.stdout.readline().strip()
        assert address, proc.stderr.read()
        for _ in range(60):
            idle.append(socket.create_connection(_endpoint(address), timeout=10))
        assert _poll(address) < ANSWER_SECONDS  # exhausted: the oldest idle one gave way
        for sock in idle:
            sock.close()
        idle.clear()
        assert _poll(address) < ANSWER_SECONDS  # freed
    finally:
        for sock in idle:
            sock.close()
        proc.stdin.close()
        proc.wait(timeout=30)
    assert "Traceback" not in proc.stderr.read()


def test_round_forming_survives_a_failing_port_choice_and_ends_the_job_if_it_persists(
        monkeypatch):
    failures = []

    def ports(_round: int, workers: list) -> list[int]:
        if len(failures) < 3:
            failures.append(_round)
            raise OSError(errno.EMFILE, "Too many open files")
        return [5000] * len(workers)

    driver = _driver(ports=ports)
    try:
        answer = _ask(driver.address, {"op": "rendezvous", "round": 0})
        assert (answer["round"], answer["rank"], answer["size"]) == (1, 0, 1), answer
        assert failures == [1, 1, 1]
    finally:
        driver.stop()

    monkeypatch.setattr(elastic_driver, "ROUND_ERROR_LIMIT", 1.0)
    driver = _driver(ports=lambda _round, workers: 1 / 0)
    try:
        answer = _ask(driver.address, {"op": "rendezvous", "round": 0})
        assert answer["code"] == elastic_driver.TOO_FEW_EXIT_CODE, answer
        assert "round 1 could not be formed" in answer["exit"], answer
        assert "ZeroDivisionError" in answer["exit"], answer
    finally:
        driver.stop()


def test_a_waiting_worker_hears_the_driver_and_fails_when_it_goes_silent(monkeypatch):
    client = elastic_waiter.load_elastic_client()
    # A round of two that never forms: the worker waits, hearing the driver every second.
    driver = Driver(SECRET, "127.0.0.1", min_np=2, max_np=2, ports=lambda r, w: [0] * len(w),
                    on_lost=lambda w, why: None)
    for slot in range(2):
        driver.add_worker(Worker(name=f"h/{slot}", host="h", slot=slot, address="127.0.0.1",
                                 order=slot))
    monkeypatch.setenv("PERSEUS_ELASTIC_DRIVER", driver.address)
    monkeypatch.setenv("PERSEUS_ELASTIC_WORKER", "h/0")
    try:
        waited = threading.Event()
        outcome: list = []

        def ask() -> None:
            try:
                outcome.append(client.request({"op": "rendezvous", "round": 0}, SECRET,
                                              timeout=2.5))
            except Exception as exc:  # noqa: BLE001 (the test reads what happened)
                outcome.append(exc)
            waited.set()

        threading.Thread(target=ask, daemon=True).start()
        assert not waited.wait(6.0), f"the waiting worker gave up: {outcome}"
    finally:
        driver.stop()
    # A driver that sends its nonce, then nothing (its service stopped): the worker fails once
    # it has heard nothing for `timeout` seconds.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        held = []

        def nonce_then_nothing() -> None:
            held.append(silent.accept()[0])
            held[0].sendall(b"n" * 32 + b"\n")

        threading.Thread(target=nonce_then_nothing, daemon=True).start()
        monkeypatch.setenv("PERSEUS_ELASTIC_DRIVER", f"127.0.0.1:{silent.getsockname()[1]}")
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.request({"op": "rendezvous", "round": 0}, SECRET, timeout=1.0)
        assert time.monotonic() - start < 3.0
        held[0].close()

def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def killed_launcher():
    """`perseusrun --tcp --min-np 1 -np 2 -x PERSEUS_SECRET=...` (another secret than the
    launcher's own) of two elastic_waiter workers; once both joined, the launcher is SIGKILLed.
    Yields (joined records, seconds until every worker was gone or None, output)."""
    env = launch_env({"PERSEUS_SECRET": "the-launcher-s-own-secret-0123456789"})
    cmd = [str(Path(sys.executable).parent / "perseusrun"), "--tcp", "--min-np", "1", "-np", "2",
           "-x", f"PERSEUS_SECRET={SECRET}", "--timeout", "120", sys.executable,
           str(WORKERS / "elastic_waiter.py")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    joined: list[dict] = []
    timer = threading.Timer(60, proc.kill)  # bounded: the workers never join
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith('{"what": "joined"'):
                joined.append(json.loads(line))
                if len(joined) == 2:
                    break
    finally:
        timer.cancel()
    gone = None
    if len(joined) == 2:
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 3 * WORKERS_EXIT_BOUND:
            if not any(_alive(record["pid"]) for record in joined):
                gone = time.monotonic() - killed
                break
            time.sleep(0.1)  # the polling interval of a bounded wait, not a synchronisation
    proc.kill()
    proc.wait()
    for record in joined:  # what the test found lingering
        if _alive(record["pid"]):
            os.kill(record["pid"], signal.SIGKILL)
    yield joined, gone, "".join(lines)


def test_x_perseus_secret_reaches_the_driver_as_well_as_the_workers(killed_launcher):
    joined, _, output = killed_launcher
    assert sorted(record["rank"] for record in joined) == [0, 1], output


def test_the_workers_of_a_sigkilled_launcher_exit_within_the_bound(killed_launcher):
    joined, gone, output = killed_launcher
    assert len(joined) == 2, output
    print(f"workers gone {gone} s after the launcher's SIGKILL")
    assert gone is not None and gone < WORKERS_EXIT_BOUND, f"still running after {gone} s"


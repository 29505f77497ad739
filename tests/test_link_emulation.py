"""Emulated links with a delay, jitter or loss (perseusrun --link-delay/--link-jitter/--link-loss,
the user-space links of perseusrun/emulate.py): the command line, then what the wire really
does, measured by plain sockets inside the emulated hosts (tests/workers/link_probe.py), and
that nothing (namespace, TAP device, emulator process) outlives the hosts or their launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import (
    PERSEUSRUN,
    ROOT,
    end_processes,
    exits_within,
    launch_env,
    namespaces_of,
    needs_emulation,
)

from perseusrun import emulate, launch

PROBE = str(ROOT / "tests" / "workers" / "link_probe.py")
DELAY_MS = 2.0
RATE = "1gbit"


# ---- the command line, no launch -------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--link-delay", "2", "-np", "2", "x"], "--link-delay sets emulated hosts' links"),
    (["--link-loss", "1", "-np", "2", "x"], "--link-loss sets emulated hosts' links"),
    (["--link-jitter", "0", "-np", "2", "x"], "--link-jitter sets emulated hosts' links"),
    (["--emulate-hosts", "2", "--link-delay", "-1", "x"], "link delay -1 ms: expected 0 to"),
    (["--emulate-hosts", "2", "--link-delay", "2", "--link-jitter", "3", "x"],
     "link jitter 3 ms: expected 0 to the link delay (2 ms)"),
    (["--emulate-hosts", "2", "--link-jitter", "1", "x"],
     "link jitter 1 ms: expected 0 to the link delay (0 ms)"),
    (["--emulate-hosts", "2", "--link-loss", "100", "x"], "link loss 100%: expected 0 to less"),
    (["--emulate-hosts", "2", "--link-delay", "x", "x"], "--link-delay: invalid float value"),
    (["--link-queue", "5", "-np", "2", "x"], "--link-queue sets emulated hosts' links"),
    (["--emulate-hosts", "2", "--link-queue", "5", "x"], "give the rate too (--link-rate)"),
    (["--emulate-hosts", "2", "--link-rate", "1gbit", "--link-queue", "0", "x"],
     "link queue 0 ms: expected more than 0"),
])
def test_bad_link_delay_jitter_loss_or_queue_exits_2_naming_the_value(capsys, argv, message):
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_link_delay_without_the_built_emulator_exits_2_saying_how_to_build_it(
        capsys, monkeypatch):
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 0)
    monkeypatch.setattr(emulate, "LINK_EMULATOR", Path("/nonexistent/link_emulator"))
    assert launch.main(["--emulate-hosts", "2", "--link-delay", "1", "x"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/link_emulator" in err and "ops/tools/link_emulator.cc" in err, err


# ---- the wire --------------------------------------------------------------------------------

def probe(hosts: emulate.EmulatedHosts, *what: str) -> dict:
    """link_probe.py's measurements from host 0 against a server on the last host."""
    server = hosts[-1].popen([sys.executable, PROBE, "serve", hosts[-1].address],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "serving"
        out = subprocess.run(hosts[0].command([sys.executable, PROBE, "measure",
                                               hosts[-1].address, *what]),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    finally:
        end_processes([server])


def assert_gone(tag: str, emulator: subprocess.Popen | None) -> None:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in links and tag not in namespaces, (links, namespaces)
    assert emulator is None or emulator.poll() is not None, "the link emulator outlived its hosts"


@needs_emulation
def test_2_ms_links_give_a_4_ms_round_trip_and_one_tcp_stream_still_fills_1_gbit():
    """The delay is real (no round trip below 2 x delay, the fastest within 10% of it) and does
    not cost bandwidth when the window covers the 500 KB bandwidth-delay product: a namespace's
    default TCP autotuning (tcp_rmem/tcp_wmem up to 6 MB/4 MB) does, nothing is set."""
    with emulate.emulated_hosts(2, link_rate=RATE, delay_ms=DELAY_MS) as hosts:
        result = probe(hosts, "rtt", "stream")
        tag, emulator = hosts.tag, hosts.link_emulator
    assert 2 * DELAY_MS <= result["rtt_min_ms"] <= 2 * DELAY_MS * 1.1, result
    fraction = result["stream_bits_per_second"] / (8 * emulate.rate_bytes_per_second(RATE))
    assert fraction >= 0.9, result
    assert_gone(tag, emulator)


@needs_emulation
def test_link_loss_drops_the_asked_fraction_of_frames():
    """20% of 2000 datagrams from one host to another are lost (binomial: within 4.5 standard
    deviations); the link has no rate limit, so nothing else drops any."""
    with emulate.emulated_hosts(2, loss=20) as hosts:
        result = probe(hosts, "loss")
    assert 0.16 <= result["loss"] <= 0.24, result


@needs_emulation
def test_16_hosts_with_delayed_links_come_up_reach_each_other_and_leave_nothing():
    started = time.monotonic()
    with emulate.emulated_hosts(16, link_rate=RATE, delay_ms=1, jitter_ms=0.5) as hosts:
        up = time.monotonic() - started
        tag, emulator = hosts.tag, hosts.link_emulator
        assert len(namespaces_of(os.getpid())) == 16
        result = probe(hosts, "rtt")
    assert 1.0 <= result["rtt_min_ms"] <= 2 * 1.5 * 1.1 and result["rtt_median_ms"] >= 2, result
    assert_gone(tag, emulator)
    assert up < 60, f"16 hosts took {up:.0f} s to come up"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


@needs_emulation
def test_the_link_emulator_and_its_taps_die_with_a_sigkilled_launcher():
    """perseusrun --link-delay: the emulator runs with the delay and the queue asked (40 ms at
    100 Mbit/s: 500 kB); SIGKILL to the launcher ends it and its TAP devices at once; the next
    emulated launch removes the namespaces."""
    proc = subprocess.Popen([PERSEUSRUN, "--tcp", "--emulate-hosts", "2", "--link-delay", "1.5",
                             "--link-rate", "100mbit", "--link-queue", "40",
                             "--timeout", "150", sys.executable,
                             str(ROOT / "tests/workers/launch_worker.py"), "hang"],
                            cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        for line in proc.stdout:  # the job's --timeout bounds this wait
            if line.startswith("ready pid="):
                pids.append(int(line.split("=")[1]))
                if len(pids) == 2:
                    break
        emulators = [pid for pid in _children(proc.pid)
                     if Path(f"/proc/{pid}/exe").resolve() == emulate.LINK_EMULATOR.resolve()]
        assert len(emulators) == 1, _children(proc.pid)
        argv = Path(f"/proc/{emulators[0]}/cmdline").read_text().split("\0")
        assert argv[argv.index("--delay-us") + 1] == "1500", argv
        assert argv[argv.index("--queue-bytes") + 1] == "500000", argv
        tag = f"{emulate.TAG_PREFIX}{proc.pid}x0"
        proc.kill()
        proc.wait()
        assert exits_within(emulators[0], 10), "the link emulator outlived its killed launcher"
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True,
                               text=True).stdout
        assert f"{tag}br" not in links, links
        with emulate.emulated_hosts(1):  # removes what launchers that are gone left
            assert namespaces_of(proc.pid) == []
        for pid in pids:
            assert exits_within(pid, 30), f"rank {pid} of the killed launcher still runs"
    finally:
        end_processes([proc], pids)

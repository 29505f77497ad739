"""Several machines on one: jobs across emulated hosts (perseusrun --emulate-hosts, one network
namespace per host, see perseusrun/emulate.py).

The launches need root and iproute2 (CI runs as root); without them they are skipped with the
reason. The command-line checks at the top run anywhere. Every launch has a timeout, and every
test checks that its namespaces are gone afterwards.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from harness import BIN, ROOT, failure_summary, launch_env

from perseusrun import emulate, launch

PERSEUSRUN = str(BIN / "perseusrun")
COLLECTIVES = "tests/workers/multihost_collectives.py"


def _why_no_emulation() -> str | None:
    try:
        emulate.check_requirements("1gbit")
    except emulate.EmulationError as exc:
        return str(exc)
    return None


needs_emulation = pytest.mark.skipif(_why_no_emulation() is not None,
                                     reason=f"{_why_no_emulation()}")


def namespaces_of(pid: int) -> list[str]:
    """The emulated hosts' namespaces that a launcher with this pid left."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"{emulate.TAG_PREFIX}{pid}x")]


def run_emulated(options: list, script: str, *args, timeout: float = 240,
                 env: dict | None = None, expect_failure: bool = False) -> str:
    """Runs `perseusrun OPTIONS --timeout T python SCRIPT ARGS`; the output of all ranks."""
    cmd = [PERSEUSRUN, *map(str, options), "--timeout", str(int(timeout)), sys.executable,
           str(ROOT / script), *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 60)  # perseusrun ends the job at `timeout`
    except subprocess.TimeoutExpired:
        proc.terminate()  # perseusrun stops its ranks and removes its namespaces
        out, _ = proc.communicate(timeout=60)
        raise AssertionError(f"{' '.join(cmd)}\nhung past {timeout} s:\n{out}") from None
    assert namespaces_of(proc.pid) == [], f"namespaces left behind by {' '.join(cmd)}"
    if (proc.returncode != 0) != expect_failure or proc.returncode == launch.TIMEOUT_EXIT_CODE:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}. Error lines:\n"
                             f"{failure_summary(out)}\nOutput:\n{out}")
    return out


# ---- the command line, no launch -------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--emulate-hosts", "0", "x"], "bad slot count '0'"),
    (["--emulate-hosts", "2:x", "x"], "bad slot count 'x'"),
    (["--emulate-hosts", "2", "-H", "a:2", "x"], "drop -H/--hostfile"),
    (["--link-rate", "1gbit", "-np", "2", "x"], "add --emulate-hosts"),
    (["--tcp", "--emulate-hosts", "2", "-np", "3", "x"], "-np 3 needs 3 slots"),
])
def test_bad_emulation_options_exit_2_naming_the_problem(capsys, argv, message):
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_emulation_without_root_or_ip_exits_2_saying_what_is_missing(capsys, monkeypatch):
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(emulate.shutil, "which", lambda tool: None if tool == "ip" else "/bin/x")
    assert launch.main(["--emulate-hosts", "2", "x"]) == 2
    err = capsys.readouterr().err
    assert "emulated hosts need root" in err and "`ip` on PATH (package iproute2)" in err, err


@pytest.mark.parametrize("rate,expected", [("1gbit", 125e6), ("10Gbit", 1.25e9),
                                           ("100mbit", 12.5e6), ("125mbps", 125e6)])
def test_link_rates_use_tc_syntax(rate, expected):
    assert emulate.rate_bytes_per_second(rate) == expected


def test_bad_link_rate_is_named():
    with pytest.raises(emulate.EmulationError, match="link rate '1 gigabit'"):
        emulate.rate_bytes_per_second("1 gigabit")


# ---- collectives across hosts ------------------------------------------------------------------

def layout(out: str) -> dict:
    """rank -> host of every rank's layout line (checked by the worker itself)."""
    found = re.findall(r"\[rank (\d+)\] layout host=(\S+) local_rank=", out)
    return {int(rank): host for rank, host in found}


def assert_two_by_two(out: str) -> dict:
    hosts = layout(out)
    assert sorted(hosts) == [0, 1, 2, 3], out
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts
    for rank in range(4):
        assert f"[rank {rank}] core collectives OK" in out, out
    return hosts


@needs_emulation
def test_mpi_on_2_hosts_x_2_slots_has_the_layout_matches_numpy_and_uses_sm_within_tcp_across():
    """mpirun places ranks 0, 1 on host 0 and 2, 3 on host 1: local/cross ranks say so, every
    collective matches numpy, and Open MPI's transport choice (btl_base_verbose) is shared
    memory between ranks of one host and TCP between hosts, never anything else."""
    out = run_emulated(["--emulate-hosts", "2:2", "--mpi-args", "--mca btl_base_verbose 100"],
                       COLLECTIVES, 2, 2)
    hosts = assert_two_by_two(out)
    choices = re.findall(r"\[([^:\]]+):\d+\] mca: bml: Using (\w+) btl for send to "
                         r"\[\[\d+,\d+\],(\d+)\] on node (\S+)", out)
    assert choices, out
    seen = set()
    for sender_host, btl, receiver, receiver_host in choices:
        assert receiver_host == hosts[int(receiver)], (receiver, receiver_host, hosts)
        if sender_host == receiver_host:
            assert btl in ("self", "sm"), (sender_host, btl, receiver)
        else:
            assert btl == "tcp", (sender_host, btl, receiver)
        seen.add(btl)
    assert {"sm", "tcp"} <= seen, choices


@needs_emulation
def test_tcp_controller_on_2_hosts_x_2_slots_has_the_layout_and_matches_numpy():
    """perseusrun --tcp: rank i listens on its host's namespace address (the ranks of a host on
    distinct ports), so local/cross ranks follow the hosts; every collective matches numpy."""
    out = run_emulated(["--tcp", "--emulate-hosts", "2:2"], COLLECTIVES, 2, 2)
    assert_two_by_two(out)

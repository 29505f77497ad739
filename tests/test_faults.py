"""Faults on other ranks fail the survivors clearly and within a bound: a rank frozen by SIGSTOP
and a host whose link is cut, over MPI and over TCP. Each survivor's error names the lost rank
and its host; the job exits non-zero; nothing waits forever.

Workers: tests/workers/fault_rank.py (a 4 KiB allreduce loop; rank 1 fails after 20 steps and
each survivor prints `FAULT_SEEN after S s`, S counted from its last completed step).
"""

from __future__ import annotations

import re
import subprocess
import sys

from harness import BIN, ROOT, failure_summary, launch_env
from test_multihost import namespaces_of, needs_emulation

from perseusrun import launch

PERSEUSRUN = str(BIN / "perseusrun")
WORKER = str(ROOT / "tests" / "workers" / "fault_rank.py")

# MPI: the bound is PERSEUS_STALL_SHUTDOWN_SECS (the warning comes after the warning limit).
MPI_LIMITS = {"PERSEUS_STALL_WARNING_SECS": "2", "PERSEUS_STALL_SHUTDOWN_SECS": "6"}
MPI_BOUND_SECS = 6
# TCP: a peer silent for kPeerSilenceSecs (tcp_controller.h) is lost.
TCP_BOUND_SECS = 30
MARGIN_SECS = 10


def run_fault(options: list, mode: str, env: dict | None = None, timeout: int = 150) -> tuple:
    """Launches the worker under perseusrun OPTIONS; returns (exit code, output)."""
    cmd = [PERSEUSRUN, *options, "--timeout", str(timeout), sys.executable, WORKER, mode]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout + 60)  # perseusrun ends the job at `timeout`
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)}: the launcher outlived its timeout\n{out}") from None
    assert not namespaces_of(proc.pid), out
    return proc.returncode, out


def assert_rank_0_named_rank_1_within(out: str, bound: float, host: str | None) -> float:
    seen = re.search(r"\[rank 0\] FAULT_SEEN after ([\d.]+) s: (.*)", out)
    assert seen, f"rank 0 never reported the fault. Error lines:\n{failure_summary(out)}\n{out}"
    secs, error = float(seen.group(1)), seen.group(2)
    assert "rank 1" in error and "stopped responding" in error, error
    if host is not None:
        assert host in error, (host, error)
    assert secs <= bound + MARGIN_SECS, (secs, error)
    print(f"rank 0 reported the fault after {secs} s (bound {bound} s)")
    return secs


def test_mpi_frozen_rank_is_named_in_a_warning_then_fails_the_others_within_the_bound():
    code, out = run_fault(["-np", "2"], "stop", MPI_LIMITS)
    assert code != 0, out
    assert re.search(r"perseus_legacy\[rank 0\]: WARNING: waiting \d+ s for rank 1 \(host \S+\) "
                     r"to answer", out), out
    secs = assert_rank_0_named_rank_1_within(out, MPI_BOUND_SECS, "(host ")
    assert secs >= MPI_BOUND_SECS - 1, secs  # not before the limit either
    assert "aborting the MPI job" in out, out  # not MPI_Finalize, which waits for rank 1


@needs_emulation
def test_mpi_cut_link_fails_the_other_host_within_the_bound_naming_rank_and_host():
    """Rank 0 fails within the bound and aborts the job; mpirun then cannot reach the cut host's
    daemon and would wait for it, so perseusrun ends the job ABORT_GRACE_SECONDS later with the
    abort's exit code, well before its --timeout (exit 124)."""
    code, out = run_fault(["--emulate-hosts", "2"], "cut", MPI_LIMITS, timeout=300)
    assert code == launch.ABORT_EXIT_CODE, out
    host = re.search(r"rank 1 \(host (\S+)\)", out)
    assert host and host.group(1).endswith("h1"), out
    assert_rank_0_named_rank_1_within(out, MPI_BOUND_SECS, f"host {host.group(1)}")


def test_tcp_frozen_rank_fails_the_others_within_the_silence_limit_naming_it():
    code, out = run_fault(["--tcp", "-np", "2"], "stop")
    assert code != 0, out
    assert_rank_0_named_rank_1_within(out, TCP_BOUND_SECS, "127.0.0.1:")


@needs_emulation
def test_tcp_cut_link_fails_the_other_host_within_the_silence_limit_naming_rank_and_host():
    code, out = run_fault(["--tcp", "--emulate-hosts", "2"], "cut")
    assert code != 0, out
    assert_rank_0_named_rank_1_within(out, TCP_BOUND_SECS, ".2:")


def test_ranks_waiting_for_a_stuck_rank_0_give_up_after_the_chief_wait_limit():
    cmd = [PERSEUSRUN, "-np", "2", "--timeout", "150", sys.executable,
           str(ROOT / "tests" / "workers" / "fault_chief.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env({"PERSEUS_CHIEF_WAIT_SECS": "3"}),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=210)
    out = proc.stdout
    assert proc.returncode not in (0, 124), out
    seen = re.search(r"\[rank 1\] CHIEF_WAIT_FAILED after ([\d.]+) s: (.*)", out)
    assert seen, out
    assert "PERSEUS_CHIEF_WAIT_SECS=3" in seen.group(2), seen.group(2)
    assert 3 <= float(seen.group(1)) <= 3 + MARGIN_SECS, seen.group(1)

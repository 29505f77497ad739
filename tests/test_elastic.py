"""Elastic training on the TCP transport (perseusrun --tcp --min-np/--host-discovery-script, see
perseusrun/elastic_run.py): real ranks on emulated hosts lose one (killed, frozen, link cut),
continue on the survivors within the bound, then a host added back joins; the final weights
equal one process trained on the same global batches (tests/workers/elastic_train.py). Too few
ranks left end the job with a clear error. Every launch has a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from harness import PERSEUSRUN, ROOT, WORKERS, launch_env, namespaces_of, needs_emulation

from perseusrun import launch

# The stall limit is also how long a silent (frozen, cut off) peer is waited for on TCP.
STALL_SECONDS = 4
LOSS_BOUND = 10.0  # seconds from a kill or a cut link to the next completed step
JOB_TIMEOUT = 150


@pytest.mark.parametrize("argv, message", [
    (["--min-np", "1", "-np", "2", "x"], "MPI cannot re-form its world"),
    (["--tcp", "--min-np", "3", "-np", "2", "x"], "--min-np 3 <= -np 2"),
    (["--tcp", "--max-np", "0", "-np", "2", "x"], "--max-np must be at least 1"),
])
def test_bad_elastic_command_lines_exit_2_naming_the_problem(capsys, argv, message):
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


class ElasticRun:
    """perseusrun in elastic mode on emulated hosts, its output read line by line as it comes:
    the test acts on the lines (a step reached, a round formed)."""

    def __init__(self, tmp_path: Path, hosts: int, initial: list[int], np_: int, min_np: int,
                 program: list[str]) -> None:
        self.hosts_file = tmp_path / "hosts"
        self.set_hosts(initial)
        cmd = [PERSEUSRUN, "--tcp", "--emulate-hosts", str(hosts), "-np", str(np_),
               "--min-np", str(min_np), "--host-discovery-script", f"cat {self.hosts_file}",
               "--timeout", str(JOB_TIMEOUT), sys.executable, *program]
        env = launch_env({"PERSEUS_STALL_SHUTDOWN_SECS": str(STALL_SECONDS),
                          "PERSEUS_STALL_WARNING_SECS": "3"})
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def set_hosts(self, indexes: list[int]) -> None:
        self.hosts_file.write_text("".join(f"{i}:1\n" for i in indexes))

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cv.notify_all()
        with self._cv:
            self.lines.append((time.monotonic(), None))
            self._cv.notify_all()

    def wait_for(self, predicate, what: str, timeout: float = 90) -> tuple[float, str]:
        """The first line (time, text) from `start` on that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cv:
            while True:
                for when, text in self.lines[seen:]:
                    if text is None:
                        raise AssertionError(f"the job ended before {what}:\n{self.output()}")
                    if predicate(text):
                        return when, text
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} within {timeout} s:\n{self.output()}")
                self._cv.wait(timeout=left)

    def output(self) -> str:
        return "\n".join(text for _, text in self.lines if text is not None)

    def records(self, what: str) -> list[dict]:
        return [json.loads(text) for _, text in self.lines
                if text and text.startswith("{") and f'"what": "{what}"' in text]

    def steps(self) -> list[tuple[float, int, int]]:
        """(time seen, step, size) of every STEP line."""
        return [(when, int(text.split()[1]), int(text.split()[3])) for when, text in self.lines
                if text and text.startswith("STEP ")]

    def finish(self) -> int:
        try:
            self.proc.wait(timeout=JOB_TIMEOUT + 60)
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait(timeout=60)
            self._reader.join(timeout=10)
        assert namespaces_of(self.proc.pid) == [], self.output()
        return self.proc.returncode

    def worker(self, host: int) -> dict:
        """The `started` record of the worker on emulated host `host`."""
        for record in self.records("started"):
            if record["worker"].endswith(f"h{host}/0"):
                return record
        raise AssertionError(f"no worker started on host {host}:\n{self.output()}")


def _namespace_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True,
                          check=True).stdout.strip()


def _lose(run: ElasticRun, how: str, host: int) -> None:
    pid = run.worker(host)["pid"]
    if how == "kill":
        os.kill(pid, signal.SIGKILL)
    elif how == "freeze":
        os.kill(pid, signal.SIGSTOP)
    else:  # cut its link
        subprocess.run(["ip", "netns", "exec", _namespace_of(pid), "ip", "link", "set", "eth0",
                        "down"], check=True, timeout=30)


def _check_against_reference(run: ElasticRun) -> dict:
    sys.path.insert(0, str(WORKERS))
    try:
        import elastic_train
    finally:
        sys.path.remove(str(WORKERS))
    initial, = run.records("initial")
    final, = run.records("final")
    kernel, bias = elastic_train.reference(np.array(initial["kernel"]), np.array(initial["bias"]),
                                           final["steps"])
    np.testing.assert_allclose(final["kernel"], kernel, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(final["bias"], bias, rtol=1e-4, atol=1e-5)
    return final


@needs_emulation
@pytest.mark.parametrize("mode, how, host, bound", [
    ("keras", "kill", 0, LOSS_BOUND),  # rank 0 itself: the new rank 0 gives the state
    ("tape", "freeze", 2, STALL_SECONDS + LOSS_BOUND),
    ("tape", "cut", 1, STALL_SECONDS + LOSS_BOUND),
])
def test_lost_rank_survivors_continue_then_a_new_host_joins(tmp_path, mode, how, host, bound):
    # 5 emulated hosts, 4 in the job; host `host` is lost at step 20; host 4 is added once the
    # 3 survivors train; the job ends on 4 ranks in round 3.
    run = ElasticRun(tmp_path, hosts=5, initial=[0, 1, 2, 3], np_=4, min_np=3,
                     program=[str(WORKERS / "elastic_train.py"), mode, "60", "3", "5000"])
    try:
        run.wait_for(lambda t: t.startswith("STEP 20 "), "step 20")
        lost_at = time.monotonic()
        _lose(run, how, host)
        before = max(step for when, step, _ in run.steps() if when <= lost_at)
        resumed_at, line = run.wait_for(lambda t: t.startswith("STEP ") and " SIZE 3 " in t,
                                        "a step on 3 ranks")
        first_after = int(line.split()[1])
        run.set_hosts([0, 1, 2, 3, 4])
        run.wait_for(lambda t: t.startswith("STEP ") and " SIZE 4 ROUND 3 " in t,
                     "a step on 4 ranks after the new host joined")
        code = run.finish()
    except BaseException:
        run.proc.kill()
        raise
    assert code == 0, run.output()
    final = _check_against_reference(run)
    assert (final["size"], final["round"]) == (4, 3), final
    seconds = resumed_at - lost_at
    redone = before - first_after + 1
    print(f"{mode} {how}: next step {seconds:.1f} s after the loss, {redone} steps redone")
    assert seconds < bound, f"{seconds:.1f} s from the loss to the next step:\n{run.output()}"
    assert redone <= 0, f"{redone} completed steps were redone:\n{run.output()}"


@needs_emulation
def test_too_few_ranks_left_end_the_job_with_a_clear_error(tmp_path):
    # Two of four lost at once, with --min-np 3: every survivor ends, the launcher says why.
    run = ElasticRun(tmp_path, hosts=4, initial=[0, 1, 2, 3], np_=4, min_np=3,
                     program=[str(WORKERS / "elastic_train.py"), "tape", "100000", "2",
                              "100000"])
    try:
        run.wait_for(lambda t: t.startswith("STEP 10 "), "step 10")
        for host in (1, 3):
            _lose(run, "kill", host)
        code = run.finish()
    except BaseException:
        run.proc.kill()
        raise
    out = run.output()
    assert code == 1, out
    assert "only 2 ranks remain, fewer than --min-np 3" in out, out

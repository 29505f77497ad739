"""What losing a rank costs an elastic job (perseusrun --tcp --min-np, emulated hosts): seconds
from the loss to the next completed step, and completed steps redone, per kind of loss (a
killed rank, a frozen one, a cut link), beside the job's own step time before the loss.

    sudo python benchmarks/faults_elastic.py [--losses kill,freeze,cut] [--stall 4] [--json F]

Each loss runs its own job: 4 emulated hosts, tests/workers/elastic_train.py (the tape loop),
--min-np 3; the rank on host 2 is lost at step 20 and the job ends 20 steps later on 3 ranks.
measure() is what tests/test_elastic.py and a wider fault benchmark call; ElasticRun drives one
such job and reads its output as it comes. Horovod 0.28.1's elastic mode has no row: this script
does not drive horovodrun; the table says whether its environment (.venv-peers, make peers) is
there to measure it by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
PERSEUSRUN = str(Path(sys.executable).parent / "perseusrun")
# One thread per rank: several ranks share the machine's cores.
QUIET_ENV = {"OMP_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
             "TF_NUM_INTEROP_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
PEERS_VENV = ROOT / ".venv-peers"
JOB_TIMEOUT = 150
LINE_TIMEOUT = 90.0


class ElasticRun:
    """perseusrun in elastic mode on emulated hosts (the discovery script reads `hosts_file`,
    which set_hosts() rewrites), its output read line by line as it comes. `env`: the launch's
    environment (default this process's)."""

    def __init__(self, work_dir: Path, hosts: int, initial: list[int], np_: int, min_np: int,
                 program: list[str], stall_seconds: int, env: dict | None = None) -> None:
        self.hosts_file = work_dir / "hosts"
        self.set_hosts(initial)
        cmd = [PERSEUSRUN, "--tcp", "--emulate-hosts", str(hosts), "-np", str(np_),
               "--min-np", str(min_np), "--host-discovery-script", f"cat {self.hosts_file}",
               "--timeout", str(JOB_TIMEOUT), sys.executable, *program]
        full_env = {**(os.environ if env is None else env), **QUIET_ENV,
                    "PERSEUS_STALL_SHUTDOWN_SECS": str(stall_seconds),
                    "PERSEUS_STALL_WARNING_SECS": str(min(stall_seconds, 3))}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), str(WORKERS), full_env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str | None]] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def set_hosts(self, indexes: list[int]) -> None:
        """What the discovery script prints from now on: these emulated hosts, 1 slot each."""
        self.hosts_file.write_text("".join(f"{i}:1\n" for i in indexes))

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cv.notify_all()
        with self._cv:
            self.lines.append((time.monotonic(), None))
            self._cv.notify_all()

    def wait_for(self, predicate, what: str, timeout: float = LINE_TIMEOUT) -> tuple[float, str]:
        """The first output line (time seen, text) that satisfies `predicate`; AssertionError
        with the whole output when the job ends first or `timeout` passes."""
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
        with self._cv:
            return "\n".join(text for _, text in self.lines if text is not None)

    def records(self, what: str) -> list[dict]:
        """The workers' JSON lines of one kind (elastic_train.say)."""
        with self._cv:
            return [json.loads(text) for _, text in self.lines
                    if text and text.startswith("{") and f'"what": "{what}"' in text]

    def steps(self) -> list[tuple[float, int, int]]:
        """(time seen, step, size) of every STEP line so far."""
        with self._cv:
            return [(when, int(text.split()[1]), int(text.split()[3]))
                    for when, text in self.lines if text and text.startswith("STEP ")]

    def worker(self, host: int) -> dict:
        """The `started` record of the worker on emulated host `host`."""
        for record in self.records("started"):
            if record["worker"].endswith(f"h{host}/0"):
                return record
        raise AssertionError(f"no worker started on host {host}:\n{self.output()}")

    def lose(self, how: str, host: int) -> None:
        """Loses the worker on `host`: kill (SIGKILL), freeze (SIGSTOP) or cut (its host's link
        down)."""
        pid = self.worker(host)["pid"]
        if how == "kill":
            os.kill(pid, signal.SIGKILL)
        elif how == "freeze":
            os.kill(pid, signal.SIGSTOP)
        elif how == "cut":
            namespace = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                                       text=True, check=True, timeout=30).stdout.strip()
            subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", "eth0", "down"],
                           check=True, timeout=30)
        else:
            raise ValueError(f"unknown loss {how!r}: kill, freeze or cut")

    def lose_and_resume(self, how: str, host: int, ranks_after: int) -> dict:
        """Loses the worker on `host` and waits for the next step on `ranks_after` ranks: the
        seconds from the loss to it, completed steps redone, and the step time before."""
        before_steps = self.steps()
        lost_at = time.monotonic()
        self.lose(how, host)
        last = max(step for when, step, _ in before_steps if when <= lost_at)
        resumed_at, line = self.wait_for(
            lambda t: t.startswith("STEP ") and f" SIZE {ranks_after} " in t,
            f"a step on {ranks_after} ranks after the {how}")
        gaps = [b[0] - a[0] for a, b in zip(before_steps[-11:], before_steps[-10:])]
        return {"loss": how, "seconds_to_next_step": resumed_at - lost_at,
                "steps_redone": max(0, last - int(line.split()[1]) + 1),
                "step_seconds_before": statistics.median(gaps) if gaps else float("nan")}

    def finish(self) -> int:
        """Waits for the launcher (bounded) and returns its exit code."""
        try:
            self.proc.wait(timeout=JOB_TIMEOUT + 60)
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()
                self.proc.wait(timeout=60)
            self._reader.join(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        """Ends the launcher at once (it removes its emulated hosts)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure(losses: tuple[str, ...] = ("kill", "freeze", "cut"), stall_seconds: int = 4) -> list:
    """One job per loss on 4 emulated hosts (min-np 3); a row per loss (lose_and_resume's)."""
    rows = []
    for how in losses:
        with tempfile.TemporaryDirectory() as work:
            run = ElasticRun(Path(work), hosts=4, initial=[0, 1, 2, 3], np_=4, min_np=3,
                             program=[str(WORKERS / "elastic_train.py"), "tape", "40", "2",
                                      "100000"], stall_seconds=stall_seconds)
            try:
                run.wait_for(lambda t: t.startswith("STEP 20 "), "step 20")
                row = run.lose_and_resume(how, 2, 3)
                code = run.finish()
            finally:
                run.kill()
            if code != 0:
                raise RuntimeError(f"the {how} job exited with {code}:\n{run.output()}")
            rows.append({**row, "stall_limit": stall_seconds})
    return rows


def print_table(rows: list) -> None:
    print(f"{'loss':<8} {'step before (s)':>16} {'loss -> next step (s)':>22} "
          f"{'steps redone':>13}")
    for row in rows:
        print(f"{row['loss']:<8} {row['step_seconds_before']:>16.3f} "
              f"{row['seconds_to_next_step']:>22.1f} {row['steps_redone']:>13}")
    if rows:
        print(f"(frozen and cut: noticed after PERSEUS_STALL_SHUTDOWN_SECS="
              f"{rows[0]['stall_limit']} s of silence)")
    print("Horovod 0.28.1 elastic: not measured by this script ("
          f"{PEERS_VENV} {'exists' if PEERS_VENV.exists() else 'is absent'})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--losses", default="kill,freeze,cut")
    p.add_argument("--stall", type=int, default=4, help="PERSEUS_STALL_SHUTDOWN_SECS")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = measure(tuple(args.losses.split(",")), args.stall)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

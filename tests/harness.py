"""Launches real ranks for tests: `perseusrun` (default) or plain `mpirun`, always with a timeout.

`controller="tcp"` launches with `perseusrun --tcp`: local ranks over the TCP controller, no MPI.

A test calls run_ranks(np, "tests/workers/x.py", ...) and gets the finished process; any
non-zero exit, or a launch that outlives its timeout, fails the test with every rank's output.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKERS = ROOT / "tests" / "workers"

# Several ranks share 2 cores: one thread each for TensorFlow, OpenMP and BLAS.
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}


def launch_env(extra: dict | None = None) -> dict:
    # Without a Slurm job's variables: inside an allocation perseusrun would run the ranks there.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env.update(QUIET_ENV)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(ROOT), str(WORKERS), env.get("PYTHONPATH", "")] if p)
    env.update(extra or {})
    return env


CONTROLLERS = ("mpi", "tcp")


def command(np: int, script: str, args: tuple = (), launcher: str = "perseusrun",
            timeout: float = 180, controller: str = "mpi", python: str | None = None) -> list:
    """The launch command; `python` (default: this one) runs the ranks, and perseusrun too."""
    python = python or sys.executable
    program = [python, str(ROOT / script), *map(str, args)]
    if controller not in CONTROLLERS:
        raise ValueError(f"unknown controller {controller!r}")
    if controller == "tcp" and launcher != "perseusrun":
        raise ValueError("the TCP controller is launched with perseusrun --tcp")
    if launcher == "perseusrun":
        perseusrun = ([str(BIN / "perseusrun")] if python == sys.executable
                      else [python, "-m", "perseusrun"])
        tcp = ["--tcp"] if controller == "tcp" else []
        return [*perseusrun, *tcp, "-np", str(np), "--timeout", str(int(timeout)), *program]
    if launcher == "mpirun":
        return [str(BIN / "mpirun"), "-np", str(np), "--allow-run-as-root", "--oversubscribe",
                "--bind-to", "none", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
                *[a for k in os.environ if k.startswith("PERSEUS_") for a in ("-x", k)],
                *program]
    raise ValueError(f"unknown launcher {launcher!r}")


# Lines that say why a rank failed; TensorFlow's start-up noise about CUDA is not one of them.
_FAILURE_LINE = re.compile(r"(Error|Exception|FAILED|Segmentation fault|exited on signal|"
                           r"timed out)")
_NOISE = ("cuInit", "type_inference", "Type inference")


def failure_summary(out: str, limit: int = 20) -> str:
    """The distinct lines of `out` that name an error, first ones first (at most `limit`)."""
    seen: list[str] = []
    for line in out.splitlines():
        line = line.strip()
        if _FAILURE_LINE.search(line) and not any(n in line for n in _NOISE) and line not in seen:
            seen.append(line)
    return "\n".join(seen[:limit])


def run_ranks(np: int, script: str, *args, launcher: str = "perseusrun", timeout: float = 180,
              env: dict | None = None, expect_failure: bool = False,
              controller: str = "mpi", python: str | None = None) -> subprocess.CompletedProcess:
    """Runs `script` on `np` ranks; asserts it exits 0 (or non-zero with expect_failure)."""
    cmd = command(np, script, args, launcher, timeout, controller, python)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # perseusrun ends the job itself at `timeout`; this is the backstop for mpirun.
        out, _ = proc.communicate(timeout=timeout + 20)
    except subprocess.TimeoutExpired:
        # The launcher forwards SIGTERM to its ranks (which sit in their own process groups).
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)}\ntimed out after {timeout}s (a hang). Error lines:\n"
            f"{failure_summary(out)}\nOutput:\n{out}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if launcher == "perseusrun" and proc.returncode == 124:
        raise AssertionError(
            f"{' '.join(cmd)}\ntimed out after {timeout}s (a hang). Error lines:\n"
            f"{failure_summary(out)}\nOutput:\n{out}")
    failed = proc.returncode != 0
    if failed != expect_failure:
        verdict = "failed" if failed else "succeeded but was expected to fail"
        # The summary comes first: a long output may be cut where a report shows it.
        raise AssertionError(
            f"{' '.join(cmd)}\n{verdict} (exit {proc.returncode}). Error lines:\n"
            f"{failure_summary(out)}\nOutput of all ranks:\n{out}")
    return result

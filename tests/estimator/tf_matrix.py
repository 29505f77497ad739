"""The TensorFlow versions of the estimator matrix and how to run Python under each of them.

main   - .venv, the project's TensorFlow (2.21), tf-keras, tensorflow-estimator 2.15.0
tf216  - .venv-tf216, TF 2.16.2: the first TensorFlow without tf.estimator
tf215  - .venv-tf215, TF 2.15.1: the real tf.estimator, nothing is patched

`make compat-venvs` builds the last two. A missing one fails the tests under CI (the `CI`
variable is set) and skips them elsewhere, with the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VERSIONS = ("main", "tf216", "tf215")
VENVS = {"tf216": ROOT / ".venv-tf216", "tf215": ROOT / ".venv-tf215"}

# One thread per TensorFlow pool: several runs share 2 cores, and results stay reproducible.
_QUIET = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_ENABLE_ONEDNN_OPTS": "0",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "PYTHONUNBUFFERED": "1",
}
# Variables the tests set themselves when they want them.
_CLEARED = ("TF_USE_LEGACY_KERAS", "TF_CONFIG", "PERSEUS_NO_TF_PATCH", "KERAS_BACKEND")


def available(version: str) -> bool:
    if version == "main":
        return True
    return (VENVS[version] / ".installed").exists() and (VENVS[version] / "bin" / "python").exists()


def python_for(version: str) -> str:
    """The interpreter of `version`; fails under CI, skips elsewhere, when its venv is missing."""
    if version == "main":
        return sys.executable
    if not available(version):
        reason = (f"{VENVS[version].name} is missing: `make compat-venvs` builds it from "
                  f"tests/estimator/requirements-{version}.txt")
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return str(VENVS[version] / "bin" / "python")


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    result = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    result.update(_QUIET)
    result["PYTHONPATH"] = str(ROOT)
    result.update(extra or {})
    return result


def start(version: str, args: list,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts `python args...` under `version`, stdout and stderr to one pipe."""
    return subprocess.Popen([python_for(version), *map(str, args)], cwd=ROOT, env=env(extra_env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """Waits for `proc`; kills its process group when it outlives `timeout`. Returns its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out or ''}", pytrace=False)
    return out or ""


def run_code(version: str, code: str, extra_env: dict[str, str] | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """Runs `python -c code` under `version`; returns the finished process (output in stdout)."""
    proc = start(version, ["-c", code], extra_env)
    out = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

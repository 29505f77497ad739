"""The estimator matrix runs: started as soon as collection shows a test needs them.

Started then, they run in the background while the other tests of the session (the error cases,
one interpreter each) use the cores too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from harness import ROOT, VERSIONS, available, python_for, start

MATRIX_TIMEOUT = 600
SCENARIOS = ROOT / "tests" / "estimator" / "estimator_scenarios.py"


class Matrix:
    """One estimator_scenarios.py run per TensorFlow version, all at once; results per version."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="estimator_matrix_"))
        self.procs: dict = {}
        self.results: dict = {}

    def start_all(self) -> None:
        for version in filter(available, VERSIONS):  # a missing venv skips/fails its own tests
            self.procs[version] = start(version, [
                SCENARIOS, self.root / f"{version}.json", self.root / version])

    def _collect(self, version: str) -> object:
        proc = self.procs[version]
        try:
            out, _ = proc.communicate(timeout=MATRIX_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return f"the scenario run timed out after {MATRIX_TIMEOUT} s:\n{out[-8000:]}"
        path = self.root / f"{version}.json"
        if proc.returncode != 0 or not path.exists():
            return f"the scenario run exited {proc.returncode}:\n{out[-8000:]}"
        return json.loads(path.read_text())

    def result(self, version: str) -> dict:
        """Everything the run under `version` recorded; fails the test if the run failed."""
        python_for(version)  # skips or fails, with the reason, when the venv is missing
        if version not in self.results:
            self.results[version] = self._collect(version)
        if isinstance(self.results[version], str):
            pytest.fail(self.results[version], pytrace=False)
        return self.results[version]

    def scenario(self, version: str, name: str) -> dict:
        """One scenario's numbers; fails the test with the run's traceback if it raised."""
        record = self.result(version)["scenarios"][name]
        if not record["ok"]:
            pytest.fail(f"scenario {name!r} on TF {self.result(version)['tensorflow']}:\n"
                        f"{record['error']}", pytrace=False)
        return record["data"]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        shutil.rmtree(self.root, ignore_errors=True)


_matrix: Matrix | None = None


def pytest_collection_modifyitems(session, config, items):
    global _matrix
    if _matrix is None and any("matrix" in getattr(i, "fixturenames", ()) for i in items):
        _matrix = Matrix()
        _matrix.start_all()


def pytest_sessionfinish(session, exitstatus):
    if _matrix is not None:
        _matrix.stop()


@pytest.fixture(scope="session")
def matrix() -> Matrix:
    global _matrix
    if _matrix is None:  # collection hooks did not run for this item (e.g. a plugin reordering)
        _matrix = Matrix()
        _matrix.start_all()
    return _matrix

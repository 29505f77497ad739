"""Puts tests/ on sys.path, so that a test in any folder below imports the launching side's
helpers as `harness` (tests/harness.py), and benchmarks/, whose modules tests import as its
scripts do (`from bench_common import scaling_model`); the fixtures several test files share."""

import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
for directory in (TESTS, str(Path(TESTS).parent / "benchmarks")):
    if directory not in sys.path:
        sys.path.insert(0, directory)

from harness import worker_module  # noqa: E402 (tests/ is on sys.path from here)


@pytest.fixture(scope="module")
def checkpoint_worker():
    """The worker module (its steps, data and initial values) and tensorflow, for the checks."""
    import perseus_legacy  # noqa: F401, I001 (first: it selects legacy Keras)
    import tensorflow as tf

    return worker_module("fault_checkpoint"), tf

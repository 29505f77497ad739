"""Puts tests/ on sys.path, so that a test in any folder below imports the launching side's
helpers as `harness` (tests/harness.py)."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

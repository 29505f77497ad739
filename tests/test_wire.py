"""The control plane's wire format (ops/runtime/message.cc) against what a peer may send: every
field checked, no crash on random, truncated or altered messages.

The decoder runs in a process of its own (tests/workers/wire_fuzz.py, through the test-only
_core._wire_decode), so that a crash fails the test with its signal and output.
"""

from __future__ import annotations

import subprocess
import sys

from harness import ROOT, WORKERS, launch_env


def test_decoder_refuses_unknown_enums_negative_sizes_and_truncation_and_never_crashes():
    proc = subprocess.run([sys.executable, str(WORKERS / "wire_fuzz.py"), "20261125", "20000"],
                          cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FUZZ OK" in proc.stdout, (
        f"wire_fuzz.py exited {proc.returncode} (a negative code is the signal that ended it):\n"
        f"{out}")
    valid = int(proc.stdout.split("VALID ")[1].split()[0])
    refused = int(proc.stdout.split("REFUSED ")[1].split()[0])
    assert valid >= 6 and refused > 20000, out  # both kinds of input were exercised

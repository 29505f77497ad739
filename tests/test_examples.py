"""The TF1 examples run on 2 real ranks (--smoke) and rank 0 reports a test accuracy well above
chance (0.1 for ten digits)."""

from __future__ import annotations

import re

from harness import run_ranks

ACCURACY = re.compile(r"^test accuracy: ([0-9.]+)", re.MULTILINE)


def accuracy_of(out: str) -> float:
    found = ACCURACY.findall(out)
    assert len(found) == 1, f"expected one accuracy line (rank 0 only):\n{out}"
    return float(found[0])


def test_session_run_example_trains_above_chance():
    out = run_ranks(2, "examples/session_run.py", "--smoke", timeout=180).stdout
    assert "ranks: 2  steps: 20" in out, out
    assert accuracy_of(out) > 0.3, out


def test_monitored_session_example_trains_above_chance_and_rank_0_checkpoints(tmp_path):
    out = run_ranks(2, "examples/monitored_session.py", "--smoke", "--model-dir", tmp_path,
                    timeout=180).stdout
    assert "ranks: 2  steps: 20" in out, out
    assert accuracy_of(out) > 0.3, out
    assert (tmp_path / "checkpoint").is_file(), sorted(p.name for p in tmp_path.iterdir())

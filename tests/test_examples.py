"""The TF1 examples run on 2 real ranks (--smoke; train_and_evaluate.py starts its own TF_CONFIG
tasks) and report a test accuracy well above chance (0.1 for ten digits); allreduce_smoke.py
(50 steps, already tiny) checks its weights against numpy itself."""

from __future__ import annotations

import re
import subprocess
import sys

from harness import ROOT, launch_env, run_ranks

ACCURACY = re.compile(r"^test accuracy: ([0-9.]+)", re.MULTILINE)


def accuracy_of(out: str) -> float:
    found = ACCURACY.findall(out)
    assert len(found) == 1, f"expected one accuracy line (rank 0 only):\n{out}"
    return float(found[0])


def test_allreduce_smoke_example_equals_numpy_on_the_global_batch():
    out = run_ranks(2, "examples/allreduce_smoke.py", timeout=180).stdout
    assert "weights identical on all ranks: True" in out, out
    assert "weights equal one process on the global batch (numpy): True" in out, out


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


def test_estimator_example_trains_above_chance_and_rank_0_checkpoints(tmp_path):
    out = run_ranks(2, "examples/estimator.py", "--smoke", "--model-dir", tmp_path,
                    timeout=240).stdout
    assert re.search(r"^ranks: 2  steps: 40  steps/s: [0-9.]+  examples/s: \d+$", out,
                     re.MULTILINE), out
    assert accuracy_of(out) > 0.3, out
    assert f"checkpoint: {tmp_path / 'model.ckpt-40'}" in out, out
    assert (tmp_path / "model.ckpt-40.index").is_file(), sorted(p.name for p in tmp_path.iterdir())


def test_train_and_evaluate_example_runs_chief_worker_and_evaluator_from_tf_config(tmp_path):
    """The example starts its three TF_CONFIG tasks itself and waits for them (240 s at most)."""
    proc = subprocess.run([sys.executable, "examples/train_and_evaluate.py", "--smoke",
                           "--model-dir", str(tmp_path), "--timeout", "240"], cwd=ROOT,
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for task in ("chief 0", "worker 0", "evaluator 0"):
        assert f"{task}: exit 0" in out, out
    found = re.search(r"^\[evaluator\] global step 30: loss [0-9.]+, accuracy ([0-9.]+)$", out,
                      re.MULTILINE)
    assert found and float(found.group(1)) > 0.3, out
    assert (tmp_path / "model.ckpt-30.index").is_file()
    assert list((tmp_path / "export" / "digits").glob("*/saved_model.pb")), out

"""The examples on 2 real ranks (--smoke; train_and_evaluate.py starts its own TF_CONFIG tasks)
against the same example run with --reference-ranks 2: one plain process, no perseus_legacy
collectives, training on the global batch of both ranks (their batches concatenated, rank 0's
initial weights, the learning rate scaled alike). Every rank must print the same weights, equal
to the reference's to WEIGHTS_RTOL, and reach the reference's test accuracy; a run whose ranks
train on unaveraged gradients differs in both. allreduce_smoke.py (50 steps, already tiny)
checks its weights against numpy itself.

WEIGHTS_RTOL: float32 gradients of the global batch sum in another order than the average of two
half-batch gradients; after 20-40 Adam steps the sum of |w| differs by at most ~3e-9 relative.
Gradients summed instead of averaged end 2e-5 to 2e-4 away (Adam barely sees the scale), rank
0's gradient alone 2e-2 to 4e-2, and each rank's own gradient leaves the ranks 1e-3 to 1e-2
apart. ACCURACY_ATOL: one of the 450 test examples may change its argmax under a difference the
tolerance allows; LOSS_ATOL: the last printed digit.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

from harness import ROOT, accuracy_of, launch_env, run_ranks

WEIGHTS = re.compile(r"^weights: ([0-9.e+-]+)$", re.MULTILINE)
LOSS = re.compile(r"(?:final loss:|loss) ([0-9.]+)")
WEIGHTS_RTOL = 1e-6
ACCURACY_ATOL = 1.5 / 450
LOSS_ATOL = 1.5e-4


def run_reference(script: str, *args, timeout: float = 180) -> str:
    """The output of `script --reference-ranks 2` in one plain process (exit 0 asserted)."""
    proc = subprocess.run([sys.executable, script, *map(str, args), "--reference-ranks", "2"],
                          cwd=ROOT, env=launch_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def assert_weights_equal_reference(out: str, reference: str, ranks: int = 2) -> None:
    """Every rank printed the same weights, and they equal the reference's to WEIGHTS_RTOL."""
    weights = [float(w) for w in WEIGHTS.findall(out)]
    assert len(weights) == ranks, f"expected a weights line from each of {ranks} ranks:\n{out}"
    assert len(set(weights)) == 1, f"the ranks hold different weights {weights}:\n{out}"
    expected = [float(w) for w in WEIGHTS.findall(reference)]
    assert len(expected) == 1, f"expected one weights line from the reference:\n{reference}"
    assert math.isclose(weights[0], expected[0], rel_tol=WEIGHTS_RTOL), (
        f"{ranks} ranks end with weights {weights[0]}, one process on their global batch with "
        f"{expected[0]} (rel. difference {abs(weights[0] / expected[0] - 1):.2e}, allowed "
        f"{WEIGHTS_RTOL:.0e}):\n{out}\nreference:\n{reference}")


def assert_equals_reference(out: str, reference: str) -> None:
    """Same weights on every rank, equal to the reference's, and the reference's accuracy."""
    assert_weights_equal_reference(out, reference)
    assert abs(accuracy_of(out) - accuracy_of(reference)) <= ACCURACY_ATOL, (
        f"test accuracy {accuracy_of(out)}, reference {accuracy_of(reference)}:\n{out}\n"
        f"reference:\n{reference}")


def assert_loss_equals_reference(loss: str, reference: str) -> None:
    """An evaluated loss equals the reference's `final loss` to LOSS_ATOL."""
    expected = float(LOSS.search(reference).group(1))
    assert abs(float(loss) - expected) <= LOSS_ATOL, f"loss {loss}:\nreference:\n{reference}"


def test_allreduce_smoke_example_equals_numpy_on_the_global_batch():
    out = run_ranks(2, "examples/allreduce_smoke.py", timeout=180).stdout
    assert "weights identical on all ranks: True" in out, out
    assert "weights equal one process on the global batch (numpy): True" in out, out


def test_session_run_example_equals_one_process_on_the_global_batch():
    out = run_ranks(2, "examples/session_run.py", "--smoke", timeout=180).stdout
    assert "ranks: 2  steps: 20" in out, out
    assert_equals_reference(out, run_reference("examples/session_run.py", "--smoke"))


def test_monitored_session_example_equals_one_process_and_rank_0_checkpoints(tmp_path):
    out = run_ranks(2, "examples/monitored_session.py", "--smoke", "--model-dir", tmp_path,
                    timeout=180).stdout
    assert "ranks: 2  steps: 20" in out, out
    assert (tmp_path / "checkpoint").is_file(), sorted(p.name for p in tmp_path.iterdir())
    reference = run_reference("examples/monitored_session.py", "--smoke", "--model-dir",
                              tmp_path / "reference")
    assert_equals_reference(out, reference)


def test_estimator_example_equals_one_process_and_rank_0_checkpoints(tmp_path):
    out = run_ranks(2, "examples/estimator.py", "--smoke", "--model-dir", tmp_path,
                    timeout=240).stdout
    assert re.search(r"^ranks: 2  steps: 40  steps/s: [0-9.]+  examples/s: \d+$", out,
                     re.MULTILINE), out
    assert f"checkpoint: {tmp_path / 'model.ckpt-40'}" in out, out
    assert (tmp_path / "model.ckpt-40.index").is_file(), sorted(p.name for p in tmp_path.iterdir())
    reference = run_reference("examples/estimator.py", "--smoke", "--model-dir",
                              tmp_path / "reference")
    assert_equals_reference(out, reference)
    assert_loss_equals_reference(LOSS.search(out).group(1), reference)


def test_keras_fit_example_equals_one_process_on_the_global_batch_with_warmup(tmp_path):
    out = run_ranks(2, "examples/keras_fit.py", "--smoke", "--model-dir", tmp_path,
                    timeout=240).stdout
    assert "ranks: 2  epochs: 2" in out, out
    reference = run_reference("examples/keras_fit.py", "--smoke", "--model-dir",
                              tmp_path / "reference")
    assert_equals_reference(out, reference)


def test_train_and_evaluate_example_equals_one_process_from_tf_config(tmp_path):
    """The example starts its three TF_CONFIG tasks itself and waits for them (240 s at most);
    chief and worker train 30 steps as ranks 0 and 1, like estimator.py --steps 30."""
    proc = subprocess.run([sys.executable, "examples/train_and_evaluate.py", "--smoke",
                           "--model-dir", str(tmp_path), "--timeout", "240"], cwd=ROOT,
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for task in ("chief 0", "worker 0", "evaluator 0"):
        assert f"{task}: exit 0" in out, out
    found = re.search(r"^\[evaluator\] global step 30: loss ([0-9.]+), accuracy ([0-9.]+)$",
                      out, re.MULTILINE)
    assert found, out
    assert (tmp_path / "model.ckpt-30.index").is_file()
    assert list((tmp_path / "export" / "digits").glob("*/saved_model.pb")), out
    reference = run_reference("examples/estimator.py", "--steps", 30, "--model-dir",
                              tmp_path / "reference")
    assert_weights_equal_reference(out, reference)
    assert abs(float(found.group(2)) - accuracy_of(reference)) <= ACCURACY_ATOL, (
        f"{out}\nreference:\n{reference}")
    assert_loss_equals_reference(found.group(1), reference)

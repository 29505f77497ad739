"""tf-keras on real ranks: Model.fit with DistributedOptimizer equals single-process fit on the
global batch; the callbacks (broadcast, metric average, warmup, backup/restore) and load_model."""

from __future__ import annotations

from harness import run_ranks


def test_keras_fit_on_2_ranks_equals_single_process_fit_graph_and_eager():
    cases = ("sgd:graph", "adam:graph", "momentum:eager", "legacy_adam:eager")
    out = run_ranks(2, "tests/workers/keras_fit.py", *cases, timeout=300).stdout
    for case in cases:
        assert f"{case}: same weights as single-process fit on the global batch" in out, out


def test_keras_fit_on_3_ranks_equals_single_process_fit():
    cases = ("adam:graph",)
    out = run_ranks(3, "tests/workers/keras_fit.py", *cases, timeout=300).stdout
    for case in cases:
        assert f"{case}: same weights as single-process fit on the global batch" in out, out

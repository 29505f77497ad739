"""tf.estimator through perseus_legacy on TF 2.21 (main venv), TF 2.16.2 and TF 2.15.1.

estimator_scenarios.py runs once per version, all versions at the same time, each in its own
process, started right after collection (conftest.py). The tests below assert on what each run
recorded, and compare the TF >= 2.16 numbers (the real tensorflow-estimator through our
compatibility layer) with the TF 2.15.1 run of the real tf.estimator, same seed, same data.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness import VERSIONS

# Same seed, same data, same kernels up to float32 rounding: TF 2.21 and 2.16 agree with 2.15.1
# to ~1e-7 on this machine. A real behaviour change (initializers, optimizer, head, Keras 3)
# moves these numbers by 1e-2 or more.
RTOL = 1e-4
ATOL = 1e-5
CANNED = ("DNNClassifier", "DNNRegressor", "LinearClassifier", "LinearRegressor",
          "DNNLinearCombinedClassifier")
SUPPLIED = "supplied by perseus_legacy"
PRESENT = "present in TensorFlow"


@pytest.fixture(params=VERSIONS)
def version(request):
    return request.param


def _close(actual, expected, what):
    np.testing.assert_allclose(np.asarray(actual, float), np.asarray(expected, float),
                               rtol=RTOL, atol=ATOL, err_msg=what)


def _assert_same_numbers(actual, expected, path="results"):
    """Floats within RTOL/ATOL, everything else (names, counts, ids, strings) exactly equal."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), f"{path}: keys differ"
        for key in expected:
            _assert_same_numbers(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, float) or (
            isinstance(expected, list) and expected and
            isinstance(np.asarray(expected).flat[0].item(), float)):
        _close(actual, expected, path)
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def test_compat_layer_supplies_exactly_what_this_tensorflow_lacks(matrix, version):
    report = matrix.result(version)["compat"]
    # The pieces of the estimator API (the Keras sessions and the stop agreement are changes of
    # another kind, made on every version).
    pieces = {k: v for k, v in report.items()
              if k.startswith(("tensorflow.", "tf.", "tf_export."))
              and not k.startswith("tf.keras.")}
    assert len(pieces) == 7, report
    if version == "tf215":
        assert report["tensorflow"].startswith("2.15."), report
        assert set(pieces.values()) == {PRESENT}, report
        assert report["legacy keras"].startswith("not needed"), report
    else:
        assert tuple(map(int, report["tensorflow"].split(".")[:2])) >= (2, 16), report
        assert set(pieces.values()) == {SUPPLIED}, report
        assert report["legacy keras"].startswith("selected: TF_USE_LEGACY_KERAS=1"), report
    assert report["tensorflow-estimator"] == "2.15.0", report


def test_estimator_is_reachable_under_every_tf_name_as_the_real_package(matrix, version):
    names = matrix.scenario(version, "namespaces")
    assert names["tf.estimator"] == "tensorflow_estimator.python.estimator.estimator.EstimatorV2"
    assert names["tf.compat.v1.estimator"] == "Estimator"
    assert names["tf.compat.v2.estimator"], names
    assert names["tensorflow_estimator"] == "Estimator"
    assert names["shim_is_real"] and names["shim_dnn"] and names["shim_model_fn"], names
    assert names["tensorflow.estimator"], names
    assert names["perseus_reexports"], names
    assert names["tf_keras_dense"] == ("keras" if version == "tf215" else "tf_keras"), names


def test_custom_model_fn_trains_evaluates_predicts_and_warm_starts(matrix, version):
    run = matrix.scenario(version, "custom")
    assert run["global_step"] == 20 and run["latest_checkpoint"] == "model.ckpt-20"
    assert run["loss"] < math.log(3) and run["accuracy"] > 0.6, run
    probabilities = np.asarray(run["probabilities"])
    assert probabilities.shape == (8, 3)
    _close(probabilities.sum(axis=1), np.ones(8), "probabilities sum to 1")
    assert run["class_ids"] == probabilities.argmax(axis=1).tolist()
    assert {"embedding", "embedding/Adam", "logits/kernel/Adam_1", "global_step"} <= set(
        run["variable_names"])
    assert np.asarray(run["logits_kernel"]).shape == (8, 3)
    # warm start (learning rate 0): the embedding is the trained one, the dense layers are not.
    np.testing.assert_array_equal(run["warm_embedding"], run["trained_embedding"])
    assert not np.allclose(run["warm_logits_kernel"], run["logits_kernel"])


@pytest.mark.parametrize("name", CANNED)
def test_canned_estimator_with_feature_columns_learns(matrix, version, name):
    run = matrix.scenario(version, "canned")[name]
    metrics = run["metrics"]
    assert metrics["global_step"] == 40, metrics
    predictions = np.asarray(run["predictions"])
    if "Classifier" in name:  # multi-class head: better than predicting the class prior
        assert metrics["average_loss"] < math.log(3), metrics
        assert predictions.shape == (8, 3)
        _close(predictions.sum(axis=1), np.ones(8), "probabilities sum to 1")
    else:  # regression head: better than predicting the mean
        assert metrics["average_loss"] < run["label_variance"], metrics
        assert predictions.shape == (8, 1)


def test_exported_saved_model_serves_what_predict_returns(matrix, version):
    custom = matrix.scenario(version, "custom")
    _close(custom["served_probabilities"], custom["probabilities"], "custom serving_default")
    assert custom["served_class_ids"] == custom["class_ids"]

    canned = matrix.scenario(version, "canned_export")
    assert {"serving_default", "classification", "predict"} <= set(canned["signatures"])
    _close(canned["served_scores"], canned["probabilities"], "canned serving_default scores")
    _close(canned["served_predict_probabilities"], canned["probabilities"], "canned predict")
    assert canned["served_classes"] == ["0", "1", "2"] * 8


def test_local_train_and_evaluate_exports_latest_and_best(matrix, version):
    run = matrix.scenario(version, "train_and_evaluate")
    assert run["metrics"]["global_step"] == 20, run
    # checkpoints at steps 10 and 20, each evaluated and exported by LatestExporter; BestExporter
    # keeps one; the final evaluation returns one result per exporter.
    assert run["exports_latest"] == 2 and run["exports_best"] == 1, run
    assert run["export_results"] == 2, run


def test_run_config_parses_tf_config(matrix, version):
    run = matrix.scenario(version, "run_config")
    assert run["tf_config"] == {
        "cluster_spec": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                         "ps": ["host3:2222"]},
        "task_type": "worker", "task_id": 1, "is_chief": False, "master": "grpc://host2:2222",
        "num_worker_replicas": 3, "num_ps_replicas": 1, "global_id_in_cluster": 2,
    }
    local = run["local_strategy"]  # with train_distribute: through estimator_training
    assert (local["task_type"], local["is_chief"], local["num_worker_replicas"]) == (
        "worker", True, 1), local


@pytest.mark.parametrize("patched", ["main", "tf216"])
def test_patched_tf_matches_real_tf_estimator_on_tf215(matrix, patched):
    """Losses, metrics, predictions, variables, exports and RunConfig equal TF 2.15.1's."""
    reference = matrix.result("tf215")
    result = matrix.result(patched)
    for name in ("custom", "canned", "canned_export", "train_and_evaluate", "run_config"):
        expected = matrix.scenario("tf215", name)
        actual = matrix.scenario(patched, name)
        _assert_same_numbers(actual, expected,
                             f"{name} on TF {result['tensorflow']} vs {reference['tensorflow']}")

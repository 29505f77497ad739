"""Error paths and switches of the estimator compatibility layer, each in a fresh interpreter."""

from __future__ import annotations

import pytest
from harness import run_code

PATCHED = ["main", "tf216"]  # the TensorFlow versions without tf.estimator


def _ok(version, code, **extra_env):
    proc = run_code(version, code, extra_env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def _fails(version, code, **extra_env):
    proc = run_code(version, code, extra_env)
    assert proc.returncode != 0, proc.stdout[-6000:]
    return proc.stdout


@pytest.mark.parametrize("version", PATCHED)
def test_tpu_api_raises_an_error_naming_the_tensorflow_version(version):
    out = _ok(version, """
import perseus_legacy
import tensorflow as tf
from perseus_legacy.estimator import TPUUnavailableError
# The package's TPU modules import (tf.compat.v1.estimator.tpu lists them) ...
assert tf.compat.v1.estimator.tpu.TPUEstimator.__name__ == "TPUEstimator"
from tensorflow.python.tpu import session_support
from tensorflow.python.tpu.tpu_embedding import AdagradParameters
# ... and using one says why it cannot work here.
for use in (lambda: AdagradParameters(0.1), lambda: session_support.ShutdownAllWorkers()):
    try:
        use()
    except TPUUnavailableError as exc:
        print("ERROR:", exc)
    else:
        raise SystemExit("no error")
""")
    assert out.count("ERROR:") == 2, out
    assert "TensorFlow 2.16 removed tensorflow.python.tpu.tpu_embedding" in out, out
    version_text = "TensorFlow 2.21" if version == "main" else "TensorFlow 2.16.2"
    assert f"this is {version_text}" in out, out
    assert "TPU Estimator code needs TensorFlow <= 2.15" in out, out


@pytest.mark.parametrize("first", ["import keras", "import tensorflow"])
@pytest.mark.parametrize("version", PATCHED)
def test_keras3_bound_before_perseus_legacy_makes_the_estimator_api_raise_with_the_fix(
        version, first):
    out = _ok(version, f"""
{first}
import perseus_legacy  # the collectives stay usable: the error comes with the Estimator API
import tensorflow as tf
from perseus_legacy.estimator import Keras3AlreadyBoundError

uses = {{
    "tf.estimator": lambda: tf.estimator.Estimator,
    "tf.compat.v1.estimator": lambda: tf.compat.v1.estimator.RunConfig,
    "perseus_legacy.estimator": lambda: perseus_legacy.estimator.DNNClassifier,
    "tensorflow.python.estimator": lambda: __import__("tensorflow.python.estimator.estimator"),
}}
for name, use in uses.items():
    try:
        use()
    except Keras3AlreadyBoundError as exc:
        print("ERROR", name, ":", exc)
    else:
        raise SystemExit(name + " did not raise")
print("REPORT:", perseus_legacy.estimator.compat_report()["legacy keras"])
""")
    assert out.count("ERROR ") == 4, out
    assert "was imported before perseus_legacy and bound tf.keras to Keras 3" in out, out
    assert "put `import perseus_legacy` before any tensorflow/keras import" in out, out
    assert "or start Python with TF_USE_LEGACY_KERAS=1" in out, out
    assert "REPORT: too late: TensorFlow" in out, out


def test_tensorflow_first_is_fine_when_legacy_keras_is_set_in_the_environment():
    _ok("main", """
import tensorflow as tf
import perseus_legacy
assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
assert tf.estimator.Estimator.__name__ == "EstimatorV2"
""", TF_USE_LEGACY_KERAS="1")


def test_an_explicit_keras3_choice_is_kept_and_reported():
    out = _ok("main", """
import tensorflow as tf
import perseus_legacy
print("REPORT:", perseus_legacy.estimator.compat_report()["legacy keras"])
assert tf.keras.__version__.startswith("3."), tf.keras.__version__
""", TF_USE_LEGACY_KERAS="0")
    assert "REPORT: left as TF_USE_LEGACY_KERAS=0 (Keras 3)" in out, out


@pytest.mark.parametrize("version", PATCHED)
def test_no_tf_patch_turns_every_patch_off_and_the_estimator_api_says_why(version):
    out = _ok(version, """
import os
import perseus_legacy
import tensorflow as tf
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.util import tf_export

assert "TF_USE_LEGACY_KERAS" not in os.environ, "legacy Keras was selected"
assert "estimator" not in vars(tf), "tf.estimator was set"
assert not hasattr(tf.compat.v1, "estimator"), "tf.compat.v1.estimator was set"
assert not hasattr(tf_export, "ESTIMATOR_API_NAME"), "tf_export was changed"
assert "PerseusAllreduce" not in auto_control_deps.ASYNC_STATEFUL_OPS
for name in ("tensorflow.python.estimator", "tensorflow.python.distribute.estimator_training",
             "tensorflow.python.tpu.tpu_embedding"):
    try:
        __import__(name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(name + " was importable")
try:
    perseus_legacy.estimator.Estimator
except ImportError as exc:
    print("ERROR:", exc)
for piece, status in perseus_legacy.tf_compat.compat_report().items():
    print("REPORT:", piece, "=", status)
""", PERSEUS_NO_TF_PATCH="1")
    assert "ERROR: tf.estimator on TensorFlow 2." in out, out
    assert "PERSEUS_NO_TF_PATCH=1 turned them off" in out, out
    report = dict(line[len("REPORT: "):].split(" = ", 1) for line in out.splitlines()
                  if line.startswith("REPORT: "))
    # The estimator wrappers are made by run_config(), not at import: PERSEUS_NO_TF_PATCH
    # leaves them to it.
    patches = {k: v for k, v in report.items()
               if k not in ("tensorflow", "tensorflow-estimator", "tf-keras")
               and not k.startswith("tensorflow_estimator ")}
    assert len(patches) == 13, report
    assert set(patches.values()) == {"left alone (PERSEUS_NO_TF_PATCH=1)"}, report


def test_distribute_coordinator_config_is_refused_with_what_to_use_instead():
    out = _ok("main", """
import perseus_legacy
import tensorflow as tf
from tensorflow.python.distribute.distribute_config import DistributeConfig

strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
try:
    tf.estimator.RunConfig(experimental_distribute=DistributeConfig(train_distribute=strategy))
except ValueError as exc:
    print("ERROR:", exc)
""")
    assert "ERROR: RunConfig(experimental_distribute=...) configured the distribute coordinator" \
        in out, out
    assert "pass train_distribute= / eval_distribute= instead" in out, out


@pytest.mark.parametrize("version, status", [("main", "supplied by perseus_legacy"),
                                             ("tf215", "present in TensorFlow")])
def test_diagnostics_report_which_compat_pieces_were_applied(version, status):
    out = _ok(version, "import runpy\nrunpy.run_module('perseus_legacy', run_name='__main__')\n")
    assert "TensorFlow patches:" in out, out
    for piece in ("tensorflow.python.distribute.estimator_training",
                  "tf_export.ESTIMATOR_API_NAME", "tensorflow.python.tpu.tpu_embedding",
                  "tensorflow.python.estimator"):
        assert f"  {piece}: {status}" in out, out


def test_tf215_keeps_its_own_tf_estimator_and_keras():
    _ok("tf215", """
import os
import perseus_legacy
import tensorflow as tf
assert "TF_USE_LEGACY_KERAS" not in os.environ
assert type(tf.__dict__["estimator"]).__name__ == "LazyLoader"  # TensorFlow's own
import tensorflow.python.estimator.estimator as shim
assert shim.__file__.startswith(os.path.dirname(tf.__file__)), shim.__file__
""")


@pytest.mark.parametrize("version", ["main", "tf216", "tf215"])
def test_tf_export_lists_the_estimator_names_of_estimator_symbols_as_tf_2_15_does(version):
    out = _ok(version, """
import perseus_legacy
from tensorflow.python.util import tf_export
from tensorflow_estimator.python.estimator import estimator, mode_keys
from tensorflow_estimator.python.estimator.canned import dnn

for symbol in (estimator.Estimator, estimator.EstimatorV2, dnn.DNNClassifierV2,
               mode_keys.ModeKeys):
    print("NAMES:", symbol.__name__, tf_export.get_v1_names(symbol),
          tf_export.get_v2_names(symbol))
""")
    for line in ("Estimator ['estimator.Estimator'] []",
                 "EstimatorV2 [] ['estimator.Estimator']",
                 "DNNClassifierV2 [] ['estimator.DNNClassifier']",
                 "EstimatorModeKeys ['estimator.ModeKeys'] ['estimator.ModeKeys']"):
        assert f"NAMES: {line}" in out, out

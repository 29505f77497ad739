"""tf-keras on real ranks: Model.fit with DistributedOptimizer equals single-process fit on the
global batch; the callbacks (broadcast, metric average, warmup, backup/restore) and load_model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from harness import accuracy_of, run_ranks


def test_keras_fit_on_2_ranks_equals_single_process_fit_graph_and_eager():
    """Dense and embedding (sparse) gradients, 2 epochs: rtol 1e-5, atol 1e-6 (fp16 compression:
    rtol 2e-2, atol 2e-3)."""
    cases = ("sgd:graph", "adam:graph", "momentum:eager", "legacy_adam:eager", "sgd:graph:fp16",
             "adam:eager:sparse_as_dense+predivide")
    out = run_ranks(2, "tests/workers/keras_fit.py", *cases, timeout=300).stdout
    for case in cases:
        assert f"{case}: same weights as single-process fit on the global batch" in out, out


def test_keras_fit_on_3_ranks_equals_single_process_fit():
    cases = ("adam:graph",)
    out = run_ranks(3, "tests/workers/keras_fit.py", *cases, timeout=300).stdout
    for case in cases:
        assert f"{case}: same weights as single-process fit on the global batch" in out, out


@pytest.fixture(scope="module")
def callbacks_run(tmp_path_factory) -> list:
    """Every rank's record of tests/workers/keras_callbacks.py on 2 ranks (one launch)."""
    shared = tmp_path_factory.mktemp("keras_callbacks")
    run_ranks(2, "tests/workers/keras_callbacks.py", shared, timeout=300)
    return [json.loads((shared / f"rank{r}.json").read_text()) for r in range(2)]


def test_warmup_callback_sets_goyal_learning_rate_and_corrected_momentum_every_batch(
        callbacks_run):
    for seen in callbacks_run:
        w = seen["warmup"]
        size, steps, epochs, lr = seen["size"], w["steps_per_epoch"], w["warmup_epochs"], \
            w["initial_lr"]
        progress = np.array([e + b / steps for e in range(epochs + 1) for b in range(steps)])
        expected_lr = lr * np.minimum(1.0, (progress * (size - 1) / epochs + 1) / size)
        assert expected_lr[0] == pytest.approx(lr / size) and expected_lr[-1] == lr
        np.testing.assert_allclose(w["lr"], expected_lr, rtol=1e-6)
        previous = np.concatenate([[w["lr_before"]], expected_lr[:-1]])
        expected_momentum = w["base_momentum"] * expected_lr / previous
        np.testing.assert_allclose(w["momentum"], expected_momentum, rtol=1e-6)
        assert w["momentum_after"] == pytest.approx(w["base_momentum"])


def test_metric_average_callback_gives_the_mean_of_every_ranks_metrics(callbacks_run):
    raw = [seen["metric_average"]["raw"] for seen in callbacks_run]
    assert raw[0][0]["loss"] != raw[1][0]["loss"], "ranks must see different data"
    for seen in callbacks_run:
        averaged = seen["metric_average"]["averaged"]
        history = seen["metric_average"]["history"]
        assert len(averaged) == len(raw[0]) == 2
        for epoch, logs in enumerate(averaged):
            assert set(logs) == {"loss", "accuracy"}
            for key, value in logs.items():
                expected = np.mean([rank_raw[epoch][key] for rank_raw in raw])
                assert value == pytest.approx(expected, rel=1e-6), (epoch, key)
                assert history[key][epoch] == pytest.approx(expected, rel=1e-6), (epoch, key)


def test_broadcast_callback_makes_different_initial_weights_rank_0s(callbacks_run):
    initial = [np.array(seen["broadcast"]["initial"]) for seen in callbacks_run]
    assert not np.allclose(initial[0], initial[1]), "ranks must start from other weights"
    for seen in callbacks_run:
        np.testing.assert_array_equal(seen["broadcast"]["first_batch"], initial[0])


def test_backup_and_restore_resumes_every_rank_at_the_stopped_epoch_from_rank_0s_backup(
        callbacks_run):
    for seen in callbacks_run:
        b = seen["backup"]
        assert b["stopped_run"] == [0, 1, 2]
        assert b["resumed_run"] == [2, 3]  # epochs 0 and 1 came from the backup
        assert b["backup_dirs_after_stop"] == ["backup-rank0"]  # only rank 0 wrote
        assert b["backup_left_after_resume"] is False  # deleted when fit completed
        # Rank 1 restored nothing itself and started from other random weights.
        np.testing.assert_allclose(b["resumed"], b["uninterrupted"], rtol=1e-5, atol=1e-6)


def test_load_model_rewraps_the_optimizer_with_its_state(callbacks_run):
    for seen in callbacks_run:
        loaded = seen["load_model"]
        assert loaded["plain_is_distributed"] is False  # saved as a plain Adam
        assert loaded["loaded_is_distributed"] is True and loaded["loaded_class"] == "Adam"
        assert loaded["iterations_loaded"] == loaded["iterations_saved"] > 0
    # One more distributed epoch after loading equals two single-process epochs.
    assert callbacks_run[0]["load_model"]["max_diff_to_single_process"] < 1e-5


def test_keras_fit_example_trains_above_chance_and_rank_0_saves(tmp_path):
    out = run_ranks(2, "examples/keras_fit.py", "--smoke", "--model-dir", tmp_path,
                    timeout=240).stdout
    assert "ranks: 2  epochs: 2" in out, out
    assert accuracy_of(out) > 0.3, out
    assert (tmp_path / "model.keras").is_file(), sorted(p.name for p in tmp_path.iterdir())


# Single process, no ranks (this pytest process never initialises MPI).

@pytest.fixture(scope="module")
def keras_api():
    import perseus_legacy.keras as hvd  # noqa: I001 (first: it selects tf-keras)
    import tf_keras

    assert not hvd.is_initialized()
    return hvd, tf_keras


def test_distributed_optimizer_keeps_the_class_and_config_and_rejects_bad_arguments(keras_api):
    hvd, tf_keras = keras_api
    import tensorflow as tf

    for plain in (tf_keras.optimizers.SGD(0.3, momentum=0.5, nesterov=True),
                  tf_keras.optimizers.legacy.Adam(0.02, beta_1=0.8)):
        wrapped = hvd.DistributedOptimizer(plain, compression=hvd.Compression.fp16)
        assert isinstance(wrapped, type(plain)) and wrapped is not plain
        assert type(wrapped).__name__ == type(plain).__name__
        assert wrapped.get_config() == plain.get_config()
        with pytest.raises(ValueError, match="already distributed"):
            hvd.DistributedOptimizer(wrapped)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf_keras.optimizers.SGD(), backward_passes_per_step=0)
    # Horovod's arguments are accepted (device placement is ignored: kernels run on the CPU).
    hvd.DistributedOptimizer(tf_keras.optimizers.SGD(), device_dense="/gpu:0",
                             device_sparse="/gpu:0", backward_passes_per_step=2,
                             average_aggregated_gradients=True, num_groups=0, groups=2)
    with pytest.raises(ValueError, match="op=Average and op=Sum"):
        hvd.PartialDistributedOptimizer(tf_keras.optimizers.SGD(), op=hvd.Max)
    with pytest.raises(TypeError, match="perseus_legacy.DistributedOptimizer"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(ValueError, match="gradient_predivide_factor needs op=Average"):
        hvd.DistributedOptimizer(tf_keras.optimizers.SGD(), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


def test_keras_3_optimizer_is_rejected_with_a_hint(keras_api):
    hvd, _ = keras_api
    keras3 = pytest.importorskip("keras")
    if not keras3.__version__.startswith("3."):
        pytest.skip(f"keras {keras3.__version__} is not Keras 3")
    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        hvd.DistributedOptimizer(keras3.optimizers.SGD(0.1))


@pytest.mark.parametrize("filename", ["model.keras", "model.h5"])
def test_saved_model_names_the_plain_optimizer_and_load_model_rewraps_it(keras_api, tmp_path,
                                                                        filename):
    hvd, tf_keras = keras_api
    model = tf_keras.Sequential([tf_keras.layers.Input((3,)), tf_keras.layers.Dense(2)])
    model.compile(hvd.DistributedOptimizer(tf_keras.optimizers.Adam(0.05)), "mse")
    model.optimizer.build(model.trainable_variables)
    model.save(tmp_path / filename)
    plain = tf_keras.models.load_model(tmp_path / filename)
    assert type(plain.optimizer) is tf_keras.optimizers.Adam  # loads without perseus_legacy
    loaded = hvd.load_model(str(tmp_path / filename))
    assert isinstance(loaded.optimizer, tf_keras.optimizers.Adam)
    assert type(loaded.optimizer) is not tf_keras.optimizers.Adam  # the distributed subclass
    assert loaded.optimizer.get_config() == plain.optimizer.get_config()

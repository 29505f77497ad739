"""Estimator scenarios run by one TensorFlow version; results go to a JSON file for the matrix.

Usage: python estimator_scenarios.py OUT.json [MODEL_ROOT]
(ESTIMATOR_SCENARIOS=custom,canned runs a subset; canned_export reuses canned's checkpoint.)

Runs under the main venv (TF 2.21) and the compat venvs (TF 2.16, TF 2.15) with the repository
on PYTHONPATH. Each scenario records its numbers or its traceback, so one failure does not hide
the others; the pytest side (test_estimator_matrix.py) asserts on the file.
"""

import perseus_legacy  # noqa: F401, I001  (first: selects legacy Keras on TF >= 2.16)

import json
import os
import sys
import tempfile
import time
import traceback

import numpy as np
import tensorflow as tf

from perseus_legacy import estimator as pl_estimator

SEED = 42
ROWS = 64
BATCH = 16
STEPS = 20
CANNED_STEPS = 40
PREDICT_ROWS = 8
COLORS = ["red", "green", "blue"]
CITIES = ["paris", "lima", "oslo", "rome", "kyiv", "baku", "doha", "riga"]


def session_config():
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                    inter_op_parallelism_threads=1)


def run_config(model_dir, **kwargs):
    return tf.estimator.RunConfig(model_dir=model_dir, tf_random_seed=SEED,
                                  session_config=session_config(), log_step_count_steps=1000,
                                  **kwargs)


def floats(value):
    return np.asarray(value, dtype=np.float64).tolist()


# ---------------------------------------------------------------- data (numpy RandomState: the
# same stream under numpy 1.26 and numpy 2)

def custom_data():
    rng = np.random.RandomState(0)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    cat = rng.randint(0, 10, size=ROWS).astype(np.int64)
    w = rng.normal(size=(4, 3))
    v = rng.normal(size=(10, 3))
    labels = np.argmax(x @ w + v[cat], axis=1).astype(np.int64)
    return {"x": x, "cat": cat}, labels


def canned_data():
    rng = np.random.RandomState(1)
    age = rng.uniform(18, 70, size=ROWS).astype(np.float32)
    color = np.array([COLORS[i] for i in rng.randint(0, 3, size=ROWS)])
    city = np.array([CITIES[i] for i in rng.randint(0, 8, size=ROWS)])
    score = (age - 44) / 15 + np.array([{"red": 1.0, "green": -1.0, "blue": 0.0}[c]
                                        for c in color])
    score += np.array([CITIES.index(c) % 3 - 1 for c in city]) * 0.5
    label_class = np.digitize(score, [-0.5, 0.5]).astype(np.int64)
    label_value = (score + rng.normal(scale=0.1, size=ROWS)).astype(np.float32)
    return {"age": age, "color": color, "city": city}, label_class, label_value


def train_input_fn(features, labels):
    def input_fn():
        data = tf.data.Dataset.from_tensor_slices((dict(features), labels))
        return data.repeat().batch(BATCH)
    return input_fn


def eval_input_fn(features, labels):
    def input_fn():
        return tf.data.Dataset.from_tensor_slices((dict(features), labels)).batch(BATCH)
    return input_fn


def predict_input_fn(features):
    def input_fn():
        rows = {k: v[:PREDICT_ROWS] for k, v in features.items()}
        return tf.data.Dataset.from_tensor_slices(rows).batch(PREDICT_ROWS)
    return input_fn


def serialized_examples(features):
    examples = []
    for i in range(PREDICT_ROWS):
        feature = {}
        for key, column in features.items():
            value = np.atleast_1d(column[i])
            if value.dtype.kind == "f":
                feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=value))
            elif value.dtype.kind in "iu":
                feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=value))
            else:
                feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[s.encode() for s in value]))
        examples.append(tf.train.Example(features=tf.train.Features(feature=feature))
                        .SerializeToString())
    return examples


def serving_outputs(loaded, features, signature="serving_default"):
    """Runs a loaded SavedModel's signature on the prediction rows, sent as tf.Examples."""
    fn = loaded.signatures[signature]
    (input_name,) = fn.structured_input_signature[1].keys()
    outputs = fn(**{input_name: tf.constant(serialized_examples(features))})
    return {k: v.numpy() for k, v in outputs.items()}


# ---------------------------------------------------------------- custom model_fn

def custom_model_fn(features, labels, mode, params):
    embedding = tf.compat.v1.get_variable(
        "embedding", [10, 3], initializer=tf.compat.v1.random_uniform_initializer(-0.5, 0.5, 1))
    net = tf.concat([features["x"], tf.nn.embedding_lookup(embedding, features["cat"])], axis=1)
    net = tf.compat.v1.layers.dense(
        net, 8, activation=tf.nn.relu, name="hidden",
        kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    logits = tf.compat.v1.layers.dense(
        net, 3, name="logits", kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=3))
    predictions = {"probabilities": tf.nn.softmax(logits),
                   "class_ids": tf.argmax(logits, axis=1)}
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions=predictions, export_outputs={
            "serving_default": tf.estimator.export.PredictOutput(predictions)})
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
    metrics = {"accuracy": tf.compat.v1.metrics.accuracy(labels, predictions["class_ids"])}
    train_op = tf.compat.v1.train.AdamOptimizer(params["learning_rate"]).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      eval_metric_ops=metrics)


CUSTOM_FEATURE_SPEC = {"x": tf.io.FixedLenFeature([4], tf.float32),
                       "cat": tf.io.FixedLenFeature([], tf.int64)}


def scenario_custom(root):
    features, labels = custom_data()
    model_dir = os.path.join(root, "custom")
    est = tf.estimator.Estimator(custom_model_fn, config=run_config(model_dir),
                                 params={"learning_rate": 0.05})
    est.train(train_input_fn(features, labels), steps=STEPS)
    metrics = est.evaluate(eval_input_fn(features, labels))
    predictions = list(est.predict(predict_input_fn(features)))

    # warm start: the embedding comes from the trained checkpoint, the dense layers do not.
    warm = tf.estimator.Estimator(
        custom_model_fn, config=run_config(os.path.join(root, "custom_warm")),
        params={"learning_rate": 0.0},
        warm_start_from=tf.estimator.WarmStartSettings(model_dir, vars_to_warm_start="embedding"))
    warm.train(train_input_fn(features, labels), steps=1)

    export_dir = est.export_saved_model(
        os.path.join(root, "custom_export"),
        tf.estimator.export.build_parsing_serving_input_receiver_fn(CUSTOM_FEATURE_SPEC))
    served = serving_outputs(tf.saved_model.load(export_dir.decode()),
                             {k: v[:PREDICT_ROWS] for k, v in features.items()})
    return {
        "loss": float(metrics["loss"]),
        "accuracy": float(metrics["accuracy"]),
        "global_step": int(metrics["global_step"]),
        "probabilities": floats([p["probabilities"] for p in predictions]),
        "class_ids": [int(p["class_ids"]) for p in predictions],
        "variable_names": sorted(est.get_variable_names()),
        "logits_kernel": floats(est.get_variable_value("logits/kernel")),
        "latest_checkpoint": os.path.basename(est.latest_checkpoint()),
        "warm_embedding": floats(warm.get_variable_value("embedding")),
        "trained_embedding": floats(est.get_variable_value("embedding")),
        "warm_logits_kernel": floats(warm.get_variable_value("logits/kernel")),
        "served_probabilities": floats(served["probabilities"]),
        "served_class_ids": [int(c) for c in served["class_ids"]],
    }


# ---------------------------------------------------------------- canned estimators

def feature_columns():
    fc = tf.feature_column
    age = fc.numeric_column("age")
    age_buckets = fc.bucketized_column(age, boundaries=[25, 35, 45, 55])
    color = fc.categorical_column_with_vocabulary_list("color", COLORS)
    city = fc.categorical_column_with_hash_bucket("city", hash_bucket_size=20)
    crossed = fc.crossed_column([age_buckets, color], hash_bucket_size=16)
    normalized_age = fc.numeric_column("age", normalizer_fn=lambda a: (a - 44.0) / 15.0)
    return {
        "linear": [age_buckets, color, city, crossed, normalized_age],
        "dnn": [normalized_age, fc.indicator_column(color), fc.embedding_column(city, 3),
                fc.embedding_column(crossed, 2)],
    }


def canned_estimators(root):
    columns = feature_columns()
    config = run_config
    return {
        "DNNClassifier": (tf.estimator.DNNClassifier(
            hidden_units=[8], feature_columns=columns["dnn"], n_classes=3, optimizer="Adam",
            config=config(os.path.join(root, "dnn_classifier"))), "class"),
        "DNNRegressor": (tf.estimator.DNNRegressor(
            hidden_units=[8], feature_columns=columns["dnn"], optimizer="Adam",
            config=config(os.path.join(root, "dnn_regressor"))), "value"),
        "LinearClassifier": (tf.estimator.LinearClassifier(
            feature_columns=columns["linear"], n_classes=3,
            config=config(os.path.join(root, "linear_classifier"))), "class"),
        "LinearRegressor": (tf.estimator.LinearRegressor(
            feature_columns=columns["linear"],
            config=config(os.path.join(root, "linear_regressor"))), "value"),
        "DNNLinearCombinedClassifier": (tf.estimator.DNNLinearCombinedClassifier(
            linear_feature_columns=columns["linear"], dnn_feature_columns=columns["dnn"],
            dnn_hidden_units=[8], n_classes=3, dnn_optimizer="Adam",
            config=config(os.path.join(root, "combined_classifier"))), "class"),
    }


def scenario_canned(root):
    features, label_class, label_value = canned_data()
    results = {}
    for name, (est, target) in canned_estimators(root).items():
        labels = label_class if target == "class" else label_value
        est.train(train_input_fn(features, labels), steps=CANNED_STEPS)
        metrics = est.evaluate(eval_input_fn(features, labels))
        predictions = list(est.predict(predict_input_fn(features)))
        key = "probabilities" if target == "class" else "predictions"
        results[name] = {
            "metrics": {k: float(v) for k, v in metrics.items()},
            "label_variance": float(np.var(labels)),
            "predictions": floats([p[key] for p in predictions]),
        }
    return results


def scenario_canned_export(root):
    """export_saved_model + tf.saved_model.load: serving outputs equal predict() on the rows."""
    features, _, _ = canned_data()
    columns = feature_columns()
    # The model scenario_canned trained (its checkpoint in the same model_dir).
    est = canned_estimators(root)["DNNLinearCombinedClassifier"][0]
    predictions = list(est.predict(predict_input_fn(features)))
    spec = tf.feature_column.make_parse_example_spec(columns["linear"] + columns["dnn"])
    export_dir = est.export_saved_model(
        os.path.join(root, "export_combined"),
        tf.estimator.export.build_parsing_serving_input_receiver_fn(spec)).decode()
    rows = {k: v[:PREDICT_ROWS] for k, v in features.items()}
    loaded = tf.saved_model.load(export_dir)
    served = serving_outputs(loaded, rows)
    served_predict = serving_outputs(loaded, rows, signature="predict")
    return {
        "probabilities": floats([p["probabilities"] for p in predictions]),
        "served_scores": floats(served["scores"]),
        "served_classes": [c.decode() for c in served["classes"].ravel()],
        "served_predict_probabilities": floats(served_predict["probabilities"]),
        "signatures": sorted(loaded.signatures.keys()),
    }


# ---------------------------------------------------------------- train_and_evaluate

def scenario_train_and_evaluate(root):
    features, labels = custom_data()
    model_dir = os.path.join(root, "tae")
    est = tf.estimator.Estimator(
        custom_model_fn, params={"learning_rate": 0.05},
        config=run_config(model_dir, save_checkpoints_steps=10))
    serving_fn = tf.estimator.export.build_parsing_serving_input_receiver_fn(CUSTOM_FEATURE_SPEC)
    exporters = [tf.estimator.LatestExporter("latest", serving_fn, exports_to_keep=5),
                 tf.estimator.BestExporter("best", serving_fn, exports_to_keep=1)]
    metrics, export_results = tf.estimator.train_and_evaluate(
        est, tf.estimator.TrainSpec(train_input_fn(features, labels), max_steps=STEPS),
        tf.estimator.EvalSpec(eval_input_fn(features, labels), steps=None, exporters=exporters,
                              start_delay_secs=0, throttle_secs=0))
    exported = {}
    for name in ("latest", "best"):
        folder = os.path.join(model_dir, "export", name)
        exported[name] = sorted(
            d for d in os.listdir(folder)
            if os.path.exists(os.path.join(folder, d, "saved_model.pb")))
    return {
        "metrics": {k: float(v) for k, v in metrics.items()},
        "exports_latest": len(exported["latest"]),
        "exports_best": len(exported["best"]),
        "export_results": len(export_results),
    }


# ---------------------------------------------------------------- RunConfig from TF_CONFIG

TF_CONFIG = {
    "cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                "ps": ["host3:2222"]},
    "task": {"type": "worker", "index": 1},
}


def run_config_properties(config):
    return {
        "cluster_spec": config.cluster_spec.as_dict(),
        "task_type": config.task_type,
        "task_id": config.task_id,
        "is_chief": config.is_chief,
        "master": config.master,
        "num_worker_replicas": config.num_worker_replicas,
        "num_ps_replicas": config.num_ps_replicas,
        "global_id_in_cluster": config.global_id_in_cluster,
    }


def scenario_run_config(root):
    os.environ["TF_CONFIG"] = json.dumps(TF_CONFIG)
    try:
        from_tf_config = run_config_properties(tf.estimator.RunConfig())
    finally:
        del os.environ["TF_CONFIG"]
    # A strategy routes RunConfig through estimator_training.init_run_config.
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    local = tf.estimator.RunConfig(train_distribute=strategy)
    return {"tf_config": from_tf_config, "local_strategy": run_config_properties(local)}


# ---------------------------------------------------------------- names the package answers to

def scenario_namespaces(root):
    import tensorflow_estimator
    from tensorflow.estimator import RunConfig as api_run_config
    from tensorflow.python.estimator import estimator as shim_estimator
    from tensorflow.python.estimator import export as shim_export  # noqa: F401
    from tensorflow.python.estimator import exporter, gc, model_fn, run_config, training  # noqa: F401
    from tensorflow.python.estimator.canned import dnn as shim_dnn

    from perseus_legacy import estimator as tf_estimator

    return {
        "tf.estimator": tf.estimator.Estimator.__module__ + "." + tf.estimator.Estimator.__name__,
        "tf.compat.v1.estimator": tf.compat.v1.estimator.Estimator.__name__,
        "tf.compat.v2.estimator": tf.compat.v2.estimator.Estimator is tf.estimator.Estimator,
        "tensorflow_estimator": tensorflow_estimator.estimator.Estimator.__name__,
        "shim_is_real": shim_estimator.Estimator is tf.compat.v1.estimator.Estimator,
        "shim_dnn": shim_dnn.DNNClassifierV2 is tf.estimator.DNNClassifier,
        "shim_model_fn": model_fn.EstimatorSpec is tf.estimator.EstimatorSpec,
        "tensorflow.estimator": api_run_config is tf.estimator.RunConfig,
        "perseus_reexports": all(
            getattr(tf_estimator, n) is getattr(tf.estimator, n)
            for n in ("Estimator", "EstimatorSpec", "ModeKeys", "RunConfig", "TrainSpec",
                      "EvalSpec", "train_and_evaluate", "LatestExporter", "BestExporter",
                      "DNNClassifier", "LinearRegressor", "export")),
        "tf_keras_dense": tf.compat.v1.layers.Dense.__module__.split(".")[0],
    }


SCENARIOS = {
    "namespaces": scenario_namespaces,
    "custom": scenario_custom,
    "canned": scenario_canned,
    "canned_export": scenario_canned_export,
    "train_and_evaluate": scenario_train_and_evaluate,
    "run_config": scenario_run_config,
}


def main():
    out_path = sys.argv[1]
    root = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="estimator_matrix_")
    wanted = os.environ.get("ESTIMATOR_SCENARIOS", ",".join(SCENARIOS)).split(",")
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    result = {"tensorflow": tf.__version__, "compat": pl_estimator.compat_report(),
              "scenarios": {}}
    for name in wanted:
        start = time.time()
        try:
            data = SCENARIOS[name](root)
            result["scenarios"][name] = {"ok": True, "data": data}
        except Exception:  # recorded; the test for this scenario fails with the traceback
            result["scenarios"][name] = {"ok": False, "error": traceback.format_exc()}
        result["scenarios"][name]["seconds"] = round(time.time() - start, 1)
        print(f"scenario {name}: {'ok' if result['scenarios'][name]['ok'] else 'FAILED'} "
              f"({result['scenarios'][name]['seconds']} s)", flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()

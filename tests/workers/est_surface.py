"""The named cases of the tf.estimator surface matrix (tests/estimator/estimator_surface.py), run
on every rank or as their single-process reference.

Usage: est_surface.py OUT_DIR distributed CASE[,CASE...]   (every rank, perseusrun)
       est_surface.py OUT_DIR reference CASE[,CASE...]     (one plain process, global batch)
       est_surface.py OUT_DIR task WHO CASE[,CASE...]      (a TF_CONFIG task; TF_CONFIG set)

Each case builds its Estimator (a few: a MonitoredTrainingSession, in_session()) in a fresh graph
and model_dir, uses the symbol the way its own documentation does, and returns what the pytest
side compares with the reference:
  every   - what every rank must hold exactly as the reference (variables, global steps, the
            error a rank raised, ...): compared on every rank
  chief   - what rank 0 alone produces (metrics, predictions, exports, files written): compared
            on rank 0; the other ranks return their own view of it for the "wrote nothing" checks
A rank trains on its contiguous slice of every global batch; the reference on the whole batch.
Results go to OUT_DIR/<who>.json after every case (a launch that dies mid-way keeps the ones
before), as {case: {"ok": bool, "data": ..., "error": traceback}}.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import json
import logging
import os
import re
import sys
import traceback

import numpy as np
import tensorflow as tf
from worker_util import files_under

SEED = 5
STEPS = 4
GLOBAL_BATCH = 12  # divisible by 2 and 3
FEATURES, CLASSES = 3, 3
COLORS = ["red", "green", "blue", "gray"]
EVAL_ROWS, PREDICT_ROWS = 12, 6


# ---------------------------------------------------------------- the process and its data

class Process:
    """Who this process is (rank and size, or the reference) and where it writes."""

    def __init__(self, out: str, mode: str, who: str | None = None) -> None:
        self.distributed = mode in ("distributed", "task")
        self.tf_config = mode == "task"
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
        self.evaluator = self.tf_config and task.get("type") == "evaluator"
        if self.evaluator:  # no rank: it evaluates the chief's checkpoints
            self.rank, self.size, self.who = None, None, who
        elif self.distributed:
            pl.init()  # under TF_CONFIG: the TCP group of the chief and workers
            self.rank, self.size = pl.rank(), pl.size()
            self.who = who or f"rank{self.rank}"
        else:
            self.rank, self.size, self.who = 0, 1, "reference"
        self.out = out
        # This process's view of the "shared" root: what another rank writes is not seen here.
        # TF_CONFIG tasks share one model_dir (the evaluator reads the chief's checkpoints).
        self.view = os.path.join(out, "shared" if self.tf_config else f"fs_of_{self.who}")
        self.case = ""  # every case writes under its own directory of the view

    def config(self, name: str, **kwargs) -> tf.estimator.RunConfig:
        kwargs.setdefault("save_checkpoints_steps", STEPS)
        kwargs.update(model_dir=self.dir(name), tf_random_seed=SEED,
                      log_step_count_steps=None,
                      session_config=tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                              inter_op_parallelism_threads=1))
        if self.distributed:
            return pl.run_config(**kwargs)
        return tf.estimator.RunConfig(**kwargs)

    def dir(self, *parts: str) -> str:
        """A path under this case's directory of this process's view (model_dirs, hooks'
        output_dir, export bases)."""
        return os.path.join(self.view, self.case, *parts)


def table(rows: int, seed: int) -> tuple:
    """Features {"x": [rows, FEATURES] float, "color": [rows] string} and targets."""
    rng = np.random.RandomState(seed)  # the same stream under numpy 1.26 and 2
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    color = np.array([COLORS[i] for i in rng.randint(0, len(COLORS), size=rows)])
    score = x @ np.float32([1.0, -0.5, 0.25]) + np.array([COLORS.index(c) - 1.5 for c in color])
    targets = {
        "class": np.digitize(score, [-0.7, 0.7]).astype(np.int64),
        "binary": (score > 0).astype(np.int64),
        "value": score.astype(np.float32)[:, None],
        "count": np.abs(np.round(score)).astype(np.float32)[:, None],
        "labels": np.stack([score > 0, x[:, 0] > 0, x[:, 1] > 0.5], 1).astype(np.int64),
    }
    return {"x": x, "color": color}, targets


def train_input_fn(proc: Process, target, steps: int = STEPS, nan_at: tuple | None = None,
                   keys: tuple = ("x", "color")):
    """This process's slice of each of `steps` global batches. `target`: a key of table()'s
    targets, or a dict {head name: key}. nan_at=(step, rank): x of that step's batch is NaN in
    that rank's slice (every slice with rank None)."""
    features, targets = table(GLOBAL_BATCH * steps, 1)
    labels = ({k: targets[v] for k, v in target.items()} if isinstance(target, dict)
              else targets[target])
    if nan_at is not None:
        step, rank = nan_at
        lo, hi = step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH
        if rank is not None:
            local = GLOBAL_BATCH // 2
            lo, hi = lo + rank * local, lo + (rank + 1) * local
        features["x"] = features["x"].copy()
        features["x"][lo:hi] = np.nan
    rank, size = (0, 1) if proc.evaluator else (proc.rank, proc.size)
    local = GLOBAL_BATCH // size
    part = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local,
                                     s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(steps)])
    features = {k: features[k][part] for k in keys}
    labels = tf.nest.map_structure(lambda a: a[part], labels)
    return lambda: tf.data.Dataset.from_tensor_slices((features, labels)).batch(local)


def eval_input_fn(target, keys: tuple = ("x", "color")):
    features, targets = table(EVAL_ROWS, 2)
    features = {k: features[k] for k in keys}
    labels = ({k: targets[v] for k, v in target.items()} if isinstance(target, dict)
              else targets[target])
    return lambda: tf.data.Dataset.from_tensor_slices((features, labels)).batch(EVAL_ROWS)


def predict_input_fn(keys: tuple = ("x", "color")):
    features, _ = table(PREDICT_ROWS, 3)
    features = {k: features[k] for k in keys}
    return lambda: tf.data.Dataset.from_tensor_slices(features).batch(PREDICT_ROWS)


X = tf.feature_column.numeric_column("x", shape=[FEATURES])
COLOR = tf.feature_column.categorical_column_with_vocabulary_list("color", COLORS)
LINEAR_COLUMNS = [X, COLOR]
DNN_COLUMNS = [X, tf.feature_column.embedding_column(COLOR, 2)]
SPEC = tf.feature_column.make_parse_example_spec(LINEAR_COLUMNS)


# ---------------------------------------------------------------- what a case records

class Capture(tf.compat.v1.train.SessionRunHook):
    """Every rank's training session: the step it started and ended at, its final variables."""

    def __init__(self) -> None:
        self.record: dict = {"sessions": 0}

    def begin(self) -> None:
        # Not the early-stopping hooks' flag: the rank whose hook decided sets it (rank 0), the
        # others stop by agreement with it.
        self._variables = [v for v in tf.compat.v1.global_variables()
                           if not v.op.name.startswith("signal_early_stopping")]

    def after_create_session(self, session, coord) -> None:
        self.record["sessions"] += 1
        self.record["start_step"] = int(session.run(tf.compat.v1.train.get_global_step()))

    def end(self, session) -> None:
        values = session.run(self._variables)
        self.record["variables"] = {v.op.name: floats(x)
                                    for v, x in zip(self._variables, values)}
        self.record["end_step"] = int(self.record["variables"]["global_step"])


class Logs(logging.Handler):
    """TensorFlow's log lines that reach this process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


LOGS = Logs()


def floats(value) -> object:
    value = np.asarray(value)
    if value.dtype.kind in "iub":
        return value.tolist()
    if value.dtype.kind in "SUO":
        return [v.decode() if isinstance(v, bytes) else str(v) for v in value.ravel()]
    return value.astype(np.float64).tolist()


NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?")
EVENTS = re.compile(r"events\.out\.tfevents\.[^/]*$")
STAMP = re.compile(r"(^|/)\d{10}(/|$)")  # an export's timestamped directory


def written(path: str) -> list:
    """The files under `path`, with event files' host/time suffix and exports' timestamps
    replaced, so that two processes' files compare by name."""
    return sorted(STAMP.sub(r"\1<time>\2", EVENTS.sub("events", f)) for f in files_under(path))


def trained(proc: Process, est, target, steps: int = STEPS, hooks=(), evaluate: bool = True,
            predict: str | None = None, keys: tuple = ("x", "color"), **train_kwargs) -> dict:
    """train() for `steps` global steps with `hooks`, then rank 0 evaluates and predicts
    (input features: `keys`)."""
    capture = Capture()
    est.train(train_input_fn(proc, target, steps, keys=keys), max_steps=steps,
              hooks=[*hooks, capture], **train_kwargs)
    result = {"every": capture.record, "chief": {}}
    if proc.rank == 0:
        if evaluate:
            result["chief"]["metrics"] = {k: floats(v) for k, v in
                                          est.evaluate(eval_input_fn(target, keys)).items()}
        if predict:
            result["chief"]["predictions"] = [floats(p[predict])
                                              for p in est.predict(predict_input_fn(keys))]
    return result


def with_files(proc: Process, result: dict, name: str, est=None) -> dict:
    """Adds the files this process wrote under its view's `name` and, for other ranks, in the
    Estimator's private model_dir."""
    result.setdefault("chief", {})["files"] = written(proc.dir(name))
    if est is not None and proc.rank != 0:
        result["private_files"] = written(est.model_dir)
    return result


# ---------------------------------------------------------------- model_fns

def linear_model_fn(features, labels, mode, params):
    """y ~ x w + b + color embedding, SGD; params: optional hooks built from the model's
    tensors ("training_hooks": fn(tensors) -> hooks), learning-rate feed ("feed")."""
    w = tf.compat.v1.get_variable("w", initializer=tf.constant([[0.3], [-0.2], [0.1]]))
    b = tf.compat.v1.get_variable("b", initializer=tf.constant([0.05]))
    emb = tf.compat.v1.get_variable("emb", initializer=tf.constant(
        np.linspace(-0.4, 0.4, len(COLORS))[:, None].astype(np.float32)))
    table_ = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant(COLORS), tf.constant(np.arange(len(COLORS)))), -1)
    color = tf.nn.embedding_lookup(emb, table_.lookup(features["color"]))
    pred = tf.matmul(features["x"], w) + b + color
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"y": pred}, export_outputs={
            "serving_default": tf.estimator.export.RegressionOutput(pred)})
    loss = tf.compat.v1.losses.mean_squared_error(labels, pred)
    rate = 0.1
    if params.get("feed"):
        rate = tf.compat.v1.placeholder_with_default(0.1, [], name="learning_rate")
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.compat.v1.train.GradientDescentOptimizer(rate).minimize(loss, global_step=step)
    tensors = {"w": w, "b": b, "loss": loss, "step": step}
    hooks = params["training_hooks"](tensors) if params.get("training_hooks") else []
    return tf.estimator.EstimatorSpec(
        mode, loss=loss, train_op=train_op, training_hooks=hooks,
        eval_metric_ops={"mae": tf.compat.v1.metrics.mean_absolute_error(labels, pred)})


def linear_estimator(proc: Process, name: str, params: dict | None = None, **config):
    return tf.estimator.Estimator(linear_model_fn, config=proc.config(name, **config),
                                  params=params or {})


# ---------------------------------------------------------------- canned estimators and heads

def canned(estimator_cls, target, predict, keys=("x", "color"), **kwargs):
    def case(proc: Process) -> dict:
        est = estimator_cls(config=proc.config("model"), **kwargs)
        return with_files(proc, trained(proc, est, target, predict=predict, keys=keys),
                          "model", est)
    return case


def multi_head_case(proc: Process) -> dict:
    head = tf.estimator.MultiHead([tf.estimator.MultiClassHead(CLASSES, name="cls"),
                                   tf.estimator.RegressionHead(name="reg")])
    est = tf.estimator.DNNEstimator(head, hidden_units=[4], feature_columns=DNN_COLUMNS,
                                    config=proc.config("model"))
    return with_files(proc, trained(proc, est, {"cls": "class", "reg": "value"}), "model", est)


def v1_canned(proc: Process) -> dict:
    """The tf.compat.v1.estimator canned estimators: loss reduction SUM by default."""
    v1 = tf.compat.v1.estimator
    built = {
        "DNNClassifier": (v1.DNNClassifier(hidden_units=[4], feature_columns=DNN_COLUMNS,
                                           n_classes=CLASSES,
                                           config=proc.config("dnn_classifier")), "class"),
        "LinearRegressor": (v1.LinearRegressor(feature_columns=LINEAR_COLUMNS,
                                               config=proc.config("linear_regressor")), "value"),
        "BaselineClassifier": (v1.BaselineClassifier(n_classes=CLASSES,
                                                     config=proc.config("baseline")), "class"),
    }
    return trained_each(proc, built)


def trained_each(proc: Process, built: dict) -> dict:
    """trained() of each named (estimator, target) of `built`, by name."""
    result: dict = {"every": {}, "chief": {}}
    for name, (est, target) in built.items():
        one = trained(proc, est, target, keys=("x",) if "Baseline" in name else ("x", "color"))
        result["every"][name] = one["every"]
        result["chief"][name] = one["chief"]
    return result


def v1_canned_mean(proc: Process) -> dict:
    """The v1 canned estimators given loss_reduction=SUM_OVER_BATCH_SIZE (a mean loss)."""
    v1 = tf.compat.v1.estimator
    mean = tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE
    built = {
        "DNNRegressor": (v1.DNNRegressor(hidden_units=[4], feature_columns=DNN_COLUMNS,
                                         loss_reduction=mean, config=proc.config("dnn")),
                         "value"),
        "LinearClassifier": (v1.LinearClassifier(feature_columns=LINEAR_COLUMNS,
                                                 n_classes=CLASSES, loss_reduction=mean,
                                                 config=proc.config("linear")), "class"),
        "DNNLinearCombinedClassifier": (v1.DNNLinearCombinedClassifier(
            linear_feature_columns=LINEAR_COLUMNS, dnn_feature_columns=DNN_COLUMNS,
            dnn_hidden_units=[4], loss_reduction=mean, config=proc.config("combined")),
            "binary"),
        "BaselineRegressor": (v1.BaselineRegressor(loss_reduction=mean,
                                                   config=proc.config("baseline")), "value"),
    }
    return trained_each(proc, built)


def logit_fn_case(proc: Process) -> dict:
    """tf.compat.v1.estimator.Estimator with a model_fn made of the experimental logit_fn
    builders, call_logit_fn and a v2 Head's create_estimator_spec."""
    exp = tf.compat.v1.estimator.experimental
    head = tf.estimator.MultiClassHead(CLASSES)

    def model_fn(features, labels, mode, config):
        with tf.compat.v1.variable_scope("dnn"):
            dnn = exp.call_logit_fn(exp.dnn_logit_fn_builder(
                units=CLASSES, hidden_units=[4], feature_columns=DNN_COLUMNS,
                activation_fn=tf.nn.relu, dropout=None, input_layer_partitioner=None,
                batch_norm=False), features, mode, {}, config)
        with tf.compat.v1.variable_scope("linear"):
            linear = exp.call_logit_fn(exp.linear_logit_fn_builder(
                units=CLASSES, feature_columns=LINEAR_COLUMNS), features, mode, {}, config)
        return head.create_estimator_spec(
            features, mode, dnn + linear, labels=labels,
            optimizer=tf.keras.optimizers.legacy.Adagrad(0.1),
            trainable_variables=tf.compat.v1.trainable_variables())

    est = tf.compat.v1.estimator.Estimator(model_fn, config=proc.config("model"))
    return with_files(proc, trained(proc, est, "class"), "model", est)


def add_metrics_case(proc: Process) -> dict:
    est = tf.estimator.LinearRegressor(LINEAR_COLUMNS, config=proc.config("model"))

    def metric_fn(labels, predictions):
        metric = tf.keras.metrics.MeanSquaredError()
        metric.update_state(labels, predictions["predictions"])
        return {"mse": metric}

    est = tf.estimator.add_metrics(est, metric_fn)
    return with_files(proc, trained(proc, est, "value"), "model", est)


def rnn_case(proc: Process) -> dict:
    """RNNClassifier on a sequence column: every row is a sequence of its 3 x values."""
    column = tf.feature_column.sequence_numeric_column("seq")
    est = tf.estimator.experimental.RNNClassifier(
        sequence_feature_columns=[column], units=[3], cell_type="simple_rnn",
        n_classes=CLASSES, config=proc.config("model"))

    def as_sequence(input_fn):
        def fn():
            @tf.autograph.experimental.do_not_convert
            def convert(features, labels):
                seq = tf.sparse.from_dense(features["x"])
                return {"seq": seq}, labels
            return input_fn().map(convert)
        return fn

    capture = Capture()
    est.train(as_sequence(train_input_fn(proc, "class")), max_steps=STEPS, hooks=[capture])
    result = {"every": capture.record, "chief": {}}
    if proc.rank == 0:
        result["chief"]["metrics"] = {k: floats(v) for k, v in est.evaluate(
            as_sequence(eval_input_fn("class"))).items()}
    return with_files(proc, result, "model", est)


def numpy_input_fn_case(proc: Process) -> dict:
    """tf.compat.v1.estimator.inputs.numpy_input_fn over this process's slice of the batches."""
    features, targets = table(GLOBAL_BATCH * STEPS, 1)
    local = GLOBAL_BATCH // proc.size
    part = np.concatenate([np.arange(s * GLOBAL_BATCH + proc.rank * local,
                                     s * GLOBAL_BATCH + (proc.rank + 1) * local)
                           for s in range(STEPS)])
    input_fn = tf.compat.v1.estimator.inputs.numpy_input_fn(
        {"x": features["x"][part]}, targets["value"][part], batch_size=local, shuffle=False,
        num_epochs=1)
    est = tf.estimator.LinearRegressor([X], config=proc.config("model"))
    capture = Capture()
    est.train(input_fn, max_steps=STEPS, hooks=[capture])
    return with_files(proc, {"every": capture.record}, "model", est)


def warm_start_case(proc: Process) -> dict:
    """WarmStartSettings with a VocabInfo: the color embedding of a checkpoint trained on an old
    vocabulary (written by this process: a shared source every rank can read), remapped."""
    source = proc.dir("source")
    old_vocab, new_vocab = proc.dir("old_vocab.txt"), proc.dir("new_vocab.txt")
    os.makedirs(source, exist_ok=True)
    with open(old_vocab, "w") as f:
        f.write("blue\nred\ngreen\n")
    with open(new_vocab, "w") as f:
        f.write("\n".join(COLORS) + "\n")
    column = tf.feature_column.categorical_column_with_vocabulary_file("color", new_vocab)
    columns = [X, tf.feature_column.embedding_column(column, 2)]
    with tf.Graph().as_default():
        name = "dnn/input_from_feature_columns/input_layer/color_embedding/embedding_weights"
        var = tf.compat.v1.get_variable(name, initializer=tf.constant(
            [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
        with tf.compat.v1.Session() as session:
            session.run(var.initializer)
            tf.compat.v1.train.Saver([var]).save(session, os.path.join(source, "model.ckpt"))
    vocab_info = tf.estimator.VocabInfo(new_vocab=new_vocab, new_vocab_size=len(COLORS),
                                        num_oov_buckets=0, old_vocab=old_vocab,
                                        backup_initializer=tf.compat.v1.zeros_initializer())
    settings = tf.estimator.WarmStartSettings(
        source, vars_to_warm_start=".*color_embedding.*",
        var_name_to_vocab_info={name: vocab_info})
    est = tf.estimator.DNNRegressor(hidden_units=[4], feature_columns=columns,
                                    config=proc.config("model"), warm_start_from=settings)
    return with_files(proc, trained(proc, est, "value", steps=1), "model", est)


# ---------------------------------------------------------------- hooks

def hooked(proc: Process, make_hooks, in_model_fn: bool = False, params=None, **config) -> dict:
    """The linear model trained with hooks made by make_hooks(proc, tensors or None): given to
    train() or, with in_model_fn, returned in the EstimatorSpec's training_hooks."""
    params = dict(params or {})
    given = []
    if in_model_fn:
        params["training_hooks"] = lambda tensors: make_hooks(proc, tensors)
    else:
        given = make_hooks(proc, None)
    est = linear_estimator(proc, "model", params, **config)
    return with_files(proc, trained(proc, est, "value", hooks=given), "", est), given


def logging_tensor_case(proc: Process) -> dict:
    start = len(LOGS.lines)
    result, _ = hooked(proc, lambda p, t: [tf.compat.v1.train.LoggingTensorHook(
        {"w": t["w"], "step": t["step"]}, every_n_iter=1)], in_model_fn=True)
    lines = [line for line in LOGS.lines[start:] if line.startswith(("w = ", "step = "))]
    # The numbers of each line (the step, then w), without the line's "(0.05 sec)" timing.
    result["chief"]["logged"] = [[float(n) for n in NUMBER.findall(line.split(" (")[0])]
                                 for line in lines]
    return result


def nan_tensor_case(rank: int | None):
    """NaN in step 2's batch (global step 3): on every rank's slice (rank None), or on `rank`'s
    only. "said": the exception as its traceback ends."""
    def case(proc: Process) -> dict:
        est = linear_estimator(proc, "model", {"training_hooks": lambda t: [
            tf.compat.v1.train.NanTensorHook(t["loss"], fail_on_nan_loss=True)]})
        capture = Capture()
        raised = said = None
        try:
            est.train(train_input_fn(proc, "value", nan_at=(2, rank)), max_steps=STEPS,
                      hooks=[capture])
        except tf.compat.v1.estimator.NanLossDuringTrainingError as exc:
            raised = type(exc).__name__
            said = "".join(traceback.format_exception_only(exc))
        return with_files(proc, {"every": dict(capture.record, raised=raised),
                                 "chief": {"checkpoint_step": checkpoint_step(est)},
                                 "said": said}, "model", est)
    return case


def checkpoint_step(est) -> int | None:
    latest = est.latest_checkpoint()
    return None if latest is None else int(latest.rsplit("-", 1)[1])


def profiler_case(proc: Process) -> dict:
    result, _ = hooked(proc, lambda p, t: [tf.compat.v1.train.ProfilerHook(
        save_steps=2, output_dir=p.dir("profile"))], in_model_fn=True)
    result["chief"]["profile"] = written(proc.dir("profile"))
    return result


def feed_fn_case(proc: Process) -> dict:
    rates = iter([0.2, 0.05, 0.1, 0.3])
    result, _ = hooked(proc, lambda p, t: [tf.compat.v1.train.FeedFnHook(
        lambda: {"learning_rate:0": next(rates)})], params={"feed": True})
    return result


def final_ops_case(proc: Process) -> dict:
    hooks = {}

    def make(p, t):
        hook = tf.compat.v1.train.FinalOpsHook({"w": t["w"], "step": t["step"]})
        hooks.setdefault("final", hook)  # the training graph's (evaluate() makes another)
        return [hook]
    result, _ = hooked(proc, make, in_model_fn=True)
    result["every"]["final_ops"] = {k: floats(v)
                                    for k, v in hooks["final"].final_ops_values.items()}
    return result


def global_step_waiter_case(proc: Process) -> dict:
    """Trained to step 2, then on to STEPS with GlobalStepWaiterHook(wait_until_step=2): it
    lets every rank through at once (the global step is there)."""
    est = linear_estimator(proc, "model")
    est.train(train_input_fn(proc, "value"), max_steps=2)
    result = trained(proc, est, "value", hooks=[
        tf.compat.v1.train.GlobalStepWaiterHook(wait_until_step=2)])
    return with_files(proc, result, "model", est)


def step_counter_case(proc: Process) -> dict:
    result, _ = hooked(proc, lambda p, t: [tf.compat.v1.train.StepCounterHook(
        every_n_steps=1, output_dir=p.dir("steps"))], in_model_fn=True)
    result["chief"]["steps"] = event_steps(proc.dir("steps"))
    return result


def event_steps(path: str, values: bool = False) -> dict:
    """tag -> steps (or {step: value}) of the scalar summaries of the event files under path."""
    found: dict = {}
    for name in files_under(path):
        if "tfevents" not in name:
            continue
        try:
            for event in tf.compat.v1.train.summary_iterator(os.path.join(path, name)):
                for value in event.summary.value:
                    if values:
                        found.setdefault(value.tag, {})[str(event.step)] = value.simple_value
                    else:
                        found.setdefault(value.tag, []).append(event.step)
        except tf.errors.DataLossError:  # a writer still open (not flushed): what was read
            found.setdefault("<truncated>", []).append(name)
    return found


class Listener(tf.compat.v1.train.CheckpointSaverListener):
    """Records the steps it was called at."""

    def __init__(self) -> None:
        self.calls: list = []

    def begin(self) -> None:
        self.calls.append("begin")

    def after_save(self, session, global_step_value) -> None:
        self.calls.append(f"after_save {global_step_value}")

    def end(self, session, global_step_value) -> None:
        self.calls.append(f"end {global_step_value}")


def checkpoint_saver_case(proc: Process) -> dict:
    """CheckpointSaverHook (its own directory, every step) with a listener, and a listener
    given to train(saving_listeners=...)."""
    hook_listener, train_listener = Listener(), Listener()
    est = linear_estimator(proc, "model")
    result = trained(proc, est, "value", hooks=[tf.compat.v1.train.CheckpointSaverHook(
        proc.dir("saver"), save_steps=1, listeners=[hook_listener])],
        saving_listeners=[train_listener])
    result["chief"]["hook_listener"] = hook_listener.calls
    result["chief"]["train_listener"] = train_listener.calls
    result["chief"]["saver_files"] = written(proc.dir("saver"))
    return with_files(proc, result, "model", est)


def in_session(proc: Process, make_hooks, nan_at: tuple | None = None, **settings) -> dict:
    """The linear model trained for STEPS steps by a MonitoredTrainingSession (no Estimator)
    with the hooks made by make_hooks(tensors), and SyncReplicasHook first on the ranks;
    `settings`: the session's. Returns the Capture record."""
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(SEED)
        features, labels = tf.compat.v1.data.make_one_shot_iterator(
            train_input_fn(proc, "value", nan_at=nan_at)()).get_next()
        tensors = {}
        spec = linear_model_fn(features, labels, tf.estimator.ModeKeys.TRAIN, {
            "training_hooks": lambda t: tensors.update(t) or []})
        capture = Capture()
        hooks = [*make_hooks(tensors), tf.compat.v1.train.StopAtStepHook(last_step=STEPS),
                 capture]
        if proc.distributed:
            hooks.insert(0, pl.SyncReplicasHook())
        settings.setdefault("log_step_count_steps", None)
        settings.setdefault("save_summaries_steps", None)
        with tf.compat.v1.train.MonitoredTrainingSession(
                hooks=hooks, config=tf.compat.v1.ConfigProto(
                    intra_op_parallelism_threads=1, inter_op_parallelism_threads=1),
                **settings) as session:
            while not session.should_stop():
                session.run(spec.train_op)
    tf.compat.v1.summary.FileWriterCache.clear()  # every event file whole, as at exit
    return capture.record


def session_writer_hooks_case(proc: Process) -> dict:
    """MonitoredTrainingSession given a checkpoint_dir (every rank the same path of its view,
    not pl.checkpoint_dir()) and, in hooks=, CheckpointSaverHook, SummarySaverHook and
    StepCounterHook with their own directories."""
    def make(t):
        w0 = tf.compat.v1.summary.scalar("w0", t["w"][0, 0])
        return [tf.compat.v1.train.CheckpointSaverHook(proc.dir("saver"), save_steps=1),
                tf.compat.v1.train.SummarySaverHook(save_steps=1, summary_op=w0,
                                                    output_dir=proc.dir("summaries")),
                tf.compat.v1.train.StepCounterHook(every_n_steps=1,
                                                   output_dir=proc.dir("steps"))]
    record = in_session(proc, make, checkpoint_dir=proc.dir("session"), save_checkpoint_steps=2,
                        save_summaries_steps=1, log_step_count_steps=1)
    result = {"every": record, "chief": {
        "summaries": event_steps(proc.dir("summaries"), values=True),
        "session_summaries": event_steps(proc.dir("session"), values=True).get("w0", {}),
        "steps": event_steps(proc.dir("steps"))}}
    return with_files(proc, result, "")


def nan_stop_case(proc: Process) -> dict:
    """NanTensorHook(fail_on_nan_loss=False) in a MonitoredTrainingSession (an Estimator adds
    its own failing one): NaN in step 2's batch, on rank 1's slice only; it requests a stop."""
    record = in_session(proc, lambda t: [tf.compat.v1.train.NanTensorHook(
        t["loss"], fail_on_nan_loss=False)], nan_at=(2, 1))
    return {"every": record}


def summary_saver_case(proc: Process) -> dict:
    def make(p, t):
        op = tf.compat.v1.summary.scalar("w0", t["w"][0, 0])
        return [tf.compat.v1.train.SummarySaverHook(save_steps=1, output_dir=p.dir("summaries"),
                                                    summary_op=op)]
    result, _ = hooked(proc, make, in_model_fn=True)
    result["chief"]["summaries"] = event_steps(proc.dir("summaries"), values=True)
    return result


def stop_at_step_case(proc: Process) -> dict:
    """StopAtStepHook(last_step=3) given to train() without steps: every rank ends at 3."""
    est = linear_estimator(proc, "model")
    capture = Capture()
    est.train(train_input_fn(proc, "value"),
              hooks=[tf.compat.v1.train.StopAtStepHook(last_step=3), capture])
    return with_files(proc, {"every": capture.record}, "model", est)


def in_memory_evaluator_case(proc: Process) -> dict:
    est = linear_estimator(proc, "model")
    hook = tf.estimator.experimental.InMemoryEvaluatorHook(est, eval_input_fn("value"),
                                                           every_n_iter=2)
    result = trained(proc, est, "value", hooks=[hook], evaluate=False)
    result["chief"]["eval"] = event_steps(os.path.join(proc.dir("model"), "eval"), values=True)
    # Every rank evaluates (the same variables, the same metrics); the other ranks' summaries go
    # to their private model_dir, removed at exit: not checked here.
    return with_files(proc, result, "model")


# ---------------------------------------------------------------- exports

def exported_outputs(export_dir: str, signature: str = "serving_default") -> dict:
    loaded = tf.saved_model.load(export_dir)
    fn = loaded.signatures[signature]
    features, _ = table(PREDICT_ROWS, 3)
    examples = [tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=features["x"][i])),
        "color": tf.train.Feature(bytes_list=tf.train.BytesList(
            value=[features["color"][i].encode()]))})).SerializeToString()
        for i in range(PREDICT_ROWS)]
    (name,) = fn.structured_input_signature[1].keys()
    return {k: floats(v) for k, v in fn(**{name: tf.constant(examples)}).items()}


def export_saved_model_case(proc: Process) -> dict:
    """export_saved_model and experimental_export_all_saved_models on rank 0, after training."""
    est = tf.estimator.LinearClassifier(LINEAR_COLUMNS, n_classes=CLASSES,
                                        config=proc.config("model"))
    result = trained(proc, est, "class", evaluate=False)
    if proc.rank == 0:
        serving = tf.estimator.export.build_parsing_serving_input_receiver_fn(SPEC)
        path = est.export_saved_model(proc.dir("export"), serving).decode()
        result["chief"]["served"] = exported_outputs(path)
        with tf.Graph().as_default():  # the receiver takes the placeholders' dtypes and shapes
            features = {"x": tf.compat.v1.placeholder(tf.float32, [None, FEATURES]),
                        "color": tf.compat.v1.placeholder(tf.string, [None])}
            labels = tf.compat.v1.placeholder(tf.int64, [None])
            supervised = tf.estimator.experimental.build_raw_supervised_input_receiver_fn(
                features, labels)
        path = est.experimental_export_all_saved_models(proc.dir("export_all"), {
            tf.estimator.ModeKeys.EVAL: supervised,
            tf.estimator.ModeKeys.PREDICT: serving}).decode()
        result["chief"]["all_signatures"] = {
            tag: sorted(tf.saved_model.load(path, tags=[tag]).signatures.keys())
            for tag in ("serve", "eval")}
    return with_files(proc, result, "", est)


def exporters_case(proc: Process) -> dict:
    """train_and_evaluate with FinalExporter, LatestExporter and BestExporter (no TF_CONFIG:
    rank 0 evaluates and exports)."""
    serving = tf.estimator.export.build_parsing_serving_input_receiver_fn(SPEC)
    est = tf.estimator.LinearRegressor(LINEAR_COLUMNS,
                                       config=proc.config("model", save_checkpoints_steps=2))
    exporters = [tf.estimator.FinalExporter("final", serving),
                 tf.estimator.LatestExporter("latest", serving, exports_to_keep=3),
                 tf.estimator.BestExporter("best", serving, exports_to_keep=1)]
    capture = Capture()
    returned = tf.estimator.train_and_evaluate(
        est, tf.estimator.TrainSpec(train_input_fn(proc, "value"), max_steps=STEPS,
                                    hooks=[capture]),
        tf.estimator.EvalSpec(eval_input_fn("value"), steps=None, exporters=exporters,
                              start_delay_secs=0, throttle_secs=0))
    # TF_CONFIG with an evaluator task: every task returns None, the evaluator exports.
    metrics, exports = returned or ({}, [])
    result = {"every": dict(capture.record, metrics={k: floats(v) for k, v in metrics.items()},
                            exports=len(exports)),
              "chief": {}}
    if proc.evaluator or (proc.rank == 0 and not proc.tf_config):
        final = os.path.join(proc.dir("model"), "export", "final")
        [stamp] = os.listdir(final)
        result["chief"]["served"] = exported_outputs(os.path.join(final, stamp), "predict")
    return with_files(proc, result, "model", est)


# ---------------------------------------------------------------- stopping

def early_stopping_case(factory: str, metric: str, arg):
    """stop_if_*_hook in the TrainSpec of train_and_evaluate, checked every step, an evaluation
    after every checkpoint (every step) as its documentation shows."""
    def case(proc: Process) -> dict:
        est = linear_estimator(proc, "model", save_checkpoints_steps=1)
        os.makedirs(est.eval_dir(), exist_ok=True)
        make = getattr(tf.estimator.experimental, factory)
        hook = make(est, metric, arg, run_every_secs=None, run_every_steps=1)
        capture = Capture()
        tf.estimator.train_and_evaluate(
            est, tf.estimator.TrainSpec(train_input_fn(proc, "value", steps=8), max_steps=8,
                                        hooks=[hook, capture]),
            tf.estimator.EvalSpec(eval_input_fn("value"), steps=None, start_delay_secs=0,
                                  throttle_secs=0))
        return with_files(proc, {"every": capture.record}, "model", est)
    return case


def make_early_stopping_case(proc: Process) -> dict:
    """make_early_stopping_hook with a should_stop_fn reading the model_dir (a checkpoint at
    step >= 2 exists): true on rank 0 only, whose model_dir holds the checkpoints."""
    est = linear_estimator(proc, "model", save_checkpoints_steps=1)

    def should_stop() -> bool:
        latest = est.latest_checkpoint()
        return latest is not None and int(latest.rsplit("-", 1)[1]) >= 2

    hook = tf.estimator.experimental.make_early_stopping_hook(est, should_stop,
                                                              run_every_secs=None,
                                                              run_every_steps=1)
    capture = Capture()
    est.train(train_input_fn(proc, "value", steps=8), max_steps=8, hooks=[hook, capture])
    return with_files(proc, {"every": capture.record}, "model", est)


class StopOn(tf.compat.v1.train.SessionRunHook):
    """Requests a stop after global step `step` on rank `rank` only (the reference: always)."""

    def __init__(self, proc: Process, rank: int, step: int) -> None:
        self._here = proc.rank == rank or not proc.distributed
        self._step = step

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(tf.compat.v1.train.get_global_step())

    def after_run(self, run_context, run_values):
        if self._here and run_values.results + 1 >= self._step:
            self.act(run_context)

    def act(self, run_context) -> None:
        run_context.request_stop()


class StepSeen(tf.compat.v1.train.SessionRunHook):
    """The global step after the last step whose after_run reached it (listed first: every
    rank's, the one a hook raised in included)."""

    def __init__(self) -> None:
        self.step = None

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs(tf.compat.v1.train.get_global_step())

    def after_run(self, run_context, run_values):
        self.step = int(run_values.results) + 1


class RaiseOn(StopOn):
    """Raises a ValueError in after_run at global step `step` on rank `rank` only (the
    reference: always)."""

    def act(self, run_context) -> None:
        raise ValueError(f"a bad value after global step {self._step}")


def hook_raises_case(proc: Process) -> dict:
    """A hook of a MonitoredTrainingSession raises a ValueError in its after_run, on rank 1
    only, at global step 3."""
    seen = StepSeen()
    raised = said = None
    try:
        in_session(proc, lambda t: [seen, RaiseOn(proc, 1, 3)])
    except ValueError as exc:
        raised = type(exc).__name__
        said = "".join(traceback.format_exception_only(exc))
    # The message: rank 1's is one process's; the other ranks' names rank 1 too (checked by
    # the test of this case's "said").
    return {"every": {"raised": raised, "last_step": seen.step}, "said": said}


def request_stop_case(rank: int):
    def case(proc: Process) -> dict:
        est = linear_estimator(proc, "model")
        capture = Capture()
        est.train(train_input_fn(proc, "value", steps=8), max_steps=8,
                  hooks=[StopOn(proc, rank, 2), capture])
        return with_files(proc, {"every": capture.record}, "model", est)
    return case


# ---------------------------------------------------------------- refused

def refused(build):
    """Builds and trains an estimator that cannot be distributed: every rank records the error
    it raised (type and message) and the checkpoint step (None: nothing trained)."""
    def case(proc: Process) -> dict:
        est = None
        try:
            est, input_fn = build(proc)  # TPUEstimator refuses the config when built
            est.train(input_fn, max_steps=STEPS)
            error = None
        except Exception as exc:  # the error under test; its message is checked by the test
            error = {"type": type(exc).__name__, "message": str(exc)}
        trained_step = checkpoint_step(est) if est is not None and proc.rank == 0 else None
        return {"every": {"trained_step": trained_step}, "error": error}
    return case


def kmeans(proc: Process):
    est = tf.compat.v1.estimator.experimental.KMeans(
        num_clusters=2, initial_clusters="random", seed=SEED, use_mini_batch=True,
        config=proc.config("model"))
    features, _ = table(GLOBAL_BATCH * STEPS, 1)
    local = GLOBAL_BATCH // proc.size
    x = features["x"][proc.rank * local:]
    return est, lambda: tf.data.Dataset.from_tensor_slices(x).batch(local).map(
        lambda rows: (rows, None))


def tpu_estimator(proc: Process):
    tpu = tf.compat.v1.estimator.tpu
    est = tpu.TPUEstimator(linear_model_fn, config=proc.config("model"), use_tpu=False,
                           train_batch_size=GLOBAL_BATCH)
    return est, train_input_fn(proc, "value")


# ---------------------------------------------------------------- the cases by name

CASES = {
    "dnn_regressor": canned(tf.estimator.DNNRegressor, "value", "predictions", hidden_units=[4],
                            feature_columns=DNN_COLUMNS),
    "dnn_estimator_multi_label": canned(tf.estimator.DNNEstimator, "labels", "probabilities",
                                        head=tf.estimator.MultiLabelHead(3), hidden_units=[4],
                                        feature_columns=DNN_COLUMNS),
    "linear_classifier": canned(tf.estimator.LinearClassifier, "class", "probabilities",
                                feature_columns=LINEAR_COLUMNS, n_classes=CLASSES),
    "linear_regressor": canned(tf.estimator.LinearRegressor, "value", "predictions",
                               feature_columns=LINEAR_COLUMNS),
    "linear_estimator_poisson": canned(tf.estimator.LinearEstimator, "count", "predictions",
                                       head=tf.estimator.PoissonRegressionHead(),
                                       feature_columns=LINEAR_COLUMNS),
    "combined_classifier": canned(tf.estimator.DNNLinearCombinedClassifier, "binary",
                                  "probabilities", linear_feature_columns=LINEAR_COLUMNS,
                                  dnn_feature_columns=DNN_COLUMNS, dnn_hidden_units=[4]),
    "combined_regressor": canned(tf.estimator.DNNLinearCombinedRegressor, "value",
                                 "predictions", linear_feature_columns=LINEAR_COLUMNS,
                                 dnn_feature_columns=DNN_COLUMNS, dnn_hidden_units=[4]),
    "combined_estimator_logistic": canned(
        tf.estimator.DNNLinearCombinedEstimator, "binary", "predictions",
        head=tf.estimator.LogisticRegressionHead(), linear_feature_columns=LINEAR_COLUMNS,
        dnn_feature_columns=DNN_COLUMNS, dnn_hidden_units=[4]),
    "baseline_classifier": canned(tf.estimator.BaselineClassifier, "class", "probabilities",
                                  keys=("x",), n_classes=CLASSES),
    "baseline_regressor": canned(tf.estimator.BaselineRegressor, "value", "predictions",
                                 keys=("x",)),
    "baseline_estimator_binary": canned(tf.estimator.BaselineEstimator, "binary",
                                        "probabilities", keys=("x",),
                                        head=tf.estimator.BinaryClassHead()),
    "dnn_estimator_multi_head": multi_head_case,
    "rnn_classifier": rnn_case,
    "v1_canned_sum": v1_canned,
    "v1_canned_mean": v1_canned_mean,
    "v1_logit_fns": logit_fn_case,
    "add_metrics": add_metrics_case,
    "numpy_input_fn": numpy_input_fn_case,
    "warm_start_vocab": warm_start_case,
    "logging_tensor_hook": logging_tensor_case,
    "nan_tensor_hook": nan_tensor_case(None),
    "profiler_hook": profiler_case,
    "feed_fn_hook": feed_fn_case,
    "final_ops_hook": final_ops_case,
    "global_step_waiter_hook": global_step_waiter_case,
    "step_counter_hook": step_counter_case,
    "checkpoint_saver_hook": checkpoint_saver_case,
    "summary_saver_hook": summary_saver_case,
    "session_writer_hooks": session_writer_hooks_case,
    "stop_at_step_hook": stop_at_step_case,
    "in_memory_evaluator_hook": in_memory_evaluator_case,
    "export_saved_model": export_saved_model_case,
    "exporters": exporters_case,
    # stopping: every rank must stop after the same step
    "stop_if_higher": early_stopping_case("stop_if_higher_hook", "mae", -1.0),
    "stop_if_lower": early_stopping_case("stop_if_lower_hook", "mae", 100.0),
    "stop_if_no_increase": early_stopping_case("stop_if_no_increase_hook", "mae", 0),
    "make_early_stopping_hook": make_early_stopping_case,
    "request_stop_rank0": request_stop_case(0),
    "nan_stop_on_one_rank": nan_stop_case,
    "hook_raises_on_one_rank": hook_raises_case,
    "nan_on_one_rank": nan_tensor_case(1),
    # refused before training
    "kmeans": refused(kmeans),
    "tpu_estimator": refused(tpu_estimator),
}


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    who = sys.argv[3] if mode == "task" else None
    names = sys.argv[-1].split(",")
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
    tf.get_logger().addHandler(LOGS)
    proc = Process(out, mode, who)
    path = os.path.join(out, f"{proc.who}.json")
    results: dict = {}
    for name in names:
        proc.case = name  # the Estimators build their graphs; the exports load eagerly
        # Keras layers' unseeded initializers (RNNClassifier's) draw from the global seeds.
        tf.keras.utils.set_random_seed(SEED)
        try:
            results[name] = {"ok": True, "data": CASES[name](proc)}
        except Exception:  # recorded: the test of this case fails with the traceback
            results[name] = {"ok": False, "error": traceback.format_exc()}
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"[{proc.who}] case {name}: {'ok' if results[name]['ok'] else 'FAILED'}",
              flush=True)


if __name__ == "__main__":
    main()

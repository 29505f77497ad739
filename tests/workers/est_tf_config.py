"""One TF_CONFIG task of an Estimator job (chief, worker or evaluator), or its reference.

Usage: est_tf_config.py OUT_DIR MODEL_DIR task WHO [MAX_STEPS]   (TF_CONFIG set by the test)
       est_tf_config.py OUT_DIR MODEL_DIR reference              (one plain process)

Every task runs `train_and_evaluate` on a DNNClassifier built on perseus_legacy.run_config()
(LatestExporter, checkpoints every 2 steps, MAX_STEPS default STEPS). A rank trains on its slice
of every global batch; the reference trains one plain Estimator on the whole global batch, then
evaluates its final checkpoint. Each process writes OUT_DIR/<WHO>.json (what it saw) and, on the
chief and the reference, OUT_DIR/<WHO>.npz (the variables of the final checkpoint).

With EST_DELETED_CHECKPOINT=1 (every task) the chief keeps one checkpoint (keep_checkpoint_max=1)
and the evaluator's first checkpoint is deleted between its choice and its read: the evaluator's
first evaluation writes its choice into OUT_DIR/chosen, then waits until the checkpoint is gone;
the chief trains its first step only once OUT_DIR/chosen is there, so its save of step 2
deletes it. A file handshake: no timing.
"""

from __future__ import annotations  # noqa: I001 (import order below is deliberate)

# perseus_legacy first: on TF >= 2.16 it brings tf.estimator back and selects legacy Keras.
import perseus_legacy as pl

import json
import os
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.training import server_lib
from worker_util import files_under, wait_until

SEED = 11
STEPS = 6
GLOBAL_BATCH = 16
FEATURES, CLASSES = 4, 3
SERVERS: list = []  # every TF server (tf.distribute.Server) this process created
DELETED_CHECKPOINT = os.environ.get("EST_DELETED_CHECKPOINT") == "1"
HANDSHAKE_SECS = 240


def _recording_init(original):
    def init(self, *args, **kwargs):
        SERVERS.append(repr(args[:1]))
        return original(self, *args, **kwargs)

    return init


server_lib.Server.__init__ = _recording_init(server_lib.Server.__init__)


def data(rows: int, seed: int) -> tuple:
    rng = np.random.RandomState(seed)  # the same stream under numpy 1.26 (TF 2.15) and 2
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = (np.abs(x[:, 0] + 2 * x[:, 1]).astype(np.int64)) % CLASSES
    return {"x": x}, y


def train_input_fn(rank: int, size: int):
    """This rank's contiguous slice of every global batch, for `STEPS` global batches."""
    features, y = data(GLOBAL_BATCH * STEPS, 1)
    local = GLOBAL_BATCH // size
    part = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local,
                                     s * GLOBAL_BATCH + (rank + 1) * local) for s in range(STEPS)])
    return lambda: tf.data.Dataset.from_tensor_slices(
        ({"x": features["x"][part]}, y[part])).batch(local).repeat()


def eval_input_fn():
    features, y = data(40, 2)
    return tf.data.Dataset.from_tensor_slices((features, y)).batch(10)


COLUMNS = [tf.feature_column.numeric_column("x", shape=[FEATURES])]


def estimator(config):
    return tf.estimator.DNNClassifier(hidden_units=[8], feature_columns=COLUMNS,
                                      n_classes=CLASSES, config=config)


def config_kwargs(model_dir: str) -> dict:
    kwargs = {"model_dir": model_dir, "tf_random_seed": SEED, "save_checkpoints_steps": 2,
              "session_config": tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                                         inter_op_parallelism_threads=1)}
    if DELETED_CHECKPOINT:
        kwargs["keep_checkpoint_max"] = 1
    return kwargs


def wait_for(what: str, done) -> None:
    """Returns once `done()` holds; exits with an error after HANDSHAKE_SECS."""
    if not wait_until(done, HANDSHAKE_SECS):
        sys.exit(f"the handshake failed: {what} within {HANDSHAKE_SECS} s")


class ChiefWaitsForTheChoice(tf.compat.v1.train.SessionRunHook):
    """The chief's first step waits until the evaluator has chosen a checkpoint."""

    def __init__(self, out: str) -> None:
        self._chosen = os.path.join(out, "chosen")

    def before_run(self, run_context):
        wait_for("the evaluator chose a checkpoint", lambda: os.path.exists(self._chosen))


class EvaluatorWaitsForTheDeletion(tf.compat.v1.train.SessionRunHook):
    """In its first evaluation, between choosing the checkpoint and restoring it (begin() runs
    before the session is created), the evaluator waits until the chief has deleted it."""

    def __init__(self, out: str, est) -> None:
        self._chosen, self._estimator = os.path.join(out, "chosen"), est

    def begin(self) -> None:
        if os.path.exists(self._chosen):
            return
        chosen = self._estimator.latest_checkpoint()  # the chief waits: nothing newer yet
        with open(self._chosen, "w") as f:
            f.write(chosen)
        wait_for(f"the chief deleted {chosen}",
                 lambda: not tf.io.gfile.exists(chosen + ".index"))


def checkpoint_values(model_dir: str) -> dict:
    return {name: tf.train.load_variable(model_dir, name)
            for name, _ in tf.train.list_variables(model_dir)}


def eval_events(model_dir: str) -> dict:
    """step -> {tag: value} of the evaluation summaries under model_dir/eval."""
    steps: dict = {}
    for name in files_under(os.path.join(model_dir, "eval")):
        if "tfevents" not in name:
            continue
        for event in tf.compat.v1.train.summary_iterator(os.path.join(model_dir, "eval", name)):
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    steps.setdefault(str(event.step), {})[value.tag] = value.simple_value
    return steps


def numbers(result) -> dict:
    return {k: float(v) for k, v in (result or {}).items()}


def reference(out: str, model_dir: str) -> None:
    est = estimator(tf.estimator.RunConfig(**config_kwargs(model_dir)))
    est.train(train_input_fn(0, 1), max_steps=STEPS)
    record = {"metrics": numbers(est.evaluate(eval_input_fn))}
    np.savez(os.path.join(out, "reference.npz"), **checkpoint_values(model_dir))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(record, f, indent=1)


def task(out: str, model_dir: str, who: str, max_steps: int) -> None:
    config = pl.run_config(**config_kwargs(model_dir))
    evaluator = config.task_type == "evaluator"
    rank, size = (None, None) if evaluator else (pl.rank(), pl.size())
    est = estimator(config)
    exporter = tf.estimator.LatestExporter("latest", tf.estimator.export.
                                           build_parsing_serving_input_receiver_fn(
                                               tf.feature_column.make_parse_example_spec(COLUMNS)))
    train_hooks, eval_hooks = [], []
    if DELETED_CHECKPOINT and rank == 0:
        train_hooks.append(ChiefWaitsForTheChoice(out))
    if DELETED_CHECKPOINT and evaluator:
        eval_hooks.append(EvaluatorWaitsForTheDeletion(out, est))
    train_spec = tf.estimator.TrainSpec(train_input_fn(rank or 0, size or 1), max_steps=max_steps,
                                        hooks=train_hooks)
    eval_spec = tf.estimator.EvalSpec(eval_input_fn, steps=None, exporters=[exporter],
                                      start_delay_secs=0, throttle_secs=1, hooks=eval_hooks)
    result = tf.estimator.train_and_evaluate(est, train_spec, eval_spec)
    record = {
        "rank": rank, "size": size, "model_dir": est.model_dir, "servers": SERVERS,
        "result": None if result is None else numbers(result[0]),
        "cluster_spec": bool(config.cluster_spec),
        # A plain RunConfig in the same process still sees the TF_CONFIG cluster.
        "plain_cluster_spec": bool(tf.estimator.RunConfig().cluster_spec),
    }
    if evaluator:
        record["eval_events"] = eval_events(model_dir)
        record["exports"] = files_under(os.path.join(model_dir, "export"))
    elif rank == 0:
        np.savez(os.path.join(out, f"{who}.npz"), **checkpoint_values(model_dir))
    else:
        record["private_files"] = files_under(est.model_dir)
    with open(os.path.join(out, f"{who}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"[{who}] done", flush=True)


def main() -> None:
    out, model_dir, mode = sys.argv[1:4]
    if mode == "reference":
        reference(out, model_dir)
    else:
        task(out, model_dir, sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else STEPS)


if __name__ == "__main__":
    main()

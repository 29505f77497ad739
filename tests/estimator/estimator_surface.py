"""The tf.estimator surface matrix: what N ranks do with every public symbol of tf.estimator,
tf.compat.v1.estimator (and their submodules) and the SessionRunHooks of tf.compat.v1.train, and
which case tests it. The single source of truth: test_estimator_surface.py runs the cases it
names, fails on a symbol the installed TensorFlow has and this table lacks (or the reverse), and
checks the table of docs/estimator.md against `markdown_table()`.

Usage: python estimator_surface.py symbols   (the public symbols of this TensorFlow, one a line;
                                              the test runs it under each TensorFlow version)
       python estimator_surface.py table     (the docs table)

A name is written as `X` (both tf.estimator.X and tf.compat.v1.estimator.X: one object, or the
same behaviour), `v2:X` (tf.estimator.X only), `v1:X` (tf.compat.v1.estimator.X only) or
`train:X` (tf.compat.v1.train.X). `tested_by` holds case names of tests/workers/est_surface.py
(run by test_estimator_surface.py) or paths of other tests (`path::test`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# What N ranks do: the outcome a case checks.
EQUAL = "equal"          # trains like one process on the global batch (variables, metrics,
                         # steps; files written by rank 0 only, the same as one process's)
STOPS = "stops"          # every rank stops after the same step, the step one process stops at
REFUSED = "refused"      # refused on every rank before training, with an error naming it
NOT_APPLICABLE = "n/a"   # a data type or helper with no distributed behaviour of its own
DIFFERS = "differs"      # differs from one process today, silently: must be fixed or refused
                         # (its case checks the EQUAL outcome and is an expected failure until
                         # then: once it passes, the entry must move to EQUAL)
OUTCOMES = (EQUAL, STOPS, REFUSED, NOT_APPLICABLE, DIFFERS)

NAMESPACES = {"v2": "tf.estimator", "v1": "tf.compat.v1.estimator", "train": "tf.compat.v1.train"}


@dataclass(frozen=True)
class Entry:
    names: tuple      # short names (see the module's docstring)
    outcome: str
    tested_by: tuple  # case names and/or test paths
    note: str

    def symbols(self) -> list:
        """The full names this entry classifies."""
        found = []
        for name in self.names:
            prefix, _, short = name.rpartition(":")
            spaces = [prefix] if prefix else ["v2", "v1"]
            found += [f"{NAMESPACES[space]}.{short}" for space in spaces]
        return found

    def cases(self) -> list:
        return [t for t in self.tested_by if "/" not in t]


DIST = "tests/estimator/test_distributed_estimator.py"
TFCONFIG = "tests/estimator/test_tf_config_estimator.py"
SUMMARIES = "tests/estimator/test_estimator_summaries.py"
ERRORS = "tests/estimator/test_estimator_errors.py"
SCENARIOS = "tests/estimator/test_estimator_matrix.py"
STOP_REQUESTS = ("tests/estimator/test_stop_requests.py::test_every_rank_stops_after_the_same_"
                 "step_as_one_process_and_logs_the_hook")
PER_RANK = ("tests/test_per_rank_updates.py::test_update_outside_the_optimizer_is_refused_or_"
            "matches_one_process")


def _e(names: str, outcome: str, tested_by: str, note: str) -> Entry:
    return Entry(tuple(names.split()), outcome, tuple(tested_by.split()), note)


ENTRIES = [
    # ---- Estimator, configuration, train_and_evaluate
    _e("v2:Estimator", EQUAL, f"{DIST}::test_run_config_alone_or_with_hooks_trains_like_one_"
       "process_on_the_global_batch add_metrics export_saved_model",
       "custom model_fn; evaluate, predict, export_saved_model and "
       "experimental_export_all_saved_models on rank 0 (the other ranks have no checkpoint)"),
    _e("v1:Estimator", EQUAL, "v1_logit_fns", "as tf.estimator.Estimator"),
    _e("RunConfig", EQUAL, f"{DIST}::test_only_rank_0_writes_and_private_model_dirs_are_removed_"
       "at_exit", "pass its arguments to pl.run_config(); other ranks get a private model_dir"),
    _e("TrainSpec EvalSpec train_and_evaluate", EQUAL,
       f"{DIST}::test_train_and_evaluate_without_tf_config_evaluates_on_rank_0_for_every_rank "
       f"{TFCONFIG}::test_chief_worker_and_evaluator_train_like_one_process_and_the_evaluator_"
       "exports exporters",
       "without TF_CONFIG rank 0 evaluates, every rank returns its metrics; with an evaluator "
       "task the evaluator does"),
    _e("WarmStartSettings VocabInfo", EQUAL, "warm_start_vocab",
       "every rank warm-starts (the source must be readable by every rank); rank 0's values "
       "are broadcast"),
    _e("add_metrics", EQUAL, "add_metrics", "the wrapped Estimator keeps run_config()"),
    # ---- canned estimators (v2: mean loss) and heads
    _e("v2:DNNClassifier", EQUAL, f"{DIST}::test_run_config_alone_or_with_hooks_trains_like_one_"
       f"process_on_the_global_batch {TFCONFIG}::test_chief_worker_and_evaluator_train_like_one_"
       "process_and_the_evaluator_exports", ""),
    _e("v2:DNNRegressor", EQUAL, "dnn_regressor", ""),
    _e("v2:DNNEstimator MultiLabelHead", EQUAL, "dnn_estimator_multi_label", ""),
    _e("MultiHead MultiClassHead RegressionHead", EQUAL, "dnn_estimator_multi_head",
       "one head per label key"),
    _e("v2:LinearClassifier", EQUAL, "linear_classifier",
       "sparse (categorical column) gradients are allgathered"),
    _e("v2:LinearRegressor", EQUAL, "linear_regressor", ""),
    _e("v2:LinearEstimator PoissonRegressionHead", EQUAL, "linear_estimator_poisson", ""),
    _e("v2:DNNLinearCombinedClassifier", EQUAL, "combined_classifier", ""),
    _e("v2:DNNLinearCombinedRegressor", EQUAL, "combined_regressor", ""),
    _e("v2:DNNLinearCombinedEstimator LogisticRegressionHead", EQUAL,
       "combined_estimator_logistic", ""),
    _e("v2:BaselineClassifier", EQUAL, "baseline_classifier", ""),
    _e("v2:BaselineRegressor", EQUAL, "baseline_regressor", ""),
    _e("v2:BaselineEstimator BinaryClassHead", EQUAL, "baseline_estimator_binary", ""),
    _e("Head", NOT_APPLICABLE, "v1_logit_fns dnn_estimator_multi_head",
       "base class of the heads; create_estimator_spec in a custom model_fn"),
    _e("v2:experimental.RNNClassifier v2:experimental.RNNEstimator", EQUAL, "rnn_classifier",
       "RNNEstimator is RNNClassifier's base with a head"),
    _e("v1:DNNClassifier v1:DNNRegressor v1:DNNEstimator v1:LinearClassifier "
       "v1:LinearRegressor v1:LinearEstimator v1:DNNLinearCombinedClassifier "
       "v1:DNNLinearCombinedRegressor v1:DNNLinearCombinedEstimator v1:BaselineClassifier "
       "v1:BaselineRegressor v1:BaselineEstimator", EQUAL, "v1_canned_sum v1_canned_mean",
       "their default loss_reduction=SUM is the sum over the batch: the ranks' gradients are "
       "summed, not averaged (the global batch's sum); other reductions are averaged"),
    _e("v1:experimental.dnn_logit_fn_builder v1:experimental.linear_logit_fn_builder "
       "experimental.call_logit_fn", EQUAL, "v1_logit_fns", "graph builders in a model_fn"),
    _e("v1:experimental.KMeans", REFUSED, f"kmeans {PER_RANK}",
       "updates its cluster centers with its own ops, not an optimizer: per-rank updates"),
    _e("experimental.LinearSDCA", REFUSED, PER_RANK,
       "SDCA updates its weights with its own ops, not an optimizer: per-rank updates"),
    _e("v1:tpu.TPUEstimator v1:tpu.RunConfig v1:tpu.TPUConfig v1:tpu.InputPipelineConfig "
       "v1:tpu.TPUEstimatorSpec v1:tpu.experimental.EmbeddingConfigSpec", REFUSED,
       f"tpu_estimator {ERRORS}::test_tpu_api_raises_an_error_naming_the_tensorflow_version",
       "TPUEstimator needs a tpu.RunConfig (refused by TPUEstimator itself); the TPU modules "
       "raise TPUUnavailableError on TensorFlow >= 2.16"),
    # ---- inputs and parsing
    _e("v1:inputs.numpy_input_fn", EQUAL, "numpy_input_fn", "give each rank its slice"),
    _e("v1:inputs.pandas_input_fn", NOT_APPLICABLE, "numpy_input_fn",
       "as numpy_input_fn (pandas is not installed here)"),
    _e("classifier_parse_example_spec regressor_parse_example_spec", NOT_APPLICABLE,
       "export_saved_model", "parsing specs: no state"),
    # ---- exports
    _e("Exporter", NOT_APPLICABLE, "exporters", "base class"),
    _e("FinalExporter LatestExporter BestExporter", EQUAL,
       f"exporters {TFCONFIG}::test_chief_worker_and_evaluator_train_like_one_process_and_the_"
       "evaluator_exports",
       "written once, by rank 0 (or the TF_CONFIG evaluator), as one process writes them"),
    _e("export.build_parsing_serving_input_receiver_fn export.build_raw_serving_input_receiver_fn "
       "export.ServingInputReceiver export.TensorServingInputReceiver "
       "experimental.build_raw_supervised_input_receiver_fn", NOT_APPLICABLE,
       "export_saved_model exporters", "receivers of an export on rank 0"),
    _e("export.ClassificationOutput export.RegressionOutput export.PredictOutput "
       "export.EvalOutput export.ExportOutput", NOT_APPLICABLE,
       "export_saved_model linear_regressor", "signatures of an export"),
    # ---- hooks
    _e("SessionRunHook SessionRunArgs SessionRunContext SessionRunValues train:SessionRunHook",
       STOPS, f"request_stop_rank0 hook_raises_on_one_rank {STOP_REQUESTS}",
       "the hook protocol (every case's capture hook uses it); a request_stop() on one rank "
       "stops every rank after that step; an exception from its after_run on one rank is "
       "raised by every rank after that step (the same class, built from its message)"),
    _e("SecondOrStepTimer", NOT_APPLICABLE, "logging_tensor_hook", "the hooks' timer"),
    _e("LoggingTensorHook train:LoggingTensorHook", EQUAL, "logging_tensor_hook",
       "rank 0 logs (the other ranks' INFO logs are dropped); a batch-dependent tensor holds "
       "rank 0's slice's value"),
    _e("NanTensorHook train:NanTensorHook", EQUAL, "nan_tensor_hook nan_stop_on_one_rank",
       "a NaN loss on every rank: every rank raises NanLossDuringTrainingError at its step; "
       "with fail_on_nan_loss=False (a MonitoredTrainingSession: an Estimator adds its own "
       "NanTensorHook), a NaN loss on one rank stops every rank after that step"),
    _e("NanLossDuringTrainingError", STOPS, "nan_on_one_rank",
       "a NaN loss in one rank's slice only (one process: NaN in the global batch): every rank "
       "raises it after that step, the other ranks with a note naming the rank and the global "
       "step (an exception from any hook's after_run is raised on every rank so)"),
    _e("ProfilerHook train:ProfilerHook", EQUAL, "profiler_hook",
       "given to train() or in training_hooks, rank 0 alone runs it and writes its timelines; "
       "built on another rank, it opens nothing (its summary writer opens when it begins)"),
    _e("FeedFnHook train:FeedFnHook", EQUAL, "feed_fn_hook", "fed on every rank"),
    _e("FinalOpsHook train:FinalOpsHook", EQUAL, "final_ops_hook",
       "every rank gets the final values"),
    _e("GlobalStepWaiterHook train:GlobalStepWaiterHook", EQUAL, "global_step_waiter_hook",
       "waits for the shared global step"),
    _e("StepCounterHook train:StepCounterHook", EQUAL, "step_counter_hook session_writer_hooks",
       "the Estimator's own one and one given to train() or in training_hooks, or in a "
       "MonitoredTrainingSession with SyncReplicasHook: rank 0 alone runs it and writes its "
       "summaries"),
    _e("CheckpointSaverHook train:CheckpointSaverHook", EQUAL,
       "checkpoint_saver_hook session_writer_hooks",
       "given to train(): rank 0 alone saves and runs its listeners (the others wait); in a "
       "MonitoredTrainingSession with SyncReplicasHook (in hooks= or its checkpoint_dir's): "
       "rank 0 alone saves"),
    _e("CheckpointSaverListener", EQUAL, f"{DIST}::test_train_and_evaluate_without_tf_config_"
       "evaluates_on_rank_0_for_every_rank checkpoint_saver_hook",
       "saving_listeners of train() run on rank 0 only"),
    _e("SummarySaverHook train:SummarySaverHook", EQUAL,
       f"summary_saver_hook session_writer_hooks {SUMMARIES}::test_tf_summary_in_a_model_fn_is_"
       "written_by_rank_0_only_with_the_numpy_losses", "the Estimator's own summaries and a "
       "SummarySaverHook given to train() or in training_hooks, or in a "
       "MonitoredTrainingSession with SyncReplicasHook: rank 0 alone writes them"),
    _e("StopAtStepHook train:StopAtStepHook", EQUAL, "stop_at_step_hook",
       "the global step is the same on every rank"),
    _e("experimental.InMemoryEvaluatorHook", EQUAL, "in_memory_evaluator_hook",
       "every rank evaluates (the same metrics); rank 0's summaries go to model_dir/eval, "
       "the others' to their private model_dir"),
    # ---- stopping
    _e("experimental.stop_if_higher_hook", STOPS, "stop_if_higher", ""),
    _e("experimental.stop_if_lower_hook", STOPS, "stop_if_lower", ""),
    _e("experimental.stop_if_no_decrease_hook", STOPS, STOP_REQUESTS,
       "in train_and_evaluate: perseusrun and TF_CONFIG (with and without an evaluator task)"),
    _e("experimental.stop_if_no_increase_hook", STOPS, "stop_if_no_increase", ""),
    _e("experimental.make_early_stopping_hook", STOPS, "make_early_stopping_hook",
       "its should_stop_fn may be true on one rank only (it reads the model_dir)"),
    _e("experimental.make_stop_at_checkpoint_step_hook", STOPS, STOP_REQUESTS,
       "every rank is a chief to tf.estimator: a StopAtStepHook"),
    # ---- plain data types
    _e("ModeKeys EstimatorSpec", NOT_APPLICABLE, "linear_regressor", "data types"),
]

# Cases where one rank alone stops or raises (a request_stop, a NaN loss in its slice only): run
# with the STOPS cases, whatever their entry's outcome.
STOP_CASES = ("request_stop_rank0", "nan_stop_on_one_rank", "nan_on_one_rank",
              "hook_raises_on_one_rank")
# Cases run on 3 ranks too: an odd count changes every slice and the gather of sparse rows.
ODD_CASES = ("linear_classifier", "combined_classifier")
# Cases run as TF_CONFIG tasks (chief, worker, evaluator), where the evaluator task changes
# who evaluates and exports.
TF_CONFIG_CASES = ("exporters",)


def entries_by_symbol() -> dict:
    found: dict = {}
    for entry in ENTRIES:
        for symbol in entry.symbols():
            if symbol in found:
                raise ValueError(f"{symbol} is classified twice")
            found[symbol] = entry
    return found


def cases(outcome: str) -> list:
    """The case names of the entries with `outcome`, in table order, each once."""
    names: list = []
    # A case shared with a DIFFERS entry runs (and fails) as that entry's.
    differs = {c for e in ENTRIES if e.outcome == DIFFERS for c in e.cases()}
    skip = set(STOP_CASES) | (differs if outcome != DIFFERS else set())
    for entry in ENTRIES:
        if entry.outcome == outcome:
            names += [c for c in entry.cases() if c not in names and c not in skip]
    if outcome == STOPS:
        names += list(STOP_CASES)
    return names


def public_symbols() -> list:
    """The public symbols of the installed tf.estimator, tf.compat.v1.estimator (submodules
    included) and the SessionRunHook subclasses and hook factories of tf.compat.v1.train."""
    import inspect  # noqa: I001 (perseus_legacy before tensorflow: it brings tf.estimator back)
    import types

    import perseus_legacy  # noqa: F401
    import tensorflow as tf

    found: list = []

    def walk(module, prefix: str, seen: set) -> None:
        for name in sorted(dir(module)):
            if name.startswith("_"):
                continue
            value = getattr(module, name)
            if isinstance(value, types.ModuleType):
                if id(value) not in seen:
                    seen.add(id(value))
                    walk(value, f"{prefix}.{name}", seen)
            else:
                found.append(f"{prefix}.{name}")

    walk(tf.estimator, NAMESPACES["v2"], set())
    walk(tf.compat.v1.estimator, NAMESPACES["v1"], set())
    for name in sorted(dir(tf.compat.v1.train)):
        value = getattr(tf.compat.v1.train, name)
        hook = inspect.isclass(value) and issubclass(value, tf.compat.v1.train.SessionRunHook)
        if hook or (callable(value) and name.lower().endswith("hook")):
            found.append(f"{NAMESPACES['train']}.{name}")
    return found


WHAT = {EQUAL: "equal to one process", STOPS: "every rank stops at one process's step",
        REFUSED: "refused before training", NOT_APPLICABLE: "not applicable",
        DIFFERS: "**differs from one process (to be fixed or refused)**"}


def markdown_table() -> str:
    """The table of docs/estimator.md's last section, one row per entry."""
    rows = ["| Symbol | On N ranks | Tested by |", "|---|---|---|"]
    for entry in ENTRIES:
        names = ", ".join(f"`{n}`" for n in entry.names)
        what = WHAT[entry.outcome] + (f": {entry.note}" if entry.note else "")
        tested = ", ".join(f"`{t.rsplit('/', 1)[-1]}`" for t in entry.tested_by)
        rows.append(f"| {names} | {what} | {tested} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["symbols"]:
        print("\n".join(public_symbols()))
    elif sys.argv[1:] == ["table"]:
        print(markdown_table(), end="")
    else:
        sys.exit(__doc__)

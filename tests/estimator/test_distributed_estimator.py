"""perseus_legacy.run_config(): tf.estimator training on real ranks (perseusrun -np 2 and 3), on
TF 2.21 (.venv) and on the real tf.estimator of TF 2.15.1 (.venv-tf215).

One launch per (TensorFlow, ranks) runs every scenario of tests/workers/est_distributed.py; the
tests below check what its ranks recorded against one plain single-process run of the same
scenarios on the global batch (the reference, no perseus_legacy code), with numpy:
variables within rtol 1e-5, atol 1e-6 (float32 sums in another order), identical across ranks.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from harness import (
    ROOT,
    LaunchPool,
    available,
    finish,
    load_values,
    python_for,
    run_ranks,
    start,
)

WORKER = "tests/workers/est_distributed.py"
STEPS = 4  # est_distributed.STEPS
RTOL, ATOL = 1e-5, 1e-6
LAUNCH_TIMEOUT = 420
# (TensorFlow, ranks) -> extra environment of that launch. On one launch rank 0's first
# evaluation lasts longer than PERSEUS_STALL_SHUTDOWN_SECS: the others must wait it out without
# a collective failing. The limit stays well above anything else a rank may take while the
# others wait for it: rank 0 once took over 30 s to finish and close its training session on a
# busy 2-core machine running four launches at once. On another launch, every rank logs.
STALL_SECS = 60
SLOW_EVAL = {("main", 2): STALL_SECS + 15}
LAUNCHES = {
    ("main", 2): {"PERSEUS_STALL_SHUTDOWN_SECS": str(STALL_SECS),
                  "PERSEUS_STALL_WARNING_SECS": str(STALL_SECS)},
    ("main", 3): {},
    ("tf215", 2): {},
    ("tf215", 3): {"PERSEUS_LOG_ALL_RANKS": "1"},
}


def run_reference(version: str, out: Path) -> tuple:
    """The single-process reference's (record, variables)."""
    [(code, log)] = finish([start(version, [ROOT / WORKER, out, "reference"])], LAUNCH_TIMEOUT)
    assert code == 0, f"the single-process reference exited {code}:\n{log[-8000:]}"
    return load(out, "reference")


def run_launch(version: str, np_: int, out: Path) -> dict:
    key = (version, np_)
    # mpirun lives in .venv; TF 2.15's tf.keras is Keras 2 (no tf-keras there).
    env = dict(LAUNCHES[key], PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}"
               f"{os.environ.get('PATH', '')}")
    if version == "tf215":
        env["TF_USE_LEGACY_KERAS"] = "0"
    proc = run_ranks(np_, WORKER, out, "distributed", SLOW_EVAL.get(key, 0),
                     timeout=LAUNCH_TIMEOUT, env=env, python=python_for(version))
    ranks = [load(out, f"rank{r}") for r in range(np_)]
    return {"ranks": ranks, "output": proc.stdout, "env": LAUNCHES[key]}


class Runs:
    """Every launch and the references, all started at once in the background (most of their
    time is spent waiting on each other's ranks, not computing); results per key."""

    def __init__(self) -> None:
        launches = {}
        for version, np_ in LAUNCHES:
            if available(version):  # a missing venv skips or fails its own tests
                launches[f"{version}_reference"] = functools.partial(run_reference, version)
                launches[f"{version}_np{np_}"] = functools.partial(run_launch, version, np_)
        self.pool = LaunchPool("distributed_estimator_", launches)

    def reference(self, version: str) -> tuple:
        """The reference run's (record, variables)."""
        return self.pool.result(f"{version}_reference")

    def launch(self, version: str, np_: int) -> dict:
        """Every rank's (record, variables) of the launch, with its output."""
        python_for(version)  # skips or fails, with the reason, when the venv is missing
        return self.pool.result(f"{version}_np{np_}")


def load(out: Path, who: str) -> tuple:
    return json.loads((out / f"{who}.json").read_text()), load_values(out / f"{who}.npz")


@pytest.fixture(scope="module")
def runs():
    result = Runs()
    yield result
    result.pool.close()


PARAMS = pytest.mark.parametrize("version,np_", list(LAUNCHES),
                                 ids=[f"{v}-np{n}" for v, n in LAUNCHES])


def scenario_values(values: dict, scenario: str) -> dict:
    return {k: v for k, v in values.items() if k.split("/", 1)[0] == scenario}


@PARAMS
def test_run_config_alone_or_with_hooks_trains_like_one_process_on_the_global_batch(
        runs, version, np_):
    """Custom model_fn (dense + embedding, Adam; each rank starts from other values) with the
    config alone and with estimator_hooks() too, and a DNNClassifier with the config alone: the
    final variables (Adam/Adagrad slots included) of every rank equal the single-process
    reference and each other; rank 0's last checkpoint equals the reference's. The hooks given
    explicitly add no collective: one allreduce per dense gradient, one allgather pair for the
    sparse one, one broadcast per variable."""
    launch = runs.launch(version, np_)
    ref_record, ref_values = runs.reference(version)
    rank0_values = launch["ranks"][0][1]
    for rank, (record, values) in enumerate(launch["ranks"]):
        for scenario in ("custom", "custom_hooks", "canned"):
            expected = scenario_values(ref_values, scenario)
            got = scenario_values(values, scenario)
            assert sorted(got) == sorted(expected), (rank, scenario)
            for name, want in expected.items():
                np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL,
                                           err_msg=f"rank {rank}: {name}")
                np.testing.assert_array_equal(got[name], rank0_values[name],
                                              err_msg=f"rank {rank} differs from rank 0: {name}")
            assert record[scenario]["end_step"] == STEPS, (rank, scenario, record[scenario])
        variables = len(scenario_values(values, "custom"))
        assert record["custom"]["collectives"] == record["custom_hooks"]["collectives"]
        assert record["custom_hooks"]["collectives"] == sorted(
            ["PerseusAllreduce"] * 2 + ["PerseusAllgather"] * 2
            + ["PerseusBroadcast"] * variables), record["custom_hooks"]["collectives"]
    for name, want in scenario_values(ref_values, "checkpoint").items():
        np.testing.assert_allclose(rank0_values[name], want, rtol=RTOL, atol=ATOL, err_msg=name)


@PARAMS
def test_retraining_agrees_on_rank_0s_checkpoint_step(runs, version, np_):
    """train() again to the same max_steps: no rank starts a session (all return, the launch
    exits 0); then to 2 * max_steps, then for steps=max_steps/2 more: every rank starts at rank
    0's saved step (the fresh ranks get its variables and step before StopAtStepHook counts
    from it) and ends with the reference's variables, identical across ranks."""
    launch = runs.launch(version, np_)
    _, ref_values = runs.reference(version)
    rank0_values = launch["ranks"][0][1]
    for rank, (record, values) in enumerate(launch["ranks"]):
        assert record["retrain_same"] == {"sessions": 0}, (rank, record["retrain_same"])
        for scenario, start_step, end_step in (("retrain_more", STEPS, 2 * STEPS),
                                               ("more_steps", 2 * STEPS, 2 * STEPS + STEPS // 2)):
            got = record[scenario]
            assert (got["sessions"], got["start_step"], got["end_step"]) == (
                1, start_step, end_step), (rank, scenario, got)
            for name, want in scenario_values(ref_values, scenario).items():
                np.testing.assert_allclose(values[name], want, rtol=RTOL, atol=ATOL,
                                           err_msg=f"rank {rank}: {name}")
                np.testing.assert_array_equal(values[name], rank0_values[name],
                                              err_msg=f"rank {rank} differs from rank 0: {name}")


@PARAMS
def test_train_and_evaluate_without_tf_config_evaluates_on_rank_0_for_every_rank(
        runs, version, np_):
    """train_and_evaluate under perseusrun without TF_CONFIG finishes; every rank returns rank
    0's final metrics, equal to the reference's. On main-np2 rank 0's first evaluation lasts
    longer than PERSEUS_STALL_SHUTDOWN_SECS: no stall is reported."""
    launch = runs.launch(version, np_)
    ref_record, _ = runs.reference(version)
    expected = ref_record["train_eval_metrics"]
    assert set(expected) == {"loss", "mae", "global_step"} and expected["global_step"] == STEPS
    for rank, (record, _) in enumerate(launch["ranks"]):
        got = record["train_eval_metrics"]
        assert got.keys() == expected.keys(), (rank, got)
        np.testing.assert_allclose([got[k] for k in sorted(got)],
                                   [expected[k] for k in sorted(expected)], rtol=RTOL, atol=ATOL)
        assert got == launch["ranks"][0][0]["train_eval_metrics"], rank
    assert "submitted by some ranks but not by others" not in launch["output"]
    assert "PERSEUS_STALL_SHUTDOWN_SECS" not in launch["output"]


@PARAMS
def test_only_rank_0_writes_and_private_model_dirs_are_removed_at_exit(runs, version, np_):
    """Each rank passes model_dir under its own directory (its own filesystem view): rank 0's
    holds checkpoints and summaries; no other rank created its model_dir, and nothing was written
    into their private temporary model_dirs, which are gone once the job exited."""
    launch = runs.launch(version, np_)
    log_all = "PERSEUS_LOG_ALL_RANKS" in launch["env"]
    chief, _ = launch["ranks"][0]
    for wanted in ("custom/checkpoint", f"custom/model.ckpt-{2 * STEPS + STEPS // 2}.index",
                   f"canned/model.ckpt-{STEPS}.index", "train_eval/checkpoint"):
        assert wanted in chief["view_files"], chief["view_files"]
    assert any(f.startswith("custom/events.out.tfevents") for f in chief["view_files"])
    assert any(f.startswith("train_eval/eval/events") for f in chief["view_files"])
    for rank, (record, _) in enumerate(launch["ranks"][1:], start=1):
        assert record["view_files"] == [], (rank, record["view_files"])
        assert len(record["private_dirs"]) == 3, record["private_dirs"]
        for path, files in record["private_files"].items():
            if log_all:  # the step counter's summaries
                files = [f for f in files if "tfevents" not in f]
            assert files == [], (rank, path, files)
            assert not os.path.exists(path), (rank, path)


@PARAMS
def test_progress_is_logged_by_rank_0_only(runs, version, np_):
    """log_step_count_steps=1: rank 0 logs global_step/sec, global examples/sec and the loss;
    the other ranks log no INFO line at all, unless PERSEUS_LOG_ALL_RANKS=1 (tf215-np3)."""
    launch = runs.launch(version, np_)
    log_all = "PERSEUS_LOG_ALL_RANKS" in launch["env"]
    for rank, (record, _) in enumerate(launch["ranks"]):
        progress = [line for line in record["custom_logs"] if "examples/sec" in line]
        if rank == 0 or log_all:
            assert progress, (rank, record["custom_logs"])
            assert all(f"(all {np_} ranks)" in line and "global_step/sec" in line
                       and "loss = " in line for line in progress), progress
        else:
            assert progress == [], (rank, progress)
            assert not [line for line in record["custom_logs"] if "loss = " in line]
